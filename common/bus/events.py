"""The audit events: the events stream, and the publisher that gets each event of one process
stored by JetStream, in order, once, whatever the broker does meanwhile.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import secrets
import time
from typing import Any

import msgspec
import orjson
from nats.aio.msg import Msg
from nats.errors import NoRespondersError, TimeoutError as NatsTimeout
from nats.js.api import StorageType, StreamConfig
from nats.js.errors import BadRequestError, ServiceUnavailableError

from common import runner
from common.audit import Chain, Sealed
from common.bus.connection import OUTAGE_S, Connection
from schemas import subjects
from schemas.events import Event

log = logging.getLogger(__name__)

EVENT_ACK_S = 2.0  # JetStream's acknowledgement of an event, before what is unacknowledged is sent again
EVENT_WINDOW = 512  # events sent and waiting for their acknowledgement, per publisher
EVENT_MAX_AGE_S = 120.0  # an event not stored by then is dropped (a gap in its chain)
EVENT_QUEUE_MAX = 100_000  # events waiting per publisher; beyond, the oldest is dropped


async def ensure_events_stream(nc: Connection, max_age_s: float = 24 * 3600, max_bytes: int = 4 << 30,
                               replicas: int = 1) -> None:
    """Create the MOONBUS_EVENTS stream if it does not exist (idempotent). Bounded by age and by
    bytes: a flood of requests cannot fill the broker's disk (the oldest events go first).
    `replicas` > 1 keeps that many copies on a NATS cluster (JetStream on every server), so the
    audit log survives the loss of a server; it cannot exceed the cluster's servers."""
    js = nc.jetstream()
    config = StreamConfig(
        name=subjects.EVENTS_STREAM,
        subjects=[subjects.EVENTS_ALL],
        storage=StorageType.FILE,
        max_age=max_age_s,
        max_bytes=max_bytes,
        num_replicas=replicas,
    )
    deadline = time.monotonic() + OUTAGE_S * 2
    while True:
        try:
            await js.add_stream(config)
            return
        except BadRequestError:
            # exists with another config (e.g. max_age): keep the operator's stream
            log.info("stream %s already exists", subjects.EVENTS_STREAM)
            return
        except (ServiceUnavailableError, NatsTimeout, NoRespondersError) as exc:
            # a NATS cluster that is still electing its JetStream leader answers 503 or nothing
            if time.monotonic() > deadline:
                raise
            log.info("JetStream not ready (%r); asking again", exc)
            await asyncio.sleep(1.0)


@dataclasses.dataclass
class _Outgoing:
    subject: str
    payload: bytes  # b"" while `sealed` waits for its signature
    msg_id: str
    queued_at: float
    sealed: Sealed | None = None
    sent_at: float = 0.0


