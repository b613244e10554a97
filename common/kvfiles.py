"""A request's whole KV as one file in a node's shared-memory directory.

Prefill writes it, the messengers move it between nodes, decode reads it. Layout (see
schemas.transfer.KvHandle): C-order float32 [num_layers, 2, num_kv_heads, num_tokens, head_dim].
The checksum (xxh3-64 of the bytes) is verified on every read and after every transfer.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from common.kv import blocks

from schemas.transfer import KvHandle


class KvChecksumError(ValueError):
    """Raised when KV bytes read back do not match the checksum they were written with."""


def checksum(buf: bytes | memoryview | np.ndarray) -> int:
    return blocks.checksum(memoryview(buf).cast("B"))


def write(shm_dir: Path, node: str, name: str, kv: torch.Tensor) -> KvHandle:
    array = kv.detach().to(torch.float32).contiguous().numpy()
    shm_dir.mkdir(parents=True, exist_ok=True)
    tmp = shm_dir / f".{name}.tmp"
    array.tofile(tmp)
    os.replace(tmp, shm_dir / name)  # readers never see a half-written file
    return KvHandle(node, name, list(array.shape), "float32", checksum(array))


def write_bytes(shm_dir: Path, handle: KvHandle, payload: bytes | memoryview, node: str) -> KvHandle:
    """Land bytes received from another node; returns the local handle (checksum verified)."""
    if checksum(payload) != handle.checksum:
        raise KvChecksumError(f"KV {handle.name}: checksum mismatch after transfer")
    shm_dir.mkdir(parents=True, exist_ok=True)
    tmp = shm_dir / f".{handle.name}.tmp"
    with open(tmp, "wb") as fh:
        fh.write(payload)
    os.replace(tmp, shm_dir / handle.name)
    return KvHandle(node, handle.name, handle.shape, handle.dtype, handle.checksum)


def read(shm_dir: Path, handle: KvHandle, remove: bool = False) -> torch.Tensor:
    path = shm_dir / handle.name
    array = np.fromfile(path, dtype=np.float32)
    if remove:
        path.unlink(missing_ok=True)
    if checksum(array) != handle.checksum:
        raise KvChecksumError(f"KV {handle.name}: checksum mismatch")
    return torch.from_numpy(array).view(*handle.shape)


def path_of(shm_dir: Path, handle: KvHandle) -> Path:
    return shm_dir / handle.name


def remove(shm_dir: Path, handle: KvHandle) -> None:
    (shm_dir / handle.name).unlink(missing_ok=True)
