"""The life of a service process: signals -> stop event -> cancel owned tasks -> drain NATS."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from typing import Any, Awaitable, Callable, Coroutine

log = logging.getLogger(__name__)


class TaskGroup:
    """Background tasks owned by a service; all are cancelled on shutdown.

    A task that dies with an exception is logged and stops the service (a worker that lost its
    receive loop must not keep announcing itself as healthy).
    """

    def __init__(self, stop: asyncio.Event) -> None:
        self._stop = stop
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("task %s died", task.get_name(), exc_info=task.exception())
            self._stop.set()

    async def cancel_all(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


def run(main: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run `main(stop)` until SIGINT/SIGTERM sets `stop`; main owns its cleanup."""

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await main(stop)

    asyncio.run(runner())


async def every(interval_s: float, stop: asyncio.Event, fn: Callable[[], Awaitable[None]]) -> None:
    """Call fn every interval until stop is set (errors are logged, the loop goes on)."""
    while not stop.is_set():
        try:
            await fn()
        except Exception:
            log.exception("periodic task failed")
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_s)
