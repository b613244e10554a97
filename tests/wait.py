"""Waiting in a test: on a condition, never for a fixed time.

A test that sleeps a fixed time and then asserts depends on the machine's speed: the sleep is too
short on a loaded machine and wasted on a fast one. `until` polls the condition instead (every
20 ms at first, backing off to half a second, so that a condition that asks a service over the
bus does not flood it), with a deadline so generous that only a condition that never comes
reaches it: a hang, reported with what was awaited, not a slow machine.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from typing import Any, Callable

DEADLINE_S = 60.0
FIRST_POLL_S, LAST_POLL_S = 0.02, 0.5


async def until(check: Callable[[], Any], what: str, timeout_s: float = DEADLINE_S) -> Any:
    """Return `check()`'s first truthy value (`check` may be a coroutine function); fail, saying
    `what` was awaited, once `timeout_s` has passed without one."""
    deadline, pause = time.monotonic() + timeout_s, FIRST_POLL_S
    while True:
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout_s:g} s waiting until {what}"
        await asyncio.sleep(pause)
        pause = min(2 * pause, LAST_POLL_S)


def until_sync(check: Callable[[], Any], what: str, timeout_s: float = DEADLINE_S) -> Any:
    """`until` for a test without an event loop (threads, sockets): blocks while it polls."""
    deadline, pause = time.monotonic() + timeout_s, FIRST_POLL_S
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out after {timeout_s:g} s waiting until {what}"
        time.sleep(pause)
        pause = min(2 * pause, LAST_POLL_S)
    return value
