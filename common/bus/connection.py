"""The connection to the broker: connect (to any server of a NATS cluster, retrying while the
broker starts), reconnect forever, give up only after a long outage (`watchdog`), and shut down
without losing what is queued.

A `Connection` is the nats-py client plus what the bus remembers of it: when it last came back,
who wants to hear of that, the subjects the broker refused it, and the event publishers to flush
before it closes. Everything else in common/bus takes one.
"""

from __future__ import annotations

import asyncio
import logging
import re
import ssl
import time
import urllib.parse
from typing import TYPE_CHECKING, Any, Callable, Protocol

from nats.aio.client import Client

if TYPE_CHECKING:
    from common.config import NatsAuth

log = logging.getLogger(__name__)

PENDING_BYTES = 64 << 20  # published while the broker is away, sent once it is back
# NOTE: a server on a host that dropped off the network is not a closed socket but silence; only
# unanswered pings reveal it. Every PING_INTERVAL_S, and stale after MAX_OUTSTANDING_PINGS missed:
# a client fails over to another server of the cluster in 4-6 s, not nats-py's default 4 minutes.
PING_INTERVAL_S = 2.0
MAX_OUTSTANDING_PINGS = 2
OUTAGE_S = 15.0  # how long a call waits out a broker outage (NATS restarts in a few seconds)
BROKER_GIVE_UP_S = 300.0  # disconnected this long, the broker is gone for good: the process exits
_DENIED = re.compile(r'permissions violation for publish to "([^"]+)"', re.IGNORECASE)


class Flushable(Protocol):
    """What `shutdown` asks of a publisher registered on a connection (common/bus/events.py)."""

    name: str

    @property
    def queued(self) -> int: ...

    async def flush(self, timeout_s: float) -> bool: ...

    async def close(self) -> None: ...


class Connection(Client):
    """A NATS client with the bus's state of it (made by `connect`)."""

    def __init__(self) -> None:
        super().__init__()
        self.reconnected_at: float | None = None  # monotonic; a responder may not have resubscribed yet
        self.reconnect_callbacks: list[Callable[[], None]] = []
        self.denied: set[str] = set()  # subjects the broker told us we may not publish on
        self.publishers: list[Flushable] = []  # flushed by `shutdown`

    def on_reconnect(self, callback: Callable[[], None]) -> None:
        """Call `callback` (synchronously, on the event loop) each time the connection comes back."""
        self.reconnect_callbacks.append(callback)

    def recently_reconnected(self, within_s: float = OUTAGE_S) -> bool:
        return self.reconnected_at is not None and time.monotonic() - self.reconnected_at < within_s

    async def _on_disconnected(self) -> None:
        if not (self.is_closed or self.is_draining):  # else our own shutdown
            log.warning("NATS connection lost; reconnecting (publishes are buffered)")

    async def _on_reconnected(self) -> None:
        log.info("NATS connection back")
        self.reconnected_at = time.monotonic()
        for callback in self.reconnect_callbacks:
            callback()

    async def _on_error(self, exc: Exception) -> None:
        denied = _DENIED.search(str(exc))
        if denied:
            self.denied.add(denied[1])
        log.warning("NATS: %r", exc)


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


async def connect(url: str, name: str, auth: "NatsAuth | None" = None,
                  first_connect_timeout_s: float = 60.0) -> Connection:
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
        options["tls"] = ssl.create_default_context(cafile=auth.ca_file)
    deadline = time.monotonic() + first_connect_timeout_s
    while True:
        nc = Connection()
        try:
            await nc.connect(
                servers, name=name, connect_timeout=2, max_reconnect_attempts=-1,
                reconnect_time_wait=0.5, allow_reconnect=True, pending_size=PENDING_BYTES,
                ping_interval=PING_INTERVAL_S, max_outstanding_pings=MAX_OUTSTANDING_PINGS,
                disconnected_cb=nc._on_disconnected, reconnected_cb=nc._on_reconnected, error_cb=nc._on_error,
                drain_timeout=5,  # shutdown must not hang on a broker that is already gone
                **options,
            )
            return nc
        except Exception as exc:  # NoServersError, OSError, timeouts
            if time.monotonic() > deadline:
                raise ConnectionError(f"cannot reach NATS at {url}: {exc!r}") from exc
            await asyncio.sleep(0.5)


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


async def shutdown(nc: Connection, flush_s: float = 5.0) -> None:
    """Store the events still queued (at most `flush_s`), then drain (deliver what is in flight,
    then close); if the broker is already gone, just close."""
    publishers, nc.publishers = nc.publishers, []
    for publisher in publishers:
        if not await publisher.flush(flush_s):
            log.warning("%d events of %s not stored before shutdown", publisher.queued, publisher.name)
        await publisher.close()
    try:
        await nc.drain()
    except Exception as exc:  # DrainTimeoutError, ConnectionClosedError, ...
        log.info("could not drain the NATS connection (%r); closing it", exc)
        await nc.close()
