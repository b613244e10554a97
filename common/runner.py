"""The life of a service process: signals -> stop event -> cancel owned tasks -> drain NATS."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import sys
from typing import Any, Awaitable, Callable, Coroutine

import uvloop

log = logging.getLogger(__name__)


OWNER_ONLY = 0o077  # the umask of every cluster process: nothing it writes is readable by other users


class TaskGroup:
    """Background tasks owned by a service; all are cancelled on shutdown.

    An essential task (a receive or batch loop, heartbeats) that dies with an exception is logged
    and stops the service, which exits non-zero so its supervisor restarts it: a worker that lost
    its loop must not keep announcing itself as healthy. Loops catch what one request or message
    throws, so this only happens on a real bug. A non-essential task (one request's work, one
    resync) that dies is logged and nothing else: it must not take the process down.
    """

    def __init__(self, stop: asyncio.Event) -> None:
        self._stop = stop
        self._tasks: set[asyncio.Task[Any]] = set()
        self.failed = False  # an essential task died: the process should exit non-zero

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str, essential: bool = True) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._done(t, essential))
        return task

    def fail(self, why: str) -> None:
        """Stop the service as failed (it exits non-zero), e.g. when the cluster refuses it."""
        log.error("%s", why)
        self.failed = True
        self._stop.set()

    def _done(self, task: asyncio.Task[Any], essential: bool) -> None:
        self._tasks.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        log.error("task %s died", task.get_name(), exc_info=task.exception())
        if essential:
            self.failed = True
            self._stop.set()

    async def cancel_all(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


class Stop(asyncio.Event):
    """Set by the first SIGINT/SIGTERM (drain: finish what you hold, then exit); `hard` is set by a
    second one (exit now). Also set by an essential task's death (`TaskGroup`)."""

    def __init__(self) -> None:
        super().__init__()
        self.hard = asyncio.Event()

    def signal(self) -> None:
        if self.is_set():
            log.warning("second stop signal: exiting without finishing the work in hand")
            self.hard.set()
        self.set()


def started() -> None:
    """The service is up: what starting it made (modules, weights, a prefix index, a pool's
    bookkeeping) moves out of the garbage collector's reach (gc.freeze), so that a full
    collection walks only what came since. With torch imported a worker holds about 200k such
    objects, and one full collection over them took 86 ms here: a decode step or a route that
    waits on it. Each service calls it once, through `serving`, when it starts waiting for its stop."""
    gc.collect()
    gc.freeze()


async def serving(stop: asyncio.Event) -> None:
    """The service is up (`started`): wait for its stop."""
    started()
    await stop.wait()


def run(main: Callable[[Stop], Awaitable[bool | None]]) -> None:
    """Run `main(stop)` on uvloop until SIGINT/SIGTERM sets `stop`; main owns its cleanup and
    returns False (or raises) when the process failed, which exits with status 1 so a supervisor
    restarts it. Every service process (the gateway included) starts its loop here."""

    os.umask(OWNER_ONLY)  # before anything is created: pool, SSD tier, KV files, logs are the owner's alone

    async def runner() -> bool | None:
        stop = Stop()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.signal)
        return await main(stop)

    # uvloop (libuv): fewer microseconds per message read, written and woken than asyncio's own loop
    failed = uvloop.run(runner()) is False
    # NOTE: main has shut everything down and flushed its events by now. The interpreter's own
    # finalization (a collection over every module's objects: 1-2 s once torch is imported) would
    # only delay the exit a supervisor or a rolling restart waits for; the kernel frees the rest.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if failed else 0)


async def wait_or_hard(stop: Stop | asyncio.Event, aw: Awaitable[Any], timeout_s: float) -> bool:
    """Await `aw` for at most timeout_s, or until a second stop signal; True if it finished."""
    task = asyncio.ensure_future(aw)
    hard = asyncio.ensure_future(stop.hard.wait()) if isinstance(stop, Stop) else None
    waiting = {task} | ({hard} if hard else set())
    done, _ = await asyncio.wait(waiting, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    if hard is not None:
        hard.cancel()
    if task not in done:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        return False
    return True


async def wait_set(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait until `event` is set (True) or `timeout_s` passed (False).

    NOTE: not `asyncio.wait_for`: on Python 3.11 it swallows a cancellation that arrives as the
    event is set, so a loop around it is never cancelled and whoever awaits its task hangs (a
    refused worker never exited). `asyncio.timeout` counts cancellations and re-raises them.
    """
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
        return True
    except TimeoutError:
        return event.is_set()


async def every(interval_s: float, stop: asyncio.Event, fn: Callable[[], Awaitable[None]]) -> None:
    """Call fn every interval until stop is set (errors are logged, the loop goes on)."""
    while not stop.is_set():
        try:
            await fn()
        except Exception:
            log.exception("periodic task failed")
        await wait_set(stop, interval_s)
