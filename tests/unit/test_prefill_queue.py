"""The prefill instance's queue (services/prefill/queue.py ArrivalQueue): requests in the order they
arrived at a gateway, so that a request handed back and resumed keeps its place in line."""

import asyncio

from msgspec.structs import replace

from services.prefill.queue import ArrivalQueue
from schemas.prefill import PipelineSpec, PrefillTask
from schemas.route import SamplingParams


def task(rid: str, arrival: float, attempt: int = 0, pipeline: bool = False) -> PrefillTask:
    spec = PipelineSpec(["prefill-0", "prefill-1"], ["127.0.0.1:1", "127.0.0.1:2"], 64) if pipeline else None
    return PrefillTask(rid, [1, 2, 3], SamplingParams(max_tokens=4), "_INBOX.x", "decode-0", "node-d0", arrival,
                       pipeline=spec, attempt=attempt)


def order(queue: ArrivalQueue) -> list[tuple[str, int]]:
    return [(t.request_id, t.attempt) for t in queue.tasks()]


def test_a_resumed_attempt_takes_its_requests_place_not_the_back_of_the_line():
    async def main() -> list[tuple[str, int]]:
        queue = ArrivalQueue()
        for i, arrival in enumerate((10.0, 11.0, 12.0, 13.0)):
            await queue.put(task(f"r{i}", arrival))
        await queue.put(task("r1", 11.0, attempt=1))  # handed back while it waited: it comes again
        assert order(queue) == [("r0", 0), ("r1", 0), ("r1", 1), ("r2", 0), ("r3", 0)]
        return [((t := await queue.get()).request_id, t.attempt) for _ in range(queue.qsize())]

    assert asyncio.run(main()) == [("r0", 0), ("r1", 0), ("r1", 1), ("r2", 0), ("r3", 0)]


def test_a_pipeline_stage_always_goes_to_the_back():
    """Stages of two requests must run in the same order on every instance of the group."""
    async def main() -> None:
        queue = ArrivalQueue()
        await queue.put(task("a", 20.0))
        await queue.put(task("p", 5.0, pipeline=True))  # arrived first, came here last
        await queue.put(task("b", 21.0))
        await queue.put(task("q", 4.0, pipeline=True))
        assert order(queue) == [("a", 0), ("p", 0), ("b", 0), ("q", 0)]

    asyncio.run(main())


def test_the_queue_tells_its_most_urgent_request_after_every_put_and_get():
    """What the decode instances that yield to a prefill queue read (common/cores.py `waiting`):
    the arrival and TTFT deadline of the waiting task whose deadline comes first."""
    heard: list[tuple[float, float]] = []

    async def main() -> None:
        queue = ArrivalQueue(lambda arrival, deadline: heard.append((arrival, deadline)))
        await queue.put(replace(task("a", 1.0), ttft_deadline_ts=31.0))
        await queue.put(replace(task("b", 2.0), ttft_deadline_ts=32.0))
        await queue.put(task("c", 0.5))  # no deadline (admission off): never the urgent one
        await queue.get()  # c first: it arrived first
        await queue.get()  # a
        queue.get_nowait()  # b

    asyncio.run(main())
    assert heard == [(1.0, 31.0), (1.0, 31.0), (1.0, 31.0), (1.0, 31.0), (2.0, 32.0), (0.0, 0.0)]
