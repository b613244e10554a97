"""The DRAM tier: one shared-memory file of fixed-size slots, allocated once, mmapped by everyone.

Layout of the file (default under /dev/shm, a tmpfs):

    offset 0      header, 4096 bytes: magic b"MBSLAB01", u64 num_slots, u64 slot_nbytes, u64 stride
    offset 4096   slot 0 | slot 1 | ... | slot num_slots-1      each `stride` bytes apart

`stride` is slot_nbytes rounded up to 64 bytes so every slot starts cache-line aligned (and the
page-sized header keeps slot 0 page aligned). One slot holds one KV block payload
(`KvLayout.block_nbytes`, layout documented in common/kv/blocks.py).

Roles. The messenger `create`s the slab and alone owns the free list (`alloc`/`free`); it tells
prefill/decode workers on the node which slot holds which block over the control channel. Workers
`attach` by path and read or write slots in place, zero copy, through `view`/`ndarray`/`tensor`.
The header only lets `attach` find the geometry; there is no shared allocator state to race on.

The file is fully reserved at creation (posix_fallocate) so running out of shared memory fails at
start, not as a SIGBUS in the middle of serving.

Close: numpy/torch views borrow the mmap; drop them before `close()` (else BufferError).

The file is opened without following links, and only as this user's own (common.security.open_own):
a link planted at its path is refused, its target untouched.
"""

from __future__ import annotations

import mmap
import os
import struct
from typing import Any

import numpy as np

from common.security import open_own

MAGIC = b"MBSLAB01"
HEADER_NBYTES = 4096
_HEADER = struct.Struct("<8sQQQ")
_ALIGN = 64
DEFAULT_DIR = "/dev/shm"


class SlabError(Exception):
    """Raised when a slab file is missing, malformed, or used outside its role or bounds."""


