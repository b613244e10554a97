"""common.runner: waits that a cancellation always ends."""

from __future__ import annotations

import asyncio

from common import runner


async def _loop_until_cancelled(event: asyncio.Event, wait) -> None:
    while True:
        await wait(event, 10.0)
        event.clear()


async def test_a_loop_on_wait_set_is_cancelled_even_as_its_event_is_set():
    # The race that kept a refused worker alive: the event is set and the task cancelled in the
    # same turn of the loop. asyncio.wait_for (Python 3.11) returns the result and drops the
    # cancellation; the loop goes on and `await task` never returns.
    for _ in range(50):
        event = asyncio.Event()
        task = asyncio.create_task(_loop_until_cancelled(event, runner.wait_set))
        await asyncio.sleep(0)  # the task is now waiting on the event
        event.set()
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=5.0)
        assert task in done and task.cancelled()


async def test_wait_set_says_whether_the_event_was_set():
    event = asyncio.Event()
    assert await runner.wait_set(event, 0.01) is False
    event.set()
    assert await runner.wait_set(event, 0.01) is True
