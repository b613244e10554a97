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
import re
import secrets
import time
import urllib.parse
import weakref
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import msgspec
import nats
import orjson
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NoRespondersError, TimeoutError as NatsTimeout
from nats.js.api import StorageType, StreamConfig
from nats.js.errors import BadRequestError, ServiceUnavailableError

from common import runner
from common.audit import Chain, Sealed
from schemas import subjects
from schemas.events import Event

if TYPE_CHECKING:
    from schemas.workers import WorkerInfo
    from common.config import NatsAuth

log = logging.getLogger(__name__)

PENDING_BYTES = 64 << 20  # published while the broker is away, sent once it is back
# NOTE: a server on a host that dropped off the network is not a closed socket but silence; only
# unanswered pings reveal it. Every PING_INTERVAL_S, and stale after MAX_OUTSTANDING_PINGS missed:
# a client fails over to another server of the cluster in 4-6 s, not nats-py's default 4 minutes.
PING_INTERVAL_S = 2.0
MAX_OUTSTANDING_PINGS = 2
OUTAGE_S = 15.0  # how long `request` waits out a broker outage (NATS restarts in a few seconds)
EVENT_ACK_S = 2.0  # JetStream's acknowledgement of an event, before what is unacknowledged is sent again
EVENT_WINDOW = 512  # events sent and waiting for their acknowledgement, per publisher
EVENT_MAX_AGE_S = 120.0  # an event not stored by then is dropped (a gap in its chain)
EVENT_QUEUE_MAX = 100_000  # events waiting per publisher; beyond, the oldest is dropped
# client -> monotonic time of its last reconnection (a responder may not have resubscribed yet)
_reconnected_at: "weakref.WeakKeyDictionary[Client, float]" = weakref.WeakKeyDictionary()
_on_reconnect: "weakref.WeakKeyDictionary[Client, list[Callable[[], None]]]" = weakref.WeakKeyDictionary()
_publishers: "weakref.WeakKeyDictionary[Client, list[EventPublisher]]" = weakref.WeakKeyDictionary()
# subjects the broker told a connection it may not publish on (its user's permissions)
_denied: "weakref.WeakKeyDictionary[Client, set[str]]" = weakref.WeakKeyDictionary()
_DENIED = re.compile(r'permissions violation for publish to "([^"]+)"', re.IGNORECASE)


def server_urls(url: str) -> list[str]:
    """The servers of a NATS cluster from one flag: comma-separated URLs (spaces allowed). The
    client connects to any of them and fails over to the others, so every service can be given
    every server of the cluster."""
    urls = [u.strip() for u in url.split(",") if u.strip()]
    if not urls:
        raise ValueError(f"no NATS server URL in {url!r}")
    return urls


def inbox_prefix(user: str) -> str:
    """Where a NATS user's replies come back: `_INBOX_<user>`, which only that user may read
    (the cluster's permissions, tools/moonbus/cluster/security.py); `_INBOX` for no user."""
    return f"_INBOX_{user}" if user else "_INBOX"


def url_user(url: str) -> str:
    """The user named in a NATS URL's credentials (nats://user:password@host:port), or ""."""
    return urllib.parse.urlsplit(server_urls(url)[0]).username or ""


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
    options["inbox_prefix"] = inbox_prefix(auth.user if auth is not None and auth.user else url_user(url))
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
        denied = _DENIED.search(str(exc))
        if denied and holder:
            _denied.setdefault(holder[0], set()).add(denied[1])
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


async def flush(nc: Client, timeout_s: float = 10.0) -> None:
    """Return once the server has read everything sent on `nc` before (a SUB just made, publishes).

    nats-py's own flush writes its PING straight to the socket, ahead of the commands still
    waiting in its buffer for the flusher task, so its PONG can come back before the server has
    read a SUB made just before: a request from another connection then finds no responders
    (about 1 try in 15 on this machine, tests/integration/test_bus_calls.py). The first flush
    wakes the flusher, which writes the buffer in the loop's next step, before that PONG can be
    read; the second PING therefore follows everything sent before this call."""
    await nc.flush(timeout_s)
    await nc.flush(timeout_s)


