"""conductor (or anyone) -> cache_index: where does the longest prefix of these keys live?"""

from __future__ import annotations

from dataclasses import dataclass

from schemas.codec import Wire


@dataclass(frozen=True)
class IndexQuery(Wire):
    keys: list[int]


@dataclass(frozen=True)
class NodePrefix(Wire):
    prefix_len: int  # leading blocks held, any tier
    num_dram: int
    num_ssd: int


@dataclass(frozen=True)
class IndexReply(Wire):
    per_node: dict[str, NodePrefix]
    best_len: int
    best_nodes: list[str]


@dataclass(frozen=True)
class IndexDumpRequest(Wire):
    node: str


@dataclass(frozen=True)
class IndexDumpReply(Wire):
    node: str
    seq: int
    keys: list[int]
    tiers: list[str]
