"""conductor (or anyone) -> cache_index: where does the longest prefix of these keys live?"""

from __future__ import annotations

from schemas.codec import Wire


class IndexQuery(Wire):
    keys: list[int]


class NodePrefix(Wire):
    prefix_len: int  # leading blocks held, any tier
    num_dram: int
    num_ssd: int


class IndexReply(Wire):
    per_node: dict[str, NodePrefix]
    best_len: int
    best_nodes: list[str]


class IndexDumpRequest(Wire):
    node: str


class IndexDumpReply(Wire):
    node: str
    seq: int
    keys: list[int]
    tiers: list[str]
