"""Every worker -> everyone: who I am and how loaded I am (subjects.worker_heartbeat)."""

from __future__ import annotations

from typing import Literal, get_args

from schemas import subjects
from schemas.codec import OptionalToken, Token, Wire

Role = Literal["gateway", "conductor", "cache_index", "prefill", "decode", "messenger"]
ROLES = get_args(Role)


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


class Coming(Wire):
    """A request held by a prefill instance that will join a decode instance when its prefill ends."""

    request_id: str
    decode_id: str
    finish_in_s: float  # predicted seconds from the report until its prefill ends
    tokens: int  # its context when it joins
    max_tokens: int = 0  # what it may generate (0: unknown)
    expected_tokens: int = 0  # the client's hint of its output length (0: none)


class Measured(Wire):
    """An instance's latest measured piece of work, for the conductors' predictors to learn from
    (common/decide/learn.py): a prefill's seconds for its tokens and reused prefix, or a decode
    step's seconds for its batch and context."""

    seq: int  # counts this instance's measurements: a report repeating one is not a new one
    seconds: float
    tokens: int  # prefill: the prompt's tokens; decode: the batch's context tokens
    prefix_tokens: int = 0  # prefill: tokens reused, not computed
    batch: int = 0  # decode: requests in the step


class PrefillReport(Wire):
    """What a prefill instance holds, in every heartbeat and at each change of state."""

    queue_s: float  # predicted seconds of work ahead of a request that arrives now
    queued_tokens: int
    running_tokens: int
    held: list[str] = []  # every request queued or running here
    coming: list[Coming] = []  # those of them that will join a decode instance
    measured: Measured | None = None  # its latest prefill


class Joined(Wire):
    request_id: str
    ago_s: float  # seconds since it joined the batch (or arrived, while waiting for room)
    tokens: int  # its context
    generated: int = 0  # tokens generated so far (the first one, from prefill, included)
    max_tokens: int = 0  # what it may generate in all (0: unknown)
    expected_tokens: int = 0  # the client's hint of its output length (0: none)


class DecodeReport(Wire):
    """What a decode instance holds, in every heartbeat and at each change of state."""

    running: int  # batch members
    context_tokens: int  # their context (KV tokens read per step)
    kv_used_tokens: int  # reserved by the requests held (their KV now and what they may still generate)
    kv_free_tokens: int | None  # None: not limited
    predicted_tbt_s: float  # its step time now, by the profile
    joined: list[Joined] = []  # every request held: the `running` members, then waiting
    measured: Measured | None = None  # its latest step
    kv_cache_bytes: int = 0  # its KV pool (`--kv-cache-bytes`): room for kv_used_tokens + kv_free_tokens


class WorkerInfo(Wire):
    instance_id: Token
    role: Role
    node: OptionalToken
    model: str = ""
    transfer_addr: str = ""  # messenger (and a pipelining prefill): tcp host:port of its point-to-point transports
    num_queued: int = 0
    num_running: int = 0
    leaving: bool = False  # sent once on clean shutdown
    draining: bool = False  # finishing what it holds after SIGTERM: route nothing new to it
    incarnation: OptionalToken = ""  # random per process start: a restarted instance with the same id differs
    layout: Layout | None = None  # prefill and decode: what the cluster must agree on
    prefill: PrefillReport | None = None  # a prefill instance's load
    decode: DecodeReport | None = None  # a decode instance's load
    sent_at: float = 0.0  # the sender's wall clock
    transport: str = ""  # messenger, prefill: the point-to-point backends it runs ("tcp", "rdma,tcp")
    endpoints: dict[str, str] = {}  # messenger: backend -> locator of its transports

    @property
    def holder(self) -> str:
        """How this process pins KV blocks in its node's pool (schemas.pool)."""
        return f"{self.instance_id}:{self.incarnation}"


def own_heartbeat(subject: str, data: bytes) -> WorkerInfo | None:
    """A heartbeat's WorkerInfo, or None when it speaks for an instance its subject does not name
    (on a closed bus only an instance's own credentials may publish on its subject: a spoof).
    Malformed data raises, as every decode does."""
    info = WorkerInfo.from_bytes(data)
    return info if subjects.speaks_for(subject, info.role, info.instance_id) else None


class StatusReply(Wire):
    """The conductor's view: live instances and the load it holds for requests in flight."""

    workers: list[WorkerInfo]
    in_flight: int = 0  # requests dispatched and not yet ended
    prefill_queue_s: dict[str, float] = {}  # prefill instance -> predicted queued seconds
    decode_running: dict[str, int] = {}  # decode instance -> requests charged to it


ProgressKind = Literal["accepted", "prefilled", "finished", "failed", "unstarted"]
PROGRESS_KINDS = get_args(ProgressKind)


class Progress(Wire):
    """prefill/decode -> conductors (subjects.control_progress): a request changed state here,
    with the instance's report as it is after the change. Control, not audit: conductors steer
    by it."""

    # accepted | prefilled (handed to decode) | finished | failed (it left this instance) | unstarted
    # (rejected at its prefill's start: it could no longer meet its TTFT SLO)
    kind: ProgressKind
    request_id: Token
    attempt: int
    info: WorkerInfo
    generated: int = 0  # finished at decode: the completion's tokens in all (how long requests run: learned)


class Alive(Wire):
    """A worker's liveness beacon (subjects.control_alive), sent by a thread of its own with a NATS
    connection of its own every ~0.5 s, whatever its event loop and its compute are doing."""

    instance_id: Token
    incarnation: OptionalToken = ""


class Exited(Wire):
    """A supervisor saw this instance's process exit (subjects.control_exited): it is dead now, not
    after its heartbeats are missed."""

    instance_id: Token
    exit_code: int = 0


class Refused(Wire):
    """conductor -> an instance (subjects.control_refused): it disagrees with the cluster."""

    instance_id: str
    reason: str
