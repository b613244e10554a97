"""Requests the conductor has dispatched and not yet seen end. Pure: the caller passes the clock.

Load that a request puts on its instances is added at dispatch and removed on every terminal
path (done, failed, cancelled, rejected), or when its lease runs out, so that a lost
completion cannot leak load forever.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class InFlight:
    request_id: str
    prefill_id: str
    decode_id: str
    reply_subject: str
    prompt_tokens: int
    dispatched_at: float
    predicted_prefill_s: float = 0.0
    phase: str = "prefill"  # -> "decode" once prefilled


class InFlightTable:
    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self.requests: dict[str, InFlight] = {}  # request_id -> InFlight

    def add(self, request: InFlight) -> None:
        self.requests[request.request_id] = request

    def mark_prefilled(self, request_id: str) -> None:
        request = self.requests.get(request_id)
        if request is not None:
            request.phase = "decode"

    def finish(self, request_id: str) -> InFlight | None:
        return self.requests.pop(request_id, None)

    def lost_with(self, instance_id: str) -> list[InFlight]:
        """Requests that cannot finish because `instance_id` is gone; they are removed."""
        lost = [
            r for r in self.requests.values()
            if (r.phase == "prefill" and r.prefill_id == instance_id) or r.decode_id == instance_id
        ]
        for request in lost:
            del self.requests[request.request_id]
        return lost

    def expire(self, now: float) -> list[InFlight]:
        old = [r for r in self.requests.values() if now - r.dispatched_at > self.lease_s]
        for request in old:
            del self.requests[request.request_id]
        return old

    def prefill_load(self, instance_id: str) -> tuple[int, float]:
        """(requests, predicted seconds) queued or running in prefill on the instance."""
        mine = [r for r in self.requests.values() if r.phase == "prefill" and r.prefill_id == instance_id]
        return len(mine), sum(r.predicted_prefill_s for r in mine)

    def decode_load(self, instance_id: str) -> int:
        return sum(1 for r in self.requests.values() if r.decode_id == instance_id)
