"""Supervision for `moonbus up`: restart a process that exits, stop only on Ctrl-C/SIGTERM.

Policy (`RestartPolicy`, pure): a process that exits is started again with the argv it had after
a backoff that doubles with each recent exit (0.5 s, 1 s, 2 s, ... up to `max_backoff_s`); an
exit more than `window_s` ago no longer counts. More than `crash_limit` exits within the window
is a crash loop: the process is left down with a clear message (and an `instance.crash_loop`
event), and every other process keeps serving. Each restart is an `instance.restarted` event.

`SupervisorEvents` publishes those events from this synchronous supervisor through a NATS
connection on a background thread (publishes made while the broker itself restarts are
buffered by the client and sent once it is back), and hands what the supervisor listens to
(`listen`: with --autoscale, the planner's events and the workers' heartbeats) to a callback
on that thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestartPolicy:
    base_backoff_s: float = 0.5
    max_backoff_s: float = 10.0
    window_s: float = 60.0
    crash_limit: int = 5

    def delay(self, exits: list[float], now: float) -> float | None:
        """Seconds to wait before restarting after the exits at these times; None = crash loop."""
        recent = [t for t in exits if now - t <= self.window_s]
        if len(recent) > self.crash_limit:
            return None
        return min(self.max_backoff_s, self.base_backoff_s * 2 ** max(0, len(recent) - 1))


@dataclass
class Restarts:
    """One process's exits and where its restart stands."""

    exits: list[float] = field(default_factory=list)  # monotonic times it exited
    restart_at: float | None = None  # when it will be started again
    count: int = 0  # restarts so far
    gave_up: bool = False


@dataclass(frozen=True)
class Action:
    """What supervision did in one pass, for the supervisor to print and publish."""

    kind: str  # "exited" | "restarted" | "gave_up"
    name: str
    detail: dict[str, Any]


class SupervisorEvents:
    """Publishes instance events for the supervisor (best effort: never blocks or raises)."""

    def __init__(self, nats_url: str, auth=None, secret: bytes | None = None, signer=None) -> None:
        self.nats_url = nats_url
        self.auth = auth  # the supervisor's NATS user (it may only write restart events)
        self.secret = secret  # the cluster secret: its events are sealed into the audit chain
        self.signer = signer  # its own key: and signed (common/signing.py)
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.publisher = None
        self.nc = None
        self.thread = threading.Thread(target=self._run, name="supervisor-events", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._connect())
        self.ready.set()
        self.loop.run_forever()

    async def _connect(self) -> None:
        from common import bus

        # the supervisor prints its own lines; the client's reconnect chatter would only add noise
        logging.getLogger("common.bus").setLevel(logging.ERROR)
        try:
            self.nc = await bus.connect(self.nats_url, "supervisor", self.auth, first_connect_timeout_s=30)
            self.publisher = bus.EventPublisher(self.nc, "supervisor", "supervisor", secret=self.secret,
                                                signer=self.signer)
        except ConnectionError as exc:
            log.warning("supervisor events are off: %s", exc)

    def instance(self, kind: str, name: str, /, **data: Any) -> None:
        if self.publisher is None:
            return
        asyncio.run_coroutine_threadsafe(self.publisher.instance(kind, name, **data), self.loop)

    def listen(self, subject: str, handler: Callable[[str, bytes], None]) -> bool:
        """Call `handler(subject, data)` on the events thread for each message on `subject`, from
        now on (a message that makes it raise is logged and dropped). False when the supervisor
        has no connection (events are off)."""
        self.ready.wait(35)
        if self.nc is None:
            return False
        from common import bus

        async def handle(msg) -> None:
            handler(msg.subject, msg.data)

        async def subscribe() -> None:
            await bus.subscribe(self.nc, subject, handle)
            await self.nc.flush()

        asyncio.run_coroutine_threadsafe(subscribe(), self.loop).result(10)
        return True

    def exited(self, name: str, exit_code: int) -> None:
        """Tell the conductors that this instance's process exited: it is dead now, so its requests
        are handed back at once rather than after its heartbeats are missed."""
        if self.nc is None:
            return
        from common import bus
        from schemas import subjects
        from schemas.workers import Exited

        payload = Exited(name, exit_code).to_bytes()
        asyncio.run_coroutine_threadsafe(bus.publish(self.nc, subjects.control_exited(name), payload), self.loop)

    def close(self) -> None:
        async def shut() -> None:
            if self.nc is not None:
                from common import bus

                await bus.shutdown(self.nc)

        if self.thread.is_alive():
            self.ready.wait(5)
            try:
                asyncio.run_coroutine_threadsafe(shut(), self.loop).result(5)
            except Exception:  # the broker is gone: nothing to flush
                pass
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)
