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
The TCP backend's frames (common/transport/tcp.py): WriteFrame, ReadFrame, CallFrame, ReplyFrame;
on a keyed link (the default) every frame ends with its MAC, else a write's payload with its xxh3.
RDMA writes and reads carry their own keyed MAC in the calls around them (common/transport/rdma.py).
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from schemas.codec import FileName, Holder, NonNegative, OptionalToken, Token, Wire, WireError
from schemas.pool import SlotRef


class KvHandle(Wire):
    """A request's KV, as a file in a node's shared-memory directory.

    Layout: C-order array shaped [num_layers, 2 (K, V), num_kv_heads, num_tokens, head_dim].
    """

    node: Token
    name: FileName
    shape: Annotated[list[NonNegative], Meta(min_length=5, max_length=5)]  # [L, 2, H, S, D]
    dtype: Literal["float32", "bfloat16"]  # the model's: the KV is kept in it end to end
    checksum: int  # xxh3-64 of the file (0 when `verified`)
    verified: bool = False  # every slice was verified on arrival by the node's messenger: read without checking again

    @property
    def num_tokens(self) -> int:
        return self.shape[3]


MAX_PIECES = 4096  # pieces of one write or read: a KV slice has 2 x kv heads of them
MAX_STRIPES = 16  # connections one write may be striped over
MAX_CALL_BYTES = 1 << 20  # a call's body

Piece = Annotated[list[NonNegative], Meta(min_length=2, max_length=2)]  # [offset, nbytes]
Pieces = Annotated[list[Piece], Meta(max_length=MAX_PIECES)]


class RegionRef(Wire):
    """A registered region of some process, as its peers address it (common/transport)."""

    region: Token
    nbytes: NonNegative
    endpoints: dict[str, str]  # transport -> locator (tcp: host:port of the owner's listener)


# --- the streamed handoff -----------------------------------------------------------------------
class AcceptKv(Wire):
    """prefill -> the decode node's messenger: reserve room for this request's KV, written slice by slice."""

    request_id: Token
    attempt: int
    num_tokens: int  # the region is [L, 2, H, num_tokens, D] of the node's model layout
    holder: Holder  # the prefill process ("<instance>:<incarnation>"): the reservation dies with it
    dest_instance: Token  # the decode instance the KV is for (the landed file carries its name)
    src_node: OptionalToken = ""  # the prefill's node (metrics, logs)


class AcceptKvReply(Wire):
    ok: bool
    region: RegionRef | None = None
    error: str = ""


class CompleteKv(Wire):
    """The completion notice (a transport call, after the last slice): the KV is whole."""

    region: Token


class CompleteKvReply(Wire):
    ok: bool
    dest: KvHandle | None = None
    error: str = ""


class AbortKv(Wire):
    """prefill -> the decode node's messenger: the request will not be handed off; free its region
    (named by the request's attempt and decode instance: the accept's reply may never have come)."""

    request_id: Token
    attempt: int
    dest_instance: Token


# --- block pulls --------------------------------------------------------------------------------
class PinBlocks(Wire):
    request_id: Token
    keys: list[int]


class PinReply(Wire):
    """The leading requested blocks the peer holds, pinned until "unpin" or the connection ends."""

    region: RegionRef | None  # the peer's DRAM slab
    blocks: list[SlotRef]  # key, slot, checksum
    offsets: list[int]  # where each block starts in the region
    block_nbytes: int


class UnpinBlocks(Wire):
    corrupt: list[int] = []  # keys whose payload failed its checksum on arrival


# --- the TCP backend's frames -------------------------------------------------------------------
class WriteFrame(Wire):
    region: Token
    pieces: Pieces  # [offset, nbytes], in the order of the payload
    meta: dict[str, int] = {}  # handed to the region's owner (e.g. layer, start, tokens)
    # A write striped over several connections arrives as `parts` frames sharing `group`; the one
    # with `whole` carries the write's own pieces, which the owner is handed once every part landed.
    group: OptionalToken = ""
    parts: Annotated[int, Meta(ge=1, le=MAX_STRIPES)] = 1
    whole: Pieces = []

    def __post_init__(self) -> None:
        if self.parts != 1 and not self.group:
            raise WireError(f"a write in {self.parts} parts without a group")


class ReadFrame(Wire):
    region: Token
    pieces: Pieces


class CallFrame(Wire):
    op: Token
    nbytes: Annotated[int, Meta(ge=0, le=MAX_CALL_BYTES)]  # of the body that follows


class ReplyFrame(Wire):
    ok: bool
    error: str = ""
    nbytes: int = 0  # of what follows (a read's bytes, a call's reply)
