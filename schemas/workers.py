"""Every worker -> everyone: who I am and how loaded I am (WORKER_HEARTBEAT)."""

from __future__ import annotations

from dataclasses import dataclass

from schemas.codec import Wire

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


@dataclass(frozen=True)
class StatusReply(Wire):
    workers: list[WorkerInfo]
    in_flight: int = 0