async def subscribe(nc: Client, subject: str, handler: Callable[[Msg], Awaitable[None]], queue: str = "",
                    background: bool = False):
    """Subscribe with a handler that can never take the subscription down: an exception (a
    malformed message, a bug on one message) is logged with the subject and the message dropped.

    `background`: after each message the subscription gives way to the event loop, so that what
    arrived meanwhile on other subscriptions (a route waiting for its answer) runs before the
    next of a burst (every instance's heartbeat read in one go). Without it a subscription works
    through all its queued messages before any other handler runs (nats-py hands each one its
    own task, which does not yield while its queue holds messages)."""

    async def guarded(msg: Msg) -> None:
        try:
            await handler(msg)
        except Exception:
            log.exception("dropped a message on %s (%d bytes)", msg.subject, len(msg.data))
        if background:
            await asyncio.sleep(0)

    return await nc.subscribe(subject, queue=queue, cb=guarded)


async def publish(nc: Client, subject: str, data: bytes) -> bool:
    """Publish, never raising: False (logged) if it could not be sent or buffered."""
    try:
        await nc.publish(subject, data)
        return True
    except Exception as exc:  # closed connection, full reconnect buffer, bad subject
        log.error("could not publish to %s: %r", subject, exc)
        return False


async def heartbeat(nc: Client, info: "WorkerInfo") -> bool:
    """Publish an instance's heartbeat on its own subject (the only one its credentials may use)."""
    return await publish(nc, subjects.worker_heartbeat(info.role, info.instance_id), info.to_bytes())


CALL_ID_HEADER = "Moonbus-Call-Id"  # the same on every attempt of one call: its responder answers it once
ATTEMPT_S = 2.0  # one attempt of a call that a lost reply must not stall for its whole timeout


async def request(nc: Client, subject: str, data: bytes, timeout: float, outage_s: float = OUTAGE_S,
                  absent_s: float = 0.0, attempt_s: float | None = None) -> Msg:
    """Request/reply that survives a broker blip: if the connection was down (or just came back,
    so the responder may not have resubscribed) when an attempt timed out or found no responder,
    wait for the connection and ask again, for up to `outage_s` more. With `absent_s`, a missing
    responder (a process being restarted) is asked again for that long. Raises NoRespondersError
    or nats.errors.TimeoutError otherwise, like nc.request.

    With `attempt_s`, the call carries a call id (CALL_ID_HEADER) and each attempt waits at most
    `attempt_s`; one without an answer is sent again under the same id until `timeout` has
    passed. NATS delivers at most once: a request or its reply lost while either side reconnects
    then costs one attempt, not the whole timeout. Only for responders that answer through
    `Replies`, which runs a call once however often it arrives and answers every copy alike."""
    started = time.monotonic()
    give_up = started + timeout + outage_s
    headers = {CALL_ID_HEADER: secrets.token_hex(8)} if attempt_s else None
    while True:
        reconnects = nc.stats["reconnects"]
        try:
            if not nc.is_connected:
                await _wait_connected(nc, give_up)
            wait = timeout if not attempt_s else max(0.05, min(attempt_s, started + timeout - time.monotonic()))
            return await nc.request(subject, data, timeout=wait, headers=headers)
        except NoRespondersError:
            if time.monotonic() + 0.25 < started + absent_s:
                await asyncio.sleep(0.25)
                continue
            if not _blinked(nc, reconnects) or time.monotonic() + 0.2 > give_up:
                raise
            await asyncio.sleep(0.2)
        except (NatsTimeout, nats.errors.OutboundBufferLimitError):
            if attempt_s and time.monotonic() < started + timeout:
                continue  # the next attempt, under the same call id
            if not _blinked(nc, reconnects) or time.monotonic() + 0.2 > give_up:
                raise
            await asyncio.sleep(0.2)


