"""Moving KV between nodes: the transport's frames and the control messages around them.

Bytes go over the point-to-point transport (common/transport: tcp, rdma), never over NATS.

The streamed handoff, prefill -> the decode node's messenger (services/messenger/handoff.py):
  AcceptKv -> AcceptKvReply     NATS messenger_control(decode node, "accept"): reserve the
                                destination region, sized by the prompt's KV layout
  writes                        one per layer slice, at its offsets in the region [L, 2, H, S, D]
  CompleteKv -> CompleteKvReply transport call "complete" (ordered after the writes): every slice
                                landed and verified -> the KvHandle the DecodeTask carries
  AbortKv                       NATS messenger_control(decode node, "abort"): drop the reservation
Block pulls, messenger -> messenger (services/messenger/pulls.py):
  PinBlocks -> PinReply         transport call "pin": the leading blocks the peer holds, pinned
                                for this connection, with their offsets in its slab region
  reads                         one-sided reads of those offsets into the puller's reserved slots
  UnpinBlocks                   transport call "unpin" (naming the blocks that failed their checksum)
The TCP backend's frames (common/transport/tcp.py): WriteFrame, ReadFrame, CallFrame, ReplyFrame.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from schemas.codec import Wire, WireError, check_file_name, check_token
from schemas.pool import SlotRef, check_holder


@dataclass(frozen=True)
class KvHandle(Wire):
    """A request's KV, as a file in a node's shared-memory directory.

    Layout: C-order array shaped [num_layers, 2 (K, V), num_kv_heads, num_tokens, head_dim].
    """

    node: str
    name: str
    shape: list[int]
    dtype: str
    checksum: int  # xxh3-64 of the file (0 when `verified`)
    verified: bool = False  # every slice was verified on arrival by the node's messenger: read without checking again

    def __post_init__(self) -> None:
        check_token("node", self.node)
        check_file_name("name", self.name)
        if len(self.shape) != 5 or any(d < 0 for d in self.shape) or self.dtype != "float32":
            raise ValueError(f"KV {self.name}: shape {self.shape} / dtype {self.dtype} is not a float32 [L, 2, H, S, D]")

    @property
    def num_tokens(self) -> int:
        return self.shape[3]


MAX_PIECES = 4096  # pieces of one write or read: a KV slice has 2 x kv heads of them
MAX_STRIPES = 16  # connections one write may be striped over


def _check_pieces(pieces: list[list[int]]) -> None:
    if len(pieces) > MAX_PIECES:
        raise WireError(f"{len(pieces)} pieces (at most {MAX_PIECES})")
    for piece in pieces:
        if len(piece) != 2 or piece[0] < 0 or piece[1] < 0:
            raise WireError(f"piece {piece} is not [offset, nbytes]")


@dataclass(frozen=True)
class RegionRef(Wire):
    """A registered region of some process, as its peers address it (common/transport)."""

    region: str
    nbytes: int
    endpoints: dict[str, str]  # transport -> locator (tcp: host:port of the owner's listener)

    def __post_init__(self) -> None:
        check_token("region", self.region)
        if self.nbytes < 0:
            raise WireError(f"region {self.region}: {self.nbytes} bytes")


# --- the streamed handoff -----------------------------------------------------------------------
@dataclass(frozen=True)
class AcceptKv(Wire):
    """prefill -> the decode node's messenger: reserve room for this request's KV, written slice by slice."""

    request_id: str
    attempt: int
    num_tokens: int  # the region is [L, 2, H, num_tokens, D] of the node's model layout
    holder: str  # the prefill process ("<instance>:<incarnation>"): the reservation dies with it
    dest_instance: str  # the decode instance the KV is for (the landed file carries its name)
    src_node: str = ""  # the prefill's node (metrics, logs)

    def __post_init__(self) -> None:
        check_token("request_id", self.request_id)
        check_token("dest_instance", self.dest_instance)
        check_holder(self.holder)
        if self.src_node:
            check_token("src_node", self.src_node)


@dataclass(frozen=True)
class AcceptKvReply(Wire):
    ok: bool
    region: RegionRef | None = None
    error: str = ""


@dataclass(frozen=True)
class CompleteKv(Wire):
    """The completion notice (a transport call, after the last slice): the KV is whole."""

    region: str

    def __post_init__(self) -> None:
        check_token("region", self.region)


@dataclass(frozen=True)
class CompleteKvReply(Wire):
    ok: bool
    dest: KvHandle | None = None
    error: str = ""


@dataclass(frozen=True)
class AbortKv(Wire):
    """prefill -> the decode node's messenger: the request will not be handed off; free its region
    (named by the request's attempt and decode instance: the accept's reply may never have come)."""

    request_id: str
    attempt: int
    dest_instance: str

    def __post_init__(self) -> None:
        check_token("request_id", self.request_id)
        check_token("dest_instance", self.dest_instance)


# --- block pulls --------------------------------------------------------------------------------
@dataclass(frozen=True)
class PinBlocks(Wire):
    request_id: str
    keys: list[int]

    def __post_init__(self) -> None:
        check_token("request_id", self.request_id)


@dataclass(frozen=True)
class PinReply(Wire):
    """The leading requested blocks the peer holds, pinned until "unpin" or the connection ends."""

    region: RegionRef | None  # the peer's DRAM slab
    blocks: list[SlotRef]  # key, slot, checksum
    offsets: list[int]  # where each block starts in the region
    block_nbytes: int


@dataclass(frozen=True)
class UnpinBlocks(Wire):
    corrupt: list[int] = field(default_factory=list)  # keys whose payload failed its checksum on arrival


# --- the TCP backend's frames -------------------------------------------------------------------
@dataclass(frozen=True)
class WriteFrame(Wire):
    region: str
    pieces: list[list[int]]  # [offset, nbytes], in the order of the payload
    meta: dict[str, int] = field(default_factory=dict)  # handed to the region's owner (e.g. layer, start, tokens)
    # A write striped over several connections arrives as `parts` frames sharing `group`; the one
    # with `whole` carries the write's own pieces, which the owner is handed once every part landed.
    group: str = ""
    parts: int = 1
    whole: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_token("region", self.region)
        _check_pieces(self.pieces)
        if self.parts != 1 or self.group:
            check_token("group", self.group)
            if not 1 <= self.parts <= MAX_STRIPES:
                raise WireError(f"write in {self.parts} parts (at most {MAX_STRIPES})")
        _check_pieces(self.whole)


@dataclass(frozen=True)
class ReadFrame(Wire):
    region: str
    pieces: list[list[int]]

    def __post_init__(self) -> None:
        check_token("region", self.region)
        _check_pieces(self.pieces)


@dataclass(frozen=True)
class CallFrame(Wire):
    op: str
    nbytes: int  # of the body that follows

    def __post_init__(self) -> None:
        check_token("op", self.op)
        if not 0 <= self.nbytes <= 1 << 20:
            raise WireError(f"call body of {self.nbytes} bytes")


@dataclass(frozen=True)
class ReplyFrame(Wire):
    ok: bool
    error: str = ""
    nbytes: int = 0  # of what follows (a read's bytes, a call's reply)