class DramSlab:
    """A fixed array of fixed-size slots in one mmapped shared-memory file."""

    def __init__(self, path: str, mm: mmap.mmap, num_slots: int, slot_nbytes: int, stride: int, owner: bool) -> None:
        self.path = path
        self.num_slots = num_slots
        self.slot_nbytes = slot_nbytes
        self.stride = stride
        self.owner = owner
        self._mm = mm
        # Owner only: slots not in use, popped from the end so low slots are reused first.
        self._free: list[int] = list(range(num_slots - 1, -1, -1)) if owner else []
        self._in_use = bytearray(num_slots if owner else 0)  # slot -> 1 while allocated

    # --- lifecycle -------------------------------------------------------------------------------

    @classmethod
    def create(cls, path: str, num_slots: int, slot_nbytes: int) -> "DramSlab":
        """Create the slab file, new (anything already at the path, a link included, is refused:
        the messenger removes its predecessors' first), and own its free list."""
        if num_slots <= 0 or slot_nbytes <= 0:
            raise ValueError(f"num_slots and slot_nbytes must be positive, got {num_slots}, {slot_nbytes}")
        stride = -(-slot_nbytes // _ALIGN) * _ALIGN
        total = HEADER_NBYTES + num_slots * stride
        fd = open_own(path, os.O_RDWR | os.O_CREAT | os.O_EXCL)
        try:
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, total)
            else:
                os.ftruncate(fd, total)
            mm = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        mm[: _HEADER.size] = _HEADER.pack(MAGIC, num_slots, slot_nbytes, stride)
        return cls(path, mm, num_slots, slot_nbytes, stride, owner=True)

    @classmethod
    def attach(cls, path: str) -> "DramSlab":
        """Map an existing slab created by the node's messenger (no allocation rights)."""
        try:
            fd = open_own(path, os.O_RDWR)  # this user's plain file, not a link to one
        except FileNotFoundError:
            raise SlabError(f"no slab at {path}") from None
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_NBYTES:
                raise SlabError(f"{path} is too small to be a slab ({size} bytes)")
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        magic, num_slots, slot_nbytes, stride = _HEADER.unpack_from(mm, 0)
        if magic != MAGIC or size < HEADER_NBYTES + num_slots * stride:
            mm.close()
            raise SlabError(f"{path} is not a moonbus slab (or is truncated)")
        return cls(path, mm, num_slots, slot_nbytes, stride, owner=False)

    def close(self) -> None:
        """Unmap (every view of a slot must be gone by now)."""
        if not self._mm.closed:
            self._mm.close()

    def unlink(self) -> None:
        """Remove the file (owner, at shutdown); attached mappings stay valid until closed."""
        self._require_owner("unlink")
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def __enter__(self) -> "DramSlab":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- allocation (owner only) -------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        """A free slot number, or None when every slot is in use."""
        self._require_owner("alloc")
        if not self._free:
            return None
        slot = self._free.pop()
        self._in_use[slot] = 1
        return slot

    def free(self, slot: int) -> None:
        """Return a slot to the free list."""
        self._require_owner("free")
        self._check(slot)
        if not self._in_use[slot]:
            raise SlabError(f"slot {slot} is not allocated (double free?)")
        self._in_use[slot] = 0
        self._free.append(slot)

    # --- data (any role) -----------------------------------------------------------------------------

    def view(self, slot: int) -> memoryview:
        """Writable zero-copy view of one slot's bytes."""
        offset = self._offset(slot)
        return memoryview(self._mm)[offset : offset + self.slot_nbytes]

    def ndarray(self, slot: int, dtype: Any = np.uint8, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """Zero-copy numpy view of one slot, e.g. `ndarray(s, "float32", layout.block_shape)`."""
        array = np.frombuffer(self._mm, dtype=dtype, count=self.slot_nbytes // np.dtype(dtype).itemsize,
                              offset=self._offset(slot))
        return array.reshape(shape) if shape is not None else array

    def tensor(self, slot: int, layout: Any) -> Any:
        """Zero-copy torch view of one slot shaped `layout.block_shape` (a common.kv.KvLayout)."""
        import torch

        if layout.block_nbytes != self.slot_nbytes:
            raise SlabError(f"layout block is {layout.block_nbytes} bytes, slots are {self.slot_nbytes}")
        dtype = getattr(torch, layout.dtype)
        flat = torch.frombuffer(self._mm, dtype=dtype, count=self.slot_nbytes // layout.itemsize,
                                offset=self._offset(slot))
        return flat.view(layout.block_shape)

    def write(self, slot: int, data: bytes | bytearray | memoryview) -> None:
        """Copy one payload into a slot (it must be exactly `slot_nbytes`)."""
        if len(memoryview(data).cast("B")) != self.slot_nbytes:
            raise SlabError(f"payload is {len(memoryview(data).cast('B'))} bytes, slots are {self.slot_nbytes}")
        offset = self._offset(slot)
        self._mm[offset : offset + self.slot_nbytes] = data

    def read(self, slot: int) -> bytes:
        """A copy of one slot's bytes."""
        offset = self._offset(slot)
        return self._mm[offset : offset + self.slot_nbytes]

    def offset(self, slot: int) -> int:
        """Where a slot starts in the file (its place in `buffer()`: what a peer reads over the transport)."""
        return self._offset(slot)

    def buffer(self) -> memoryview:
        """The whole mapping, header included (registered with the transports; release it before `close`)."""
        return memoryview(self._mm)

    def read_into(self, slot: int, out: bytearray | memoryview | np.ndarray) -> None:
        """Copy one slot into a caller's buffer of `slot_nbytes` bytes (no allocation)."""
        offset = self._offset(slot)
        memoryview(out).cast("B")[:] = memoryview(self._mm)[offset : offset + self.slot_nbytes]

    # --- internals ---------------------------------------------------------------------------------

    def _check(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise SlabError(f"slot {slot} out of range [0, {self.num_slots})")

    def _offset(self, slot: int) -> int:
        self._check(slot)
        return HEADER_NBYTES + slot * self.stride

    def _require_owner(self, what: str) -> None:
        if not self.owner:
            raise SlabError(f"{what} is the owner's job (this process attached to {self.path})")
