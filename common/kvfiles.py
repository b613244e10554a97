"""A request's whole KV as one file in a node's shared-memory directory.

Prefill writes it, the messengers move it between nodes, decode reads it. Layout (see
schemas.transfer.KvHandle): C-order float32 [num_layers, 2, num_kv_heads, num_tokens, head_dim].
The checksum (xxh3-64 of the bytes) is verified on every read and after every transfer.

Names say who owns a file, so that nothing outlives its request (a node's tmpfs is not capped):

    out-<request>-a<attempt>.kv              written by the node's prefill instance, until it is sent
    in-<decode>__<request>-a<attempt>.kv     landed by the node's messenger for one decode instance,
                                             until it reads it
    .<name>.tmp                              either, while being written

A restarted prefill sweeps `out-*` (its dead predecessor's), a restarted decode its `in-<id>__*`,
and a running decode those of its files whose task never came (lost in a broker outage); a
restarted messenger sweeps the temporary files of transfers it was landing, and every messenger
removes files older than its stale age as a last resort.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from typing import TYPE_CHECKING

import numpy as np

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


def write(shm_dir: Path, node: str, name: str, kv: "torch.Tensor") -> KvHandle:
    import torch

    array = kv.detach().to(torch.float32).contiguous().numpy()
    shm_dir.mkdir(parents=True, exist_ok=True)
    path = path_of(shm_dir, name)
    tmp = shm_dir / f".{name}.tmp"
    try:
        array.tofile(tmp)
        os.replace(tmp, path)  # readers never see a half-written file
    finally:
        tmp.unlink(missing_ok=True)
    return KvHandle(node, name, list(array.shape), "float32", checksum(array))


def write_bytes(shm_dir: Path, handle: KvHandle, payload: bytes | memoryview, node: str,
                decode_instance: str = "") -> KvHandle:
    """Land bytes received from another node as `incoming_name(...)`; returns the local handle
    (checksum verified)."""
    if checksum(payload) != handle.checksum:
        raise KvChecksumError(f"KV {handle.name}: checksum mismatch after transfer")
    name = incoming_name(handle.name, decode_instance)
    path = path_of(shm_dir, name)
    shm_dir.mkdir(parents=True, exist_ok=True)
    tmp = shm_dir / f".{name}.tmp"
    try:
        with open(tmp, "wb") as fh:
            fh.write(payload)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return KvHandle(node, name, handle.shape, handle.dtype, handle.checksum)


def read(shm_dir: Path, handle: KvHandle, remove: bool = False) -> "torch.Tensor":
    import torch

    path = path_of(shm_dir, handle)
    try:
        array = np.fromfile(path, dtype=np.float32)
    finally:
        if remove:
            path.unlink(missing_ok=True)
    if checksum(array) != handle.checksum:
        raise KvChecksumError(f"KV {handle.name}: checksum mismatch")
    if array.size != int(np.prod(handle.shape)):
        raise KvChecksumError(f"KV {handle.name}: {array.size} values for shape {handle.shape}")
    return torch.from_numpy(array).view(*handle.shape)


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
          keep: set[str] = frozenset()) -> int:
    """Remove request files of an owner (prefix) or older than an age, except those in `keep`;
    returns how many."""
    now = time.time()
    removed = 0
    for path in request_files(shm_dir, prefix):
        if (temporary_only and not path.name.endswith(".tmp")) or path.name in keep:
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
    """Remove a decode instance's landed files (older than an age), except those it still holds."""
    prefix = incoming_prefix(decode_instance)
    if prefix == IN:
        return 0  # not attributable to one instance: left to the messenger's stale sweep
    return sweep(shm_dir, prefix, older_than_s=older_than_s, keep=keep)
