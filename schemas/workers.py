"""Every worker -> everyone: who I am and how loaded I am (WORKER_HEARTBEAT)."""

from __future__ import annotations

from dataclasses import dataclass, field

from schemas.codec import Wire, WireError, check_token

ROLES = ("gateway", "conductor", "cache_index", "prefill", "decode", "messenger")


@dataclass(frozen=True)
class Layout(Wire):
    """What every instance of a cluster must agree on; checked when an instance joins."""

    model: str
    block_tokens: int
    prefill_chunk: int  # prefill instances' chunk size (a pipeline stage computes whole chunks); 0 = n/a
    kv: str  # the KV layout, e.g. "30x2x3x64 float32" ([layers, K/V, kv heads, head dim], dtype)

    def differences(self, other: "Layout") -> list[str]:
        """Human-readable mismatches with another instance's layout ("" fields are not compared)."""
        out = []
        for name in ("model", "block_tokens", "prefill_chunk", "kv"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine and theirs and mine != theirs:
                out.append(f"{name} {theirs!r} (the cluster's is {mine!r})")
        return out


@dataclass(frozen=True)
class Coming(Wire):
    """A request held by a prefill instance that will join a decode instance when its prefill ends."""

    request_id: str
    decode_id: str
    finish_in_s: float  # predicted seconds from the report until its prefill ends
    tokens: int  # its context when it joins


@dataclass(frozen=True)
class PrefillReport(Wire):
    """What a prefill instance holds, in every heartbeat and at each change of state."""

    queue_s: float  # predicted seconds of work ahead of a request that arrives now
    queued_tokens: int
    running_tokens: int
    held: list[str] = field(default_factory=list)  # every request queued or running here
    coming: list[Coming] = field(default_factory=list)  # those of them that will join a decode instance


@dataclass(frozen=True)
class Joined(Wire):
    request_id: str
    ago_s: float  # seconds since it joined the batch (or arrived, while waiting for room)
    tokens: int  # its context


@dataclass(frozen=True)
class DecodeReport(Wire):
    """What a decode instance holds, in every heartbeat and at each change of state."""

    running: int  # batch members
    context_tokens: int  # their context (KV tokens read per step)
    kv_used_tokens: int  # reserved by the requests held (their KV now and what they may still generate)
    kv_free_tokens: int | None  # None: not limited
    predicted_tbt_s: float  # its step time now, by the profile
    joined: list[Joined] = field(default_factory=list)  # every request held: the `running` members, then waiting


@dataclass(frozen=True)
class WorkerInfo(Wire):
    instance_id: str
    role: str
    node: str
    model: str = ""
    transfer_addr: str = ""  # messenger (and a pipelining prefill): tcp host:port of its point-to-point transports
    num_queued: int = 0
    num_running: int = 0
    leaving: bool = False  # sent once on clean shutdown
    draining: bool = False  # finishing what it holds after SIGTERM: route nothing new to it
    incarnation: str = ""  # random per process start: a restarted instance with the same id differs
    layout: Layout | None = None  # prefill and decode: what the cluster must agree on
    prefill: PrefillReport | None = None  # a prefill instance's load
    decode: DecodeReport | None = None  # a decode instance's load
    sent_at: float = 0.0  # the sender's wall clock
    transport: str = ""  # messenger, prefill: the point-to-point backends it runs ("tcp", "rdma,tcp")
    endpoints: dict[str, str] = field(default_factory=dict)  # messenger: backend -> locator of its transports

    def __post_init__(self) -> None:
        check_token("instance_id", self.instance_id)
        if self.node:
            check_token("node", self.node)
        if self.incarnation:
            check_token("incarnation", self.incarnation)
        if self.role not in ROLES:
            raise WireError(f"role {self.role!r} is not one of {ROLES}")

    @property
    def holder(self) -> str:
        """How this process pins KV blocks in its node's pool (schemas.pool)."""
        return f"{self.instance_id}:{self.incarnation}"


@dataclass(frozen=True)
class StatusReply(Wire):
    """The conductor's view: live instances and the load it holds for requests in flight."""

    workers: list[WorkerInfo]
    in_flight: int = 0  # requests dispatched and not yet ended
    prefill_queue_s: dict[str, float] = field(default_factory=dict)  # prefill instance -> predicted queued seconds
    decode_running: dict[str, int] = field(default_factory=dict)  # decode instance -> requests charged to it


PROGRESS_KINDS = ("accepted", "prefilled", "finished", "failed")


@dataclass(frozen=True)
class Progress(Wire):
    """prefill/decode -> conductors (subjects.control_progress): a request changed state here,
    with the instance's report as it is after the change. Control, not audit: conductors steer
    by it."""

    kind: str  # accepted | prefilled (handed to decode) | finished | failed (it left this instance)
    request_id: str
    attempt: int
    info: WorkerInfo

    def __post_init__(self) -> None:
        check_token("request_id", self.request_id)
        if self.kind not in PROGRESS_KINDS:
            raise WireError(f"progress kind {self.kind!r} is not one of {PROGRESS_KINDS}")


@dataclass(frozen=True)
class Refused(Wire):
    """conductor -> an instance (subjects.control_refused): it disagrees with the cluster."""

    instance_id: str
    reason: str
