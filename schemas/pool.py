"""workers <-> their node's messenger: the KV pool (NATS request/reply on messenger_control(node, op)).

ops: "lookup" (pin the longest held prefix, SSD hits promoted into DRAM slots), "reserve"
(slots to write new blocks into), "commit" (written: now stored), "release" (unpin / drop a
reservation), "pull" (fetch blocks from another node's messenger and keep them), "snapshot"
(everything the node holds, for the cache index). Block payloads never ride NATS: workers read
and write DRAM slots of the node's shared-memory slab in place; messengers move blocks between
nodes over the point-to-point transport (schemas/transfer.py: pin, read, unpin).
"""

from __future__ import annotations

from schemas.codec import OptionalHolder, Token, Wire


class _Held:
    """A pool request made on behalf of one holder: `holder` is the worker process
    ("<instance_id>:<incarnation>", empty for the messenger itself). Pins are keyed by
    (holder, request_id), so the prefill and the decode of one request on one node never
    release each other's pins, and a dead process's pins can be released by its holder name."""

    request_id: str
    holder: str

    @property
    def hold_key(self) -> str:
        return f"{self.holder}/{self.request_id}"


class SlotRef(Wire):
    key: int
    slot: int
    checksum: int = 0  # of the payload in the slot (0 in a reservation: not written yet)


class LookupRequest(_Held, Wire):
    request_id: Token
    keys: list[int]
    holder: OptionalHolder = ""


class LookupReply(Wire):
    blocks: list[SlotRef]  # the leading held blocks, in order, pinned for request_id
    slab_path: str = ""
    error: str = ""


class ReserveRequest(_Held, Wire):
    request_id: Token
    keys: list[int]
    first_depth: int  # block index of keys[0] in its prompt (for length-aware eviction)
    holder: OptionalHolder = ""


class ReserveReply(Wire):
    slots: list[SlotRef]  # for the keys not already held, pinned until commit/release
    slab_path: str = ""
    error: str = ""


class CommitRequest(_Held, Wire):
    request_id: Token
    blocks: list[SlotRef]  # with the checksums of what was written
    holder: OptionalHolder = ""


class ReleaseRequest(_Held, Wire):
    request_id: Token
    keys: list[int]  # pinned by lookup (unpinned) or reserved and not written (dropped)
    holder: OptionalHolder = ""
    corrupt: list[int] = []  # blocks whose checksum failed on the holder's read: drop them


class PullRequest(_Held, Wire):
    request_id: Token
    source_node: Token
    keys: list[int]  # blocks to fetch from source_node and keep here
    first_depth: int = 0
    holder: OptionalHolder = ""


class PoolReply(Wire):
    ok: bool
    error: str = ""
    num_blocks: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    transport: str = ""  # a pull: how the blocks came (tcp, rdma)


class SnapshotReply(Wire):
    node: str
    epoch: str  # changes when the messenger restarts: its sequence numbers start again
    seq: int  # the KV event sequence number this snapshot is consistent with
    keys: list[int]
    tiers: list[str]  # tiers[i] is where keys[i] lives: "dram" | "ssd"


class KvEventData(Wire):
    """The `data` of a KV event (moonbus.events.kv.<kind>.<node>): what the cache index applies."""

    node: str
    epoch: str
    seq: int
    keys: list[int]
    tier: str
    request_id: str = ""  # a `corrupt` event: the request whose read found it (audit only)


class PoolStatus(Wire):
    """messenger_control(node, "status"): how full the node's pool is and who pins what (for leak checks)."""

    node: str
    epoch: str
    slab_path: str
    dram_capacity_blocks: int
    dram_used_blocks: int
    ssd_capacity_blocks: int
    ssd_used_blocks: int
    pinned_blocks: int  # blocks pinned by some holder (a lookup being read, a reservation being written)
    holders: dict[str, int]  # holder ("<instance>:<incarnation>/<request_id>") -> blocks it pins
    request_files: int  # request KV files (and their temporary files) in the node's shared-memory directory
    request_file_bytes: int
