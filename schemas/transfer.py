"""prefill -> messenger -> messenger: moving a request's KV between nodes.

Control goes over NATS (SendKv / SendKvReply on messenger_control(node, "send")); the bytes go
over the point-to-point TCP link between messengers, framed as
`[4-byte big-endian header length][TransferHeader JSON][payload bytes]`, answered by one
`[4-byte length][TransferAck JSON]`.
"""

from __future__ import annotations

from dataclasses import dataclass

from schemas.codec import Wire, check_file_name, check_token


@dataclass(frozen=True)
class KvHandle(Wire):
    """A request's KV, as a file in a node's shared-memory directory.

    Layout: C-order array shaped [num_layers, 2 (K, V), num_kv_heads, num_tokens, head_dim].
    """

    node: str
    name: str
    shape: list[int]
    dtype: str
    checksum: int

    def __post_init__(self) -> None:
        check_token("node", self.node)
        check_file_name("name", self.name)
        if len(self.shape) != 5 or any(d < 0 for d in self.shape) or self.dtype != "float32":
            raise ValueError(f"KV {self.name}: shape {self.shape} / dtype {self.dtype} is not a float32 [L, 2, H, S, D]")

    @property
    def num_tokens(self) -> int:
        return self.shape[3]


@dataclass(frozen=True)
class SendKv(Wire):
    request_id: str
    src: KvHandle
    dest_node: str
    dest_instance: str = ""  # the decode instance the KV is for: its name goes into the landed file's

    def __post_init__(self) -> None:
        check_token("request_id", self.request_id)
        check_token("dest_node", self.dest_node)
        if self.dest_instance:
            check_token("dest_instance", self.dest_instance)


@dataclass(frozen=True)
class SendKvReply(Wire):
    ok: bool
    dest: KvHandle | None = None
    error: str = ""
    nbytes: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class TransferHeader(Wire):
    request_id: str
    handle: KvHandle  # as it was on the sending node
    nbytes: int
    dest_instance: str = ""  # see SendKv

    def __post_init__(self) -> None:
        check_token("request_id", self.request_id)
        if self.dest_instance:
            check_token("dest_instance", self.dest_instance)


@dataclass(frozen=True)
class KvSlice(Wire):
    """Between pipeline stages: one layer's K and V for tokens [start, start + num_tokens).

    Followed by the float32 payload [2, num_kv_heads, num_tokens, head_dim] (C order).
    """

    request_id: str
    layer: int
    start: int
    num_tokens: int
    total_tokens: int  # the prompt's length: the receiver sizes its assembly from it

    def __post_init__(self) -> None:
        check_token("request_id", self.request_id)


@dataclass(frozen=True)
class TransferAck(Wire):
    ok: bool
    dest: KvHandle | None = None
    error: str = ""
