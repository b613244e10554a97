"""A request's whole KV as one file in a node's shared-memory directory.

The decode reads it. Layout (see schemas.transfer.KvHandle): C-order [num_layers, 2,
num_kv_heads, num_tokens, head_dim] in the model's dtype (bfloat16 as raw 16-bit words: numpy
has no bfloat16). Across nodes it is the destination of a streamed handoff
(services/messenger/handoff.py): the decode node's messenger reserves it and the prefill writes
each layer slice into it, every slice verified on arrival, the whole file's checksum taken as its
layers complete. On one node (a coupled instance) the prefill writes it itself, with a checksum.
Either way the decode checks the checksum as it reads (`read_into`), whatever the handle says
(`verified` included): a file changed after it was written or landed is refused, not decoded. It
costs one xxh3 pass, about 0.5 ms on a 3 to 4 ms read of 24 MB (30 layers x 2 x 3 heads x 1,024
tokens x 64, bfloat16; measured).
Files are opened without following links (common.security.open_own).

Names say who owns a file, so that nothing outlives its request (a node's tmpfs is not capped):

    out-<request>-a<attempt>.kv              written by the node's prefill instance for a decode
                                             instance of the same node, until that one reads it
    in-<decode>__<request>-a<attempt>.kv     landed by the node's messenger for one decode instance,
                                             until it reads it
    .<name>.tmp                              either, while being written (an `in-` one is a handoff
                                             reservation: its messenger's, under its leases)

A restarted prefill sweeps `out-*` (its dead predecessor's), a restarted decode its `in-<id>__*`,
and a running decode those of its landed files whose task never came (lost in a broker outage);
a restarted messenger sweeps the reservations its predecessor held, and every messenger removes
files older than its stale age as a last resort.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from typing import TYPE_CHECKING

import numpy as np
import xxhash

from common import security
from common.kv import blocks
from schemas.codec import check_file_name

from schemas.transfer import KvHandle

if TYPE_CHECKING:  # torch is imported where a tensor is made: the messenger never needs it
    import torch

OUT, IN = "out-", "in-"


class KvChecksumError(ValueError):
    """Raised when KV bytes read back do not match the checksum they were written with."""


def checksum(buf: bytes | memoryview | np.ndarray) -> int:
    return blocks.checksum(memoryview(buf).cast("B"))


def outgoing_name(request_id: str, attempt: int) -> str:
    return f"{OUT}{request_id}-a{attempt}.kv"


def incoming_prefix(decode_instance: str) -> str:
    return f"{IN}{decode_instance}__" if decode_instance and "__" not in decode_instance else IN


def incoming_name(name: str, decode_instance: str = "") -> str:
    """What a file sent from another node is called once it lands here (for that decode instance)."""
    return incoming_prefix(decode_instance) + name.removeprefix(OUT)


def path_of(shm_dir: Path, handle: KvHandle | str) -> Path:
    """The file's path; the name is validated again here, since it may have come off the network."""
    name = handle if isinstance(handle, str) else handle.name
    check_file_name("KV file name", name)
    return shm_dir / name


def as_array(kv: "torch.Tensor") -> np.ndarray:
    """The tensor's bytes as a numpy array (bfloat16 as uint16 words), no copy when contiguous."""
    import torch

    kv = kv.detach().contiguous()
    return kv.view(torch.uint16).numpy() if kv.dtype == torch.bfloat16 else kv.numpy()


def numpy_dtype(dtype: str) -> np.dtype:
    """How a KV dtype's values are held in numpy (bfloat16: its raw 16-bit words)."""
    return np.dtype(np.uint16) if dtype == "bfloat16" else np.dtype(dtype)


def as_tensor(array: np.ndarray, dtype: str) -> "torch.Tensor":
    import torch

    tensor = torch.from_numpy(array)
    return tensor.view(torch.bfloat16) if dtype == "bfloat16" else tensor


def write(shm_dir: Path, node: str, name: str, kv: "torch.Tensor") -> KvHandle:
    dtype = blocks.dtype_name(kv)
    array = as_array(kv)
    shm_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = path_of(shm_dir, name)
    tmp = shm_dir / f".{name}.tmp"
    fd = security.open_own(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)  # new: never through a planted link
    try:
        with open(fd, "wb") as f:
            array.tofile(f)
        os.replace(tmp, path)  # readers never see a half-written file (a link at `path` is replaced, not followed)
    finally:
        tmp.unlink(missing_ok=True)
    return KvHandle(node, name, list(array.shape), dtype, checksum(array))


