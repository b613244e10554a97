"""KV blocks: block keys and the payload layout (blocks.py), and the DRAM slab every process of a
node maps (slab.py). Pure but for the slab's memory. The pool's decisions (eviction, tier
accounting) live on the decision floor, common/decide/ (pool.py, eviction.py); the SSD store is
the messenger's (services/messenger/ssd.py).
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

__all__ = [
    "DEFAULT_SEED", "ChecksumMismatch", "KvLayout", "LayoutMismatch", "assemble_blocks", "block_keys",
    "block_keys_from_hash_ids", "checksum", "pack_block", "split_blocks", "unpack_block", "verify",
]
