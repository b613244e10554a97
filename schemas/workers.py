"""Every worker -> everyone: who I am and how loaded I am (WORKER_HEARTBEAT)."""

from __future__ import annotations

from dataclasses import dataclass, field

from schemas.codec import Wire, WireError, check_token

ROLES = ("gateway", "conductor", "cache_index", "prefill", "decode", "messenger")


@dataclass(frozen=True)
class WorkerInfo(Wire):
    instance_id: str
    role: str
    node: str
    model: str = ""
    transfer_addr: str = ""  # messenger only: host:port of its point-to-point link
    num_queued: int = 0
    num_running: int = 0
    leaving: bool = False  # sent once on clean shutdown
    draining: bool = False  # finishing what it holds after SIGTERM: route nothing new to it
    incarnation: str = ""  # random per process start: a restarted instance with the same id differs

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