def read(shm_dir: Path, handle: KvHandle, remove: bool = False) -> "torch.Tensor":
    """The KV in the file, checked against its checksum."""
    out = as_tensor(np.empty(handle.shape, dtype=numpy_dtype(handle.dtype)), handle.dtype)
    read_into(shm_dir, handle, out, remove)
    return out


def read_into(shm_dir: Path, handle: KvHandle, out: "torch.Tensor", remove: bool = False) -> None:
    """The KV in the file, read straight into `out` (shaped as the handle says, in its dtype; each
    [tokens, head_dim] slice contiguous, as a row of a larger buffer is): one pass over the bytes,
    checked against the checksum as they come, always (a handle's `verified` says only that the
    slices were checked when they landed: the file may have changed since)."""
    if list(out.shape) != list(handle.shape) or blocks.dtype_name(out) != handle.dtype:
        raise ValueError(f"KV {handle.name}: {handle.dtype} {handle.shape} cannot be read into "
                         f"{out.dtype} {list(out.shape)}")
    pieces = (out,) if out.is_contiguous() else out.view(-1, *out.shape[3:]).unbind(0)  # view: never a copy
    if not pieces[0].is_contiguous():
        raise ValueError(f"KV {handle.name}: each [tokens, head_dim] slice of the target must be contiguous")
    path = path_of(shm_dir, handle)
    hasher = xxhash.xxh3_64()
    try:
        with open(security.open_own(path, os.O_RDONLY), "rb", buffering=0) as f:
            if os.fstat(f.fileno()).st_size != out.numel() * out.element_size():
                raise KvChecksumError(f"KV {handle.name}: the file does not hold shape {handle.shape}")
            for piece in pieces:
                view = memoryview(as_array(piece)).cast("B")
                if f.readinto(view) != len(view):
                    raise KvChecksumError(f"KV {handle.name}: the file ended early")
                hasher.update(view)
    finally:
        if remove:
            path.unlink(missing_ok=True)
    if hasher.intdigest() != handle.checksum:
        raise KvChecksumError(f"KV {handle.name}: checksum mismatch: the file is not what was written or landed "
                              f"(changed since, or corrupt); refused")


def remove(shm_dir: Path, handle: KvHandle | None) -> None:
    if handle is not None:
        path_of(shm_dir, handle).unlink(missing_ok=True)


# --- housekeeping -------------------------------------------------------------------------------

def _is_request_file(name: str) -> bool:
    return name.endswith(".kv") or (name.startswith(".") and name.endswith(".kv.tmp"))


def request_files(shm_dir: Path, prefix: str = "") -> list[Path]:
    """Request KV files (and their temporary files) in the directory, optionally by owner prefix."""
    if not shm_dir.is_dir():
        return []
    return [p for p in shm_dir.iterdir()
            if _is_request_file(p.name) and p.name.lstrip(".").startswith(prefix)]


def usage(shm_dir: Path) -> tuple[int, int]:
    """(request files, their bytes) in a node's shared-memory directory."""
    files, nbytes = 0, 0
    for path in request_files(shm_dir):
        try:
            nbytes += path.stat().st_size
            files += 1
        except FileNotFoundError:
            pass
    return files, nbytes


def sweep(shm_dir: Path, prefix: str = "", temporary_only: bool = False, older_than_s: float = 0.0,
          keep: set[str] = frozenset(), finished_only: bool = False) -> int:
    """Remove request files of an owner (prefix) or older than an age, except those in `keep` (and,
    with `finished_only`, those still being written); returns how many."""
    now = time.time()
    removed = 0
    for path in request_files(shm_dir, prefix):
        temporary = path.name.endswith(".tmp")
        if (temporary_only and not temporary) or (finished_only and temporary) or path.name in keep:
            continue
        try:
            if older_than_s and now - path.stat().st_mtime < older_than_s:
                continue
            path.unlink()
            removed += 1
        except FileNotFoundError:
            pass
    return removed


def sweep_outgoing(shm_dir: Path) -> int:
    return sweep(shm_dir, OUT)


def sweep_incoming(shm_dir: Path, decode_instance: str, older_than_s: float = 0.0, keep: set[str] = frozenset()) -> int:
    """Remove a decode instance's landed files (older than an age), except those it still holds.
    With an age, files still being landed (handoff reservations: their messenger's) are left alone."""
    prefix = incoming_prefix(decode_instance)
    if prefix == IN:
        return 0  # not attributable to one instance: left to the messenger's stale sweep
    return sweep(shm_dir, prefix, older_than_s=older_than_s, keep=keep, finished_only=older_than_s > 0)
