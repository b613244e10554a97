"""What prefill and decode instances share: their identity, cancellations, replies, drain timing.

A worker process has an `incarnation` (random per start) so that a restarted instance with the
same id is told apart from its dead predecessor: its pins in the node's pool are keyed by it.
Replies and errors go to the request's gateway tagged with the request's attempt; an error is
`retryable` when the cluster failed (an instance, a transfer, the pool) rather than the request,
so the gateway may resume the request elsewhere (schemas.route.RouteRequest).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import uuid

from nats.aio.msg import Msg

from common import bus
from schemas import subjects
from schemas.tokens import Cancel, TokenChunk

log = logging.getLogger(__name__)


async def obey_refusal(nc, instance_id: str, tasks) -> None:
    """A conductor refuses an instance that disagrees with the cluster (model, block size, chunk,
    KV layout): say why, clearly, and exit as failed (a supervisor's crash-loop limit then keeps it
    down with that message in its log)."""
    from schemas.workers import Refused

    async def refused(refusal: Refused, msg: Msg) -> None:
        tasks.fail(f"the cluster refused instance {instance_id}: {refusal.reason}")

    await bus.receive(nc, subjects.control_refused(instance_id), Refused, refused)


def new_incarnation() -> str:
    return uuid.uuid4().hex[:12]


class Cancellations:
    """request_id -> highest cancelled attempt (the gateway cancels an attempt it abandoned, or all
    of them when the client went away). Bounded: ids of long-gone requests are forgotten."""

    def __init__(self, limit: int = 10_000) -> None:
        self.limit = limit
        self._attempts: collections.OrderedDict[str, int] = collections.OrderedDict()

    async def on_cancel(self, cancel: Cancel, msg: Msg) -> None:
        self.add(cancel.request_id, cancel.attempt)

    def add(self, request_id: str, attempt: int) -> None:
        self._attempts[request_id] = max(attempt, self._attempts.get(request_id, -1))
        self._attempts.move_to_end(request_id)
        while len(self._attempts) > self.limit:
            self._attempts.popitem(last=False)

    def covers(self, request_id: str, attempt: int) -> bool:
        return attempt <= self._attempts.get(request_id, -1)


async def reply(nc, subject: str, chunk: TokenChunk, sender_kind: str = "worker") -> None:
    """Send a chunk to the request's gateway, on its sender's own subject below the request's
    `subject` (the chunk's source; a gateway takes tokens only from the instances it was routed to)
    (never raises: a lost publish is logged)."""
    await bus.publish(nc, subjects.tokens_from(subject, sender_kind, chunk.source), chunk.to_bytes())


def error_chunk(request_id: str, attempt: int, index: int, error: str, status: int, source: str,
                retryable: bool, **extra) -> TokenChunk:
    return TokenChunk(request_id, index, [], error=error, error_status=status, source=source, attempt=attempt,
                      retryable=retryable, **extra)


ALIVE_INTERVAL_S = 0.5


class AliveBeacon:
    """A worker's liveness, told by a thread of its own over a NATS connection of its own.

    The event loop of a prefill or decode instance shares the process with its compute; under load
    its heartbeats (which carry the load report) can come late, and a conductor that took late for
    dead would fail and recompute a busy instance's requests. This thread only says "alive" every
    ALIVE_INTERVAL_S: it stops when the process dies or is frozen, not when it is busy. Best effort:
    without a connection it says nothing and the heartbeats alone tell liveness.
    """

    def __init__(self, nats_url: str, auth, instance_id: str, incarnation: str,
                 interval_s: float = ALIVE_INTERVAL_S) -> None:
        from schemas.workers import Alive

        self.nats_url, self.auth, self.interval_s = nats_url, auth, interval_s
        self.subject = subjects.control_alive(instance_id)
        self.payload = Alive(instance_id, incarnation).to_bytes()
        self._loop = asyncio.new_event_loop()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"alive-{instance_id}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._beat())
        except Exception:  # noqa: BLE001 - liveness is best effort; heartbeats still tell it
            log.exception("the liveness beacon stopped")
        finally:
            self._loop.close()

    async def _beat(self) -> None:
        nc = await bus.connect(self.nats_url, f"{self.subject}-beacon", self.auth)
        try:
            while not self._stop.is_set():
                await bus.publish(nc, self.subject, self.payload)
                await asyncio.sleep(self.interval_s)
        finally:
            await nc.close()


class Stamps:
    """When each (request, attempt) arrived here (monotonic), until it is taken; bounded, since a
    task that is cancelled or fails before it is taken is never taken."""

    def __init__(self, limit: int = 10_000) -> None:
        self.limit = limit
        self._at: collections.OrderedDict[tuple[str, int], float] = collections.OrderedDict()

    def put(self, request_id: str, attempt: int, now: float) -> None:
        self._at[(request_id, attempt)] = now
        while len(self._at) > self.limit:
            self._at.popitem(last=False)

    def waited(self, request_id: str, attempt: int, now: float) -> float:
        """Seconds since it arrived (0 if unknown), and forget it."""
        return now - self._at.pop((request_id, attempt), now)
