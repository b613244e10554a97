"""Which instances are alive, from their heartbeats. Pure: the caller passes the clock."""

from __future__ import annotations

from dataclasses import dataclass

from schemas.workers import WorkerInfo


@dataclass
class Instance:
    info: WorkerInfo
    last_seen: float


class Registry:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.instances: dict[str, Instance] = {}  # instance_id -> Instance

    def update(self, info: WorkerInfo, now: float) -> bool:
        """Record a heartbeat; True when the instance is new."""
        if info.leaving:
            self.instances.pop(info.instance_id, None)
            return False
        known = self.instances.get(info.instance_id)
        if known is None:
            self.instances[info.instance_id] = Instance(info, now)
            return True
        known.info, known.last_seen = info, now
        return False

    def refresh(self, now: float) -> None:
        """Count every known instance as just heard from (after an outage of the conductor's own
        broker connection, their silence says nothing about them)."""
        for known in self.instances.values():
            known.last_seen = now

    def expire(self, now: float) -> list[WorkerInfo]:
        """Forget instances whose heartbeats stopped; returns them."""
        gone = [i.info for i in self.instances.values() if now - i.last_seen > self.timeout_s]
        for info in gone:
            del self.instances[info.instance_id]
        return gone

    def of_role(self, role: str) -> list[WorkerInfo]:
        """Instances of a role that take new work (a draining one finishes what it holds, nothing more)."""
        return sorted((i.info for i in self.instances.values() if i.info.role == role and not i.info.draining),
                      key=lambda w: w.instance_id)

    def get(self, instance_id: str) -> WorkerInfo | None:
        known = self.instances.get(instance_id)
        return known.info if known else None
