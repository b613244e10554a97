"""Requests the conductor has dispatched and not yet seen end. Pure: the caller passes the clock.

Load that a request puts on its instances is added at dispatch and removed on every terminal
path (done, failed, cancelled, rejected), or when its lease runs out, so that a lost
completion cannot leak load forever. The same table yields the policy's and admission's view
of every instance: queued prefill seconds, decode batches, bytes being pulled from each node.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.conductor.admission import DecodeLoad


@dataclass
class InFlight:
    request_id: str
    prefill_id: str
    decode_id: str
    reply_subject: str
    prompt_tokens: int
    dispatched_at: float
    predicted_prefill_s: float = 0.0  # work: prefill + transfer, as routed
    predicted_ttft_s: float = 0.0  # queue + work: when the prefill should end
    pull_source: str = ""  # node the prefill pulls blocks from
    pull_bytes: int = 0
    phase: str = "prefill"  # -> "decode" once prefilled
    decode_started: float = 0.0
    attempt: int = 0  # the request's current attempt (a resumed request is routed again)

    @property
    def predicted_prefill_end(self) -> float:
        return self.dispatched_at + self.predicted_ttft_s


class InFlightTable:
    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self.requests: dict[str, InFlight] = {}  # request_id -> InFlight

    def add(self, request: InFlight) -> None:
        self.requests[request.request_id] = request

    def mark_prefilled(self, request_id: str, now: float, attempt: int = 0) -> None:
        request = self.requests.get(request_id)
        if request is not None and request.attempt == attempt:
            request.phase = "decode"
            request.decode_started = now
            request.pull_bytes = 0

    def finish(self, request_id: str, up_to_attempt: int | None = None) -> InFlight | None:
        """The request ended (or, with up_to_attempt, those of its attempts were abandoned)."""
        request = self.requests.get(request_id)
        if request is None or (up_to_attempt is not None and request.attempt > up_to_attempt):
            return None
        return self.requests.pop(request_id)

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

    def prefill_queue_s(self, instance_id: str, now: float) -> float:
        """Predicted seconds of prefill work still ahead of a new request at the instance."""
        mine = [r for r in self.requests.values() if r.phase == "prefill" and r.prefill_id == instance_id]
        if not mine:
            return 0.0
        # everything queued, less what the one running (the oldest) has already done
        oldest = min(mine, key=lambda r: r.dispatched_at)
        started = max(oldest.dispatched_at, oldest.predicted_prefill_end - oldest.predicted_prefill_s)
        done = min(oldest.predicted_prefill_s, max(0.0, now - started))
        return sum(r.predicted_prefill_s for r in mine) - done

    def decode_batch(self, instance_id: str) -> tuple[int, int]:
        """(requests, context tokens) decoding at the instance now."""
        mine = [r for r in self.requests.values() if r.phase == "decode" and r.decode_id == instance_id]
        return len(mine), sum(r.prompt_tokens for r in mine)

    def decode_load(self, instance_id: str) -> DecodeLoad:
        """What admission needs: who decodes there since when, who will join and when."""
        decoding = sorted((r.decode_started, r.prompt_tokens) for r in self.requests.values()
                          if r.phase == "decode" and r.decode_id == instance_id)
        coming = sorted((r.predicted_prefill_end, r.prompt_tokens) for r in self.requests.values()
                        if r.phase == "prefill" and r.decode_id == instance_id)
        return DecodeLoad(instance_id, tuple(t for t, _ in decoding), tuple(c for _, c in decoding),
                          tuple(t for t, _ in coming), tuple(c for _, c in coming))

    def sender_queued_bytes(self) -> dict[str, int]:
        """node -> bytes being pulled from it by requests still in prefill."""
        out: dict[str, int] = {}
        for r in self.requests.values():
            if r.phase == "prefill" and r.pull_bytes:
                out[r.pull_source] = out.get(r.pull_source, 0) + r.pull_bytes
        return out
