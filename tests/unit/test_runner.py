"""common.runner: services run on uvloop; waits that a cancellation always ends."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import uvloop

from common import runner

SERVICE = """
import asyncio, sys
from common import runner

async def main(stop):
    loop = asyncio.get_running_loop()
    print(f"{type(loop).__module__}.{type(loop).__name__}", flush=True)
    return sys.argv[1] == "ok"

runner.run(main)
"""


def test_a_service_runs_on_uvloop_and_exits_with_its_status():
    for outcome, status in (("ok", 0), ("failed", 1)):
        proc = subprocess.run([sys.executable, "-c", SERVICE, outcome], capture_output=True, text=True, timeout=60)
        assert (proc.returncode, proc.stdout.strip()) == (status, "uvloop.Loop"), proc.stderr


STARTED = """
import gc
from common import runner

index = [[i] for i in range(100_000)]  # what a service builds while it starts
runner.started()
after = [[i] for i in range(10)]
print(gc.get_freeze_count(), len(gc.get_objects()))
"""


def test_what_a_service_made_while_starting_is_out_of_the_collectors_walks():
    proc = subprocess.run([sys.executable, "-c", STARTED], capture_output=True, text=True, timeout=60)
    frozen, walked = map(int, proc.stdout.split())
    assert frozen > 100_000, proc.stderr
    assert walked < 1_000  # a full collection now walks what came after, not the index


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


def test_the_cancellation_race_holds_on_uvloop_too():
    uvloop.run(test_a_loop_on_wait_set_is_cancelled_even_as_its_event_is_set())