class Replies:
    """The answering side of calls made with `request(..., attempt_s=...)`: each call (by its call
    id) runs once; a repeat that arrives while it runs waits for it, one that arrives after gets
    the same answer, for `keep_s`. Requests without a call id simply run.

    So a handler that is not idempotent by itself (reserve KV, pin blocks, accept a handoff)
    can be asked again safely after a reply was lost in a broker's reconnect."""

    def __init__(self, keep_s: float = 120.0, max_calls: int = 10_000) -> None:
        self.keep_s = keep_s
        self.max_calls = max_calls
        self._calls: collections.OrderedDict[str, tuple[float, asyncio.Future[bytes]]] = collections.OrderedDict()
        self.repeats = 0  # calls answered from an earlier run (a metric of lost replies)

    async def answer(self, msg: Msg, run: Callable[[], Awaitable[bytes]]) -> None:
        call_id = msg.headers.get(CALL_ID_HEADER) if msg.headers else None
        if call_id is None:
            reply = await run()
        else:
            self._forget_old(time.monotonic())
            known = self._calls.get(call_id)
            if known is not None:
                self.repeats += 1
                reply = await asyncio.shield(known[1])
            else:
                future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
                self._calls[call_id] = (time.monotonic(), future)
                try:
                    reply = await run()
                except BaseException as exc:
                    future.set_exception(exc)
                    future.exception()  # retrieved: a call that failed is not an unhandled error
                    self._calls.pop(call_id, None)
                    raise
                future.set_result(reply)
        if msg.reply:
            with contextlib.suppress(Exception):  # the asker may be gone (or the broker)
                await msg.respond(reply)

    def _forget_old(self, now: float) -> None:
        while self._calls:
            call_id, (at, future) = next(iter(self._calls.items()))
            if (now - at <= self.keep_s and len(self._calls) <= self.max_calls) or not future.done():
                return
            del self._calls[call_id]


def _blinked(nc: Client, reconnects_before: int) -> bool:
    return not nc.is_connected or nc.stats["reconnects"] != reconnects_before or recently_reconnected(nc)


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

    def __init__(self, nc: Client, service: str, instance_id: str, secret: bytes | None = None,
                 incarnation: str = "", signer=None) -> None:
        self._nc = nc
        self._service = service
        self._instance_id = instance_id
        self._name = f"{service}/{instance_id}/{incarnation or secrets.token_hex(6)}"
        self._chain = Chain(secret, self._name, signer) if secret is not None else None
        self._queue: collections.deque[_Outgoing] = collections.deque()  # not sent yet, in order
        self._unacked: dict[str, _Outgoing] = {}  # msg id -> sent, not acknowledged (in sending order)
        self._replies: dict[str, str] = {}  # reply token -> msg id
        self._refused = False
        self._window, self._stored_in_a_row = EVENT_WINDOW, 0  # after a refusal: 1, until 16 are stored
        self._wakeup = asyncio.Event()
        self._sender: asyncio.Task | None = None
        self._count = 0
        self._sends = 0
        _publishers.setdefault(nc, []).append(self)

    @classmethod
    def of(cls, nc: Client, service: str, cfg, incarnation: str = "") -> "EventPublisher":
        """A service's publisher, sealing with its config's cluster secret and signing with its own key."""
        from common import security, signing

        return cls(nc, service, cfg.instance_id, secret=security.read_secret(cfg.cluster_secret_file),
                   incarnation=incarnation, signer=signing.load(cfg.signing_key_file))

    # NOTE: positional-only, so that the data may itself carry a "kind" (e.g. a process's kind)
    async def request(self, kind: str, request_id: str, /, **data: Any) -> None:
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
        self._queue.append(_Outgoing(subject, payload, f"{self._name}/{self._count}", time.monotonic(), sealed))
        self._wakeup.set()
        if self._sender is None or self._sender.done():
            self._sender = asyncio.get_running_loop().create_task(self._send_all(), name=f"events {self._name}")

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
        denied = _denied.get(self._nc)
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
