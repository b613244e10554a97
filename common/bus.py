"""NATS helpers shared by every service: connect, guarded subscribe/publish/request, the event
publisher, the events stream.

A broker blip must fail nothing: the client reconnects forever and buffers what is published
meanwhile (`PENDING_BYTES`); `request` waits out an outage and asks again; `publish` and the
handlers behind `subscribe` never raise into a service's loop. Only a bad message is lost, and
it is logged.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import secrets
import time
import weakref
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NoRespondersError, TimeoutError as NatsTimeout
from nats.js.api import StorageType, StreamConfig
from nats.js.errors import BadRequestError, ServiceUnavailableError

from common.audit import Chain
from schemas import subjects
from schemas.events import Event

if TYPE_CHECKING:
    from common.config import NatsAuth

log = logging.getLogger(__name__)

PENDING_BYTES = 64 << 20  # published while the broker is away, sent once it is back
# NOTE: a server on a host that dropped off the network is not a closed socket but silence; only
# unanswered pings reveal it. Every PING_INTERVAL_S, and stale after MAX_OUTSTANDING_PINGS missed:
# a client fails over to another server of the cluster in 4-6 s, not nats-py's default 4 minutes.
PING_INTERVAL_S = 2.0
MAX_OUTSTANDING_PINGS = 2
OUTAGE_S = 15.0  # how long `request` waits out a broker outage (NATS restarts in a few seconds)
EVENT_ACK_S = 2.0  # JetStream's acknowledgement of one event, before it is sent again
EVENT_MAX_AGE_S = 120.0  # an event not stored by then is dropped (a gap in its chain)
EVENT_QUEUE_MAX = 100_000  # events waiting per publisher; beyond, the oldest is dropped
# client -> monotonic time of its last reconnection (a responder may not have resubscribed yet)
_reconnected_at: "weakref.WeakKeyDictionary[Client, float]" = weakref.WeakKeyDictionary()
_on_reconnect: "weakref.WeakKeyDictionary[Client, list[Callable[[], None]]]" = weakref.WeakKeyDictionary()
_publishers: "weakref.WeakKeyDictionary[Client, list[EventPublisher]]" = weakref.WeakKeyDictionary()


def server_urls(url: str) -> list[str]:
    """The servers of a NATS cluster from one flag: comma-separated URLs (spaces allowed). The
    client connects to any of them and fails over to the others, so every service can be given
    every server of the cluster."""
    urls = [u.strip() for u in url.split(",") if u.strip()]
    if not urls:
        raise ValueError(f"no NATS server URL in {url!r}")
    return urls


async def connect(url: str, name: str, auth: "NatsAuth | None" = None, first_connect_timeout_s: float = 60.0) -> Client:
    """Connect, retrying for a while: services may start before the server is up.

    `url` may name several servers of one NATS cluster, comma-separated (`server_urls`).
    Once connected, the client reconnects forever (a broker restart must not kill workers).
    `auth`: the role's user and password, and the CA of a tls:// server.
    """
    servers = server_urls(url)
    options: dict[str, Any] = {}
    if auth is not None and auth.user:
        options.update(user=auth.user, password=auth.password())
    if auth is not None and auth.ca_file:
        import ssl

        options["tls"] = ssl.create_default_context(cafile=auth.ca_file)
    deadline = time.monotonic() + first_connect_timeout_s
    holder: list[Client] = []

    async def disconnected() -> None:
        if holder and (holder[0].is_closed or holder[0].is_draining):
            return  # our own shutdown
        log.warning("NATS connection lost; reconnecting (publishes are buffered)")

    async def reconnected() -> None:
        log.info("NATS connection back")
        if holder:
            _reconnected_at[holder[0]] = time.monotonic()
            for callback in _on_reconnect.get(holder[0], []):
                callback()

    async def error(exc: Exception) -> None:
        log.warning("NATS: %r", exc)

    while True:
        try:
            nc = await nats.connect(
                servers, name=name, connect_timeout=2, max_reconnect_attempts=-1,
                reconnect_time_wait=0.5, allow_reconnect=True, pending_size=PENDING_BYTES,
                ping_interval=PING_INTERVAL_S, max_outstanding_pings=MAX_OUTSTANDING_PINGS,
                disconnected_cb=disconnected, reconnected_cb=reconnected, error_cb=error,
                drain_timeout=5,  # shutdown must not hang on a broker that is already gone
                **options,
            )
            holder.append(nc)
            return nc
        except Exception as exc:  # NoServersError, OSError, timeouts
            if time.monotonic() > deadline:
                raise ConnectionError(f"cannot reach NATS at {url}: {exc!r}") from exc
            await asyncio.sleep(0.5)


BROKER_GIVE_UP_S = 300.0  # disconnected this long, the broker is gone for good: the process exits


class BrokerGone(ConnectionError):
    """Raised by `watchdog` when the connection has been down for BROKER_GIVE_UP_S."""


async def watchdog(nc: Client, give_up_s: float = BROKER_GIVE_UP_S) -> None:
    """An essential task (common.runner.TaskGroup): raises once the broker has been unreachable for
    `give_up_s`, which stops the process with a failure, for its supervisor to deal with. Shorter
    outages are ridden out (reconnects are endless)."""
    down_since = None
    while True:
        await asyncio.sleep(1.0)
        if nc.is_connected:
            down_since = None
        elif down_since is None:
            down_since = time.monotonic()
        elif time.monotonic() - down_since > give_up_s:
            raise BrokerGone(f"no broker for {give_up_s:.0f} s; giving up")


def on_reconnect(nc: Client, callback: Callable[[], None]) -> None:
    """Call `callback` (synchronously, on the event loop) each time the connection comes back."""
    _on_reconnect.setdefault(nc, []).append(callback)


def recently_reconnected(nc: Client, within_s: float = OUTAGE_S) -> bool:
    at = _reconnected_at.get(nc)
    return at is not None and time.monotonic() - at < within_s


async def subscribe(nc: Client, subject: str, handler: Callable[[Msg], Awaitable[None]], queue: str = ""):
    """Subscribe with a handler that can never take the subscription down: an exception (a
    malformed message, a bug on one message) is logged with the subject and the message dropped."""

    async def guarded(msg: Msg) -> None:
        try:
            await handler(msg)
        except Exception:
            log.exception("dropped a message on %s (%d bytes)", msg.subject, len(msg.data))

    return await nc.subscribe(subject, queue=queue, cb=guarded)


async def publish(nc: Client, subject: str, data: bytes) -> bool:
    """Publish, never raising: False (logged) if it could not be sent or buffered."""
    try:
        await nc.publish(subject, data)
        return True
    except Exception as exc:  # closed connection, full reconnect buffer, bad subject
        log.error("could not publish to %s: %r", subject, exc)
        return False


async def request(nc: Client, subject: str, data: bytes, timeout: float, outage_s: float = OUTAGE_S) -> Msg:
    """Request/reply that survives a broker blip: if the connection was down (or just came back,
    so the responder may not have resubscribed) when an attempt timed out or found no responder,
    wait for the connection and ask again, for up to `outage_s` more. Raises NoRespondersError or
    nats.errors.TimeoutError otherwise, like nc.request."""
    give_up = time.monotonic() + timeout + outage_s
    while True:
        reconnects = nc.stats["reconnects"]
        try:
            if not nc.is_connected:
                await _wait_connected(nc, give_up)
            return await nc.request(subject, data, timeout=timeout)
        except (NoRespondersError, NatsTimeout, nats.errors.OutboundBufferLimitError):
            blinked = not nc.is_connected or nc.stats["reconnects"] != reconnects or recently_reconnected(nc)
            if not blinked or time.monotonic() + 0.2 > give_up:
                raise
            await asyncio.sleep(0.2)


async def _wait_connected(nc: Client, give_up: float) -> None:
    while not nc.is_connected:
        if nc.is_closed or time.monotonic() > give_up:
            raise NatsTimeout
        await asyncio.sleep(0.05)


async def ensure_events_stream(nc: Client, max_age_s: float = 24 * 3600, max_bytes: int = 4 << 30,
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


class EventPublisher:
    """Publishes audit events for one service instance, each stored by JetStream before it counts.

    An event is queued in order and sent by one task per publisher through JetStream, which
    acknowledges it once the events stream holds it (on a NATS cluster: once its replicas do).
    Without an acknowledgement (a broker outage, a stream leader being elected, a lost reply) it
    is sent again with the same message id, which JetStream deduplicates, until it is stored or
    older than EVENT_MAX_AGE_S; so a blip loses no event and never stores one twice. Nothing
    waits for this: `request`, `instance` and `kv` only queue. `flush` (called by `shutdown`)
    sends what is queued before the connection closes.

    With the cluster secret, every event is numbered and sealed into this publisher's chain
    (common/audit.py); a new publisher (a restarted process) starts a new chain. An event that
    is dropped after all shows as a gap in its chain: that is the truth.
    """

    def __init__(self, nc: Client, service: str, instance_id: str, secret: bytes | None = None,
                 incarnation: str = "") -> None:
        self._nc = nc
        self._service = service
        self._instance_id = instance_id
        self._name = f"{service}/{instance_id}/{incarnation or secrets.token_hex(6)}"
        self._chain = Chain(secret, self._name) if secret is not None else None
        self._queue: collections.deque[tuple[str, bytes, str, float]] = collections.deque()
        self._wakeup = asyncio.Event()
        self._sender: asyncio.Task | None = None
        self._count = 0
        _publishers.setdefault(nc, []).append(self)

    # NOTE: positional-only, so that the data may itself carry a "kind" (e.g. a process's kind)
    async def request(self, kind: str, request_id: str, /, **data: Any) -> None:
        self._publish(subjects.request_event(kind, request_id), kind, request_id, data)

    async def instance(self, kind: str, instance_id: str, /, **data: Any) -> None:
        self._publish(subjects.instance_event(kind, instance_id), kind, "", data)

    async def kv(self, kind: str, node: str, data: dict[str, Any]) -> None:
        self._publish(subjects.kv_event(kind, node), kind, data.get("request_id", ""), data)

    @property
    def queued(self) -> int:
        return len(self._queue)

    def _publish(self, subject: str, kind: str, request_id: str, data: dict[str, Any]) -> None:
        event = Event(kind, time.time(), self._service, self._instance_id, request_id, data)
        try:
            if self._chain is None:
                payload = event.to_bytes()
            else:  # sealed in queue order, which is the order they are sent and stored in
                fields = {f.name: getattr(event, f.name) for f in dataclasses.fields(event)}
                payload = self._chain.seal(subject, fields)
        except Exception:  # the audit log must never take a request down
            log.exception("could not encode event %s", subject)
            return
        if len(self._queue) >= EVENT_QUEUE_MAX:
            dropped = self._queue.popleft()
            log.error("event queue full (%d): dropped the oldest, %s", EVENT_QUEUE_MAX, dropped[0])
        self._count += 1
        self._queue.append((subject, payload, f"{self._name}/{self._count}", time.monotonic()))
        self._wakeup.set()
        if self._sender is None or self._sender.done():
            self._sender = asyncio.get_running_loop().create_task(self._send_all(), name=f"events {self._name}")

    async def _send_all(self) -> None:
        js = self._nc.jetstream()
        backoff = 0.1
        while True:
            if not self._queue:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            subject, payload, msg_id, queued_at = self._queue[0]
            if time.monotonic() - queued_at > EVENT_MAX_AGE_S:
                self._queue.popleft()
                log.error("event %s not stored within %g s: dropped", subject, EVENT_MAX_AGE_S)
                continue
            try:
                await js.publish(subject, payload, timeout=EVENT_ACK_S, headers={"Nats-Msg-Id": msg_id})
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # no stream leader yet, a broker outage, a lost ack: again
                log.debug("event %s not acknowledged (%r); sending it again", subject, exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            backoff = 0.1
            if self._queue and self._queue[0][2] == msg_id:
                self._queue.popleft()

    async def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every queued event is stored (True), or `timeout_s` passed (False)."""
        deadline = time.monotonic() + timeout_s
        while self._queue and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return not self._queue

    async def close(self) -> None:
        if self._sender is not None:
            self._sender.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._sender


async def shutdown(nc: Client, flush_s: float = 5.0) -> None:
    """Store the events still queued (at most `flush_s`), then drain (deliver what is in flight,
    then close); if the broker is already gone, just close."""
    for publisher in _publishers.pop(nc, []):
        if not await publisher.flush(flush_s):
            log.warning("%d events of %s not stored before shutdown", publisher.queued, publisher._name)
        await publisher.close()
    try:
        await nc.drain()
    except Exception as exc:  # DrainTimeoutError, ConnectionClosedError, ...
        log.info("could not drain the NATS connection (%r); closing it", exc)
        await nc.close()
