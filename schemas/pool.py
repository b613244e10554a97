"""workers <-> their node's messenger: the KV pool (NATS request/reply on messenger_control(node, op)).

ops: "lookup" (pin the longest held prefix, SSD hits promoted into DRAM slots), "reserve"
(slots to write new blocks into), "commit" (written: now stored), "release" (unpin / drop a
reservation), "pull" (fetch blocks from another node's messenger and keep them), "snapshot"
(everything the node holds, for the cache index). Block payloads never ride NATS: workers read
and write DRAM slots of the node's shared-memory slab in place; messengers move blocks between
nodes over their TCP link.
"""

from __future__ import annotations

from dataclasses import dataclass

from schemas.codec import Wire


@dataclass(frozen=True)
class SlotRef(Wire):
    key: int
    slot: int
    checksum: int = 0  # of the payload in the slot (0 in a reservation: not written yet)


@dataclass(frozen=True)
class LookupRequest(Wire):
    request_id: str
    keys: list[int]


@dataclass(frozen=True)
class LookupReply(Wire):
    blocks: list[SlotRef]  # the leading held blocks, in order, pinned for request_id
    slab_path: str = ""
    error: str = ""


@dataclass(frozen=True)
class ReserveRequest(Wire):
    request_id: str
    keys: list[int]
    first_depth: int  # block index of keys[0] in its prompt (for length-aware eviction)


@dataclass(frozen=True)
class ReserveReply(Wire):
    slots: list[SlotRef]  # for the keys not already held, pinned until commit/release
    slab_path: str = ""
    error: str = ""


@dataclass(frozen=True)
class CommitRequest(Wire):
    request_id: str
    blocks: list[SlotRef]  # with the checksums of what was written


@dataclass(frozen=True)
class ReleaseRequest(Wire):
    request_id: str
    keys: list[int]  # pinned by lookup (unpinned) or reserved and not written (dropped)


@dataclass(frozen=True)
class PullRequest(Wire):
    request_id: str
    source_node: str
    keys: list[int]  # blocks to fetch from source_node and keep here
    first_depth: int = 0


@dataclass(frozen=True)
class PoolReply(Wire):
    ok: bool
    error: str = ""
    num_blocks: int = 0
    nbytes: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class SnapshotReply(Wire):
    node: str
    epoch: str  # changes when the messenger restarts: its sequence numbers start again
    seq: int  # the KV event sequence number this snapshot is consistent with
    keys: list[int]
    tiers: list[str]  # tiers[i] is where keys[i] lives: "dram" | "ssd"


@dataclass(frozen=True)
class KvEventData(Wire):
    """The `data` of a KV event (moonbus.events.kv.<kind>.<node>): what the cache index applies."""

    node: str
    epoch: str
    seq: int
    keys: list[int]
    tier: str


@dataclass(frozen=True)
class FetchBlocks(Wire):
    """Over the TCP link: ask a peer messenger for blocks. Answer: FetchReply, then the payloads."""

    request_id: str
    keys: list[int]


@dataclass(frozen=True)
class FetchReply(Wire):
    keys: list[int]  # the leading requested keys the peer had, in order
    checksums: list[int]
    nbytes: int  # per block
    error: str = ""
