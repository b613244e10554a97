"""The SSD tier: KV block payloads in one LMDB environment, each stored with its checksum.

Record layout:

    key   = block key as 8 bytes big-endian (LMDB then orders records by key value)
    value = checksum as 8 bytes little-endian (xxh3_64 of the payload) || payload bytes

The map size is fixed at open: LMDB cannot grow past it, and a put that does not fit raises
lmdb.MapFullError inside the library. We turn that into `PutStatus.FULL` (the transaction is
aborted, nothing is half written) so the caller evicts a block and retries; it never crashes the
messenger. Size the map from the SSD capacity in blocks with headroom: LMDB pages add overhead
and a promotion briefly needs one extra block (see common/decide/pool.py); `map_size_for` does it.

Checksums are verified on every `get`: a mismatch raises `ChecksumMismatch`; the caller must
treat the block as a miss and `delete` it (the pool then `discard`s it).

The environment is opened with writemap (no extra copy through write()); the file is sparse, so
the map size costs no disk until used.

The directory is this user's alone (common.security.private_dir, kept: one that others could
write, or a link, is refused): LMDB opens its files in it as they are, links included.

Durability: with `sync=False` (default) commits are not fsynced; the SSD tier is a cache, losing
its tail in a crash only costs recomputation. `sync=True` fsyncs every commit.
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Iterator

import lmdb

from common.kv.blocks import ChecksumMismatch, checksum as payload_checksum
from common.security import private_dir

_CHECKSUM_NBYTES = 8


class PutStatus(enum.Enum):
    """Outcome of `SsdStore.put`."""

    OK = "ok"
    FULL = "full"  # the LMDB map is full: evict something and retry


def map_size_for(num_blocks: int, block_nbytes: int, headroom: float = 1.25) -> int:
    """An LMDB map size that holds `num_blocks` payloads (+1 for a promotion) with page overhead."""
    page = 4096
    pages_per_record = -(-(block_nbytes + _CHECKSUM_NBYTES + 64) // page)
    return int((num_blocks + 1) * pages_per_record * page * headroom) + 64 * page


class SsdStore:
    """Block key -> checksummed payload in LMDB."""

    def __init__(self, path: str, map_size: int, *, sync: bool = False) -> None:
        private_dir(Path(path), kept=True)
        self.path = path
        self.map_size = map_size
        self._env = lmdb.open(
            path,
            map_size=map_size,
            subdir=True,
            sync=sync,
            metasync=sync,
            readahead=False,  # random block reads: readahead only pollutes the page cache
            writemap=True,  # write payloads straight into the map: ~4x faster puts of 0.7 MB values
            max_dbs=0,
        )

    def put(self, key: int, payload: bytes | bytearray | memoryview, checksum: int | None = None) -> PutStatus:
        """Store (or overwrite) one block; FULL if the map has no room (nothing is written then)."""
        if checksum is None:
            checksum = payload_checksum(payload)
        value = checksum.to_bytes(_CHECKSUM_NBYTES, "little") + bytes(payload)
        try:
            with self._env.begin(write=True) as txn:
                txn.put(_key_bytes(key), value)
        except lmdb.MapFullError:
            return PutStatus.FULL
        return PutStatus.OK

    def get(self, key: int) -> bytes | None:
        """The block's payload, or None if absent. Raises `ChecksumMismatch` if it is corrupt."""
        with self._env.begin(buffers=True) as txn:
            value = txn.get(_key_bytes(key))
            if value is None:
                return None
            stored = int.from_bytes(value[:_CHECKSUM_NBYTES], "little")
            payload = value[_CHECKSUM_NBYTES:]
            actual = payload_checksum(payload)
            if actual != stored:
                raise ChecksumMismatch(stored, actual, key)
            return bytes(payload)

    def delete(self, key: int) -> bool:
        """Remove one block; False if it was not there."""
        with self._env.begin(write=True) as txn:
            return txn.delete(_key_bytes(key))

    def keys(self) -> Iterator[int]:
        """Every stored block key, in increasing order (a snapshot taken at the call)."""
        with self._env.begin() as txn:
            found = [int.from_bytes(k, "big") for k in txn.cursor().iternext(keys=True, values=False)]
        return iter(found)

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, int):
            return False
        with self._env.begin(buffers=True) as txn:
            return txn.get(_key_bytes(key)) is not None

    def __len__(self) -> int:
        return self._env.stat()["entries"]

    def sync(self) -> None:
        """Force buffered commits to disk."""
        self._env.sync(True)

    def close(self) -> None:
        self._env.close()

    def __enter__(self) -> "SsdStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _key_bytes(key: int) -> bytes:
    return key.to_bytes(8, "big")
