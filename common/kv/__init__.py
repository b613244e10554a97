"""The pure core of the KV pool: block keys and payload layout, eviction policies, tier accounting.

Nothing here does I/O or reads a clock; the messenger, the cache index service and the simulator
all import it. The DRAM slab (slab.py, mapped by every process of a node) lives here too; the SSD store is the
messenger's (services/messenger/ssd.py).
"""

from common.kv.blocks import (
    DEFAULT_SEED,
    ChecksumMismatch,
    KvLayout,
    LayoutMismatch,
    assemble_blocks,
    block_keys,
    block_keys_from_hash_ids,
    checksum,
    pack_block,
    split_blocks,
    unpack_block,
    verify,
)
from common.decide.eviction import POLICIES, EvictionPolicy, NotPinned, UnknownBlock, make_policy
from common.decide.pool import (
    DRAM,
    SSD,
    Demoted,
    Evicted,
    NoRoom,
    PoolAction,
    PrefixLookup,
    Promoted,
    Stored,
    TieredPool,
    capacity_in_blocks,
)

__all__ = [
    "DEFAULT_SEED", "ChecksumMismatch", "KvLayout", "LayoutMismatch", "assemble_blocks", "block_keys",
    "block_keys_from_hash_ids", "checksum", "pack_block", "split_blocks", "unpack_block", "verify",
    "POLICIES", "EvictionPolicy", "NotPinned", "UnknownBlock", "make_policy",
    "DRAM", "SSD", "Demoted", "Evicted", "NoRoom", "PoolAction", "PrefixLookup", "Promoted", "Stored",
    "TieredPool", "capacity_in_blocks",
]