class EventPublisher:
    """Publishes audit events for one service instance, each stored by JetStream before it counts.

    Events are sent in order as they come (subscribers see them at once, as with a plain publish),
    each with a reply subject on which JetStream acknowledges it once the events stream holds it
    (on a NATS cluster: once its replicas do); up to EVENT_WINDOW wait for their acknowledgement
    at a time. Without one within EVENT_ACK_S, or with a refusal (no stream leader yet, a broker
    outage), every event not yet acknowledged is sent again, in order and under the same message
    id, which JetStream deduplicates, one at a time until the stream stores them again (so that
    none overtakes another); until it is stored or older than EVENT_MAX_AGE_S. So a blip loses no
    event, stores none twice and keeps each publisher's order. Nothing waits for this: `request`, `instance` and `kv`
    only queue; `flush` (called by `shutdown`) waits until what is queued is stored.

    With the cluster secret, every event is numbered and sealed into this publisher's chain
    (common/audit.py) as it is queued, and signed with this process's key when it is first sent
    (off the path of whatever queued it); a new publisher (a restarted process) starts a new chain. An event that
    is dropped after all shows as a gap in its chain: that is the truth.
    """

    def __init__(self, nc: Connection, service: str, instance_id: str, secret: bytes | None = None,
                 incarnation: str = "", signer=None) -> None:
        self._nc = nc
        self._service = service
        self._instance_id = instance_id
        self.name = f"{service}/{instance_id}/{incarnation or secrets.token_hex(6)}"
        self._chain = Chain(secret, self.name, signer) if secret is not None else None
        self._queue: collections.deque[_Outgoing] = collections.deque()  # not sent yet, in order
        self._unacked: dict[str, _Outgoing] = {}  # msg id -> sent, not acknowledged (in sending order)
        self._replies: dict[str, str] = {}  # reply token -> msg id
        self._refused = False
        self._window, self._stored_in_a_row = EVENT_WINDOW, 0  # after a refusal: 1, until 16 are stored
        self._wakeup = asyncio.Event()
        self._sender: asyncio.Task | None = None
        self._count = 0
        self._sends = 0
        nc.publishers.append(self)  # flushed by common.bus.connection.shutdown

    @classmethod
    def of(cls, nc: Connection, service: str, cfg, incarnation: str = "") -> "EventPublisher":
        """A service's publisher, sealing with its config's cluster secret and signing with its own key."""
        from common import security, signing

        return cls(nc, service, cfg.instance_id, secret=security.read_secret(cfg.cluster_secret_file),
                   incarnation=incarnation, signer=signing.load(cfg.signing_key_file))

    # NOTE: positional-only, so that the data may itself carry a "kind" (e.g. a process's kind)
    async def request(self, kind: str, request_id: str, /, **data: Any) -> None:
        self._publish(subjects.request_event(kind, request_id), kind, request_id, data)

    def queue_request(self, kind: str, request_id: str, data: dict[str, Any]) -> None:
        """`request`, for a caller that does not await: the conductor's route queues its `routed`
        event from a callback that runs once the route's reply has been written."""
        self._publish(subjects.request_event(kind, request_id), kind, request_id, data)

    async def instance(self, kind: str, instance_id: str, /, **data: Any) -> None:
        self._publish(subjects.instance_event(kind, instance_id), kind, "", data)

    async def kv(self, kind: str, node: str, data: dict[str, Any]) -> None:
        self._publish(subjects.kv_event(kind, node), kind, data.get("request_id", ""), data)

    @property
    def queued(self) -> int:
        """Events not stored yet (queued or waiting for their acknowledgement)."""
        return len(self._queue) + len(self._unacked)

    def _publish(self, subject: str, kind: str, request_id: str, data: dict[str, Any]) -> None:
        event = Event(kind, time.time(), self._service, self._instance_id, request_id, data)
        payload, sealed = b"", None
        try:
            if self._chain is None:
                payload = event.to_bytes()
            else:  # sealed in queue order, which is the order they are sent and stored in
                sealed = self._chain.sealed(subject, msgspec.structs.asdict(event))
        except Exception:  # the audit log must never take a request down
            log.exception("could not encode event %s", subject)
            return
        if self.queued >= EVENT_QUEUE_MAX:
            log.error("%d events not stored yet: dropped %s", self.queued, subject)
            return
        self._count += 1
        self._queue.append(_Outgoing(subject, payload, f"{self.name}/{self._count}", time.monotonic(), sealed))
        self._wakeup.set()
        if self._sender is None or self._sender.done():
            self._sender = asyncio.get_running_loop().create_task(self._send_all(), name=f"events {self.name}")

    async def _send_all(self) -> None:
        inbox = self._nc.new_inbox()
        await self._nc.subscribe(f"{inbox}.*", cb=self._on_ack)
        backoff = 0.1
        while True:
            await runner.wait_set(self._wakeup, EVENT_ACK_S / 4)
            self._wakeup.clear()
            # NOTE: what queued these events (a route, say) goes on first: its replies are flushed
            # before this signs (an Ed25519 signature per event: most of an event's cost)
            await asyncio.sleep(0)
            now = time.monotonic()
            self._drop_old(now)
            self._drop_denied()
            oldest = next(iter(self._unacked.values()), None)
            if self._refused or (oldest is not None and now - oldest.sent_at > EVENT_ACK_S):
                # everything not acknowledged goes again, in order (stored ones are deduplicated),
                # one at a time until the stream takes them again: so none overtakes another
                self._queue.extendleft(reversed(list(self._unacked.values())))
                self._unacked.clear()
                self._replies.clear()
                self._refused = False
                self._window, self._stored_in_a_row = 1, 0
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
            elif oldest is None:
                backoff = 0.1
            while self._queue and len(self._unacked) < self._window and not self._refused and self._nc.is_connected:
                out = self._queue.popleft()
                if out.sealed is not None:  # signed once, when first sent (resent as it was)
                    out.payload, out.sealed = self._chain.signed(out.sealed), None
                self._sends += 1
                token = str(self._sends)
                self._replies[token] = out.msg_id
                self._unacked[out.msg_id] = out
                out.sent_at = time.monotonic()
                try:
                    await self._nc.publish(out.subject, out.payload, reply=f"{inbox}.{token}",
                                           headers={"Nats-Msg-Id": out.msg_id})
                except Exception as exc:  # a connection closed under us: sent again later
                    log.debug("event %s not sent (%r)", out.subject, exc)
                    self._refused = True
                    break

    async def _on_ack(self, msg: Msg) -> None:
        msg_id = self._replies.pop(msg.subject.rsplit(".", 1)[-1], None)
        if msg_id is None or msg_id not in self._unacked:
            return  # the acknowledgement of an earlier send of it, or of one already sent again
        refused = bool(msg.headers and msg.headers.get("Status"))  # 503: no stream (leader) to store it
        if not refused:
            try:
                refused = "error" in orjson.loads(msg.data)
            except orjson.JSONDecodeError:
                refused = True
        if refused:
            self._refused = True
        else:
            del self._unacked[msg_id]
            self._stored_in_a_row += 1
            if self._stored_in_a_row >= 16:  # the stream is back: a window again
                self._window = EVENT_WINDOW
        self._wakeup.set()

    def _drop_denied(self) -> None:
        """Drop the events on subjects this connection may not publish on: the broker refused them
        and will refuse them again, and waiting for them would hold back every later event."""
        denied = self._nc.denied
        if not denied:
            return
        refused = [out for out in (*self._unacked.values(), *self._queue) if out.subject in denied]
        if not refused:
            return
        for out in refused:
            log.error("event %s refused by the bus (this user may not publish it): dropped", out.subject)
        self._unacked = {i: out for i, out in self._unacked.items() if out.subject not in denied}
        self._queue = collections.deque(out for out in self._queue if out.subject not in denied)

    def _drop_old(self, now: float) -> None:
        """Drop what waited past EVENT_MAX_AGE_S: the oldest lead (the unacknowledged, then the queue)."""
        while self._unacked and now - next(iter(self._unacked.values())).queued_at > EVENT_MAX_AGE_S:
            out = self._unacked.pop(next(iter(self._unacked)))
            log.error("event %s not stored within %g s: dropped", out.subject, EVENT_MAX_AGE_S)
        while self._queue and now - self._queue[0].queued_at > EVENT_MAX_AGE_S:
            out = self._queue.popleft()
            log.error("event %s not stored within %g s: dropped", out.subject, EVENT_MAX_AGE_S)

    async def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every queued event is stored (True), or `timeout_s` passed (False)."""
        deadline = time.monotonic() + timeout_s
        while self.queued and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return not self.queued

    async def close(self) -> None:
        if self._sender is not None:
            self._sender.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._sender
