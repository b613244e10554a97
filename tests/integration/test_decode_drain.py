"""A decode instance handing back what it holds (its drain's grace ran out, or it failed) while a
decode step is running: the step's rows stay the engine's until the step returns, the loop lives
on, and each request handed back gets exactly one retryable error. After the hand-back, what still
reaches the batch (a hand-off that lands, a task whose KV was loading) is handed back too. And the
batch steps on while a joining request's KV loads.

Real parts: a nats-server, tiny-random's weights and the batch engine. The step is held (after it
computed, before it returns) so that the hand-back lands inside it every time; a make test under
load once caught it there by chance (KeyError in the decode loop, exit code 1).
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import torch

from common import bus, kvfiles, models, profiles, runner
from common.engine.batch import BatchEngine
from services.decode.batch_loop import DecodeService
from services.decode.config import DecodeConfig
from services.decode.keep import Running
from schemas import subjects
from schemas.decode import DecodeTask
from schemas.route import SamplingParams
from schemas.tokens import TokenChunk
from schemas.transfer import KvHandle
from tests.wait import until

pytestmark = pytest.mark.integration
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
# 4,096 tokens of tiny-random's float32 KV (1 KiB a token), plus a block of slack for each of 4 rows
KV_CACHE_BYTES = (4096 + 4 * 16) * 1024


def config(url: str, home: Path) -> DecodeConfig:
    return DecodeConfig(nats_url=url, instance_id="decode-t", node="node-t", shm_dir=home / "shm",
                        model=models.TINY_RANDOM, block_tokens=16, dtype="float32", home=home, threads=1,
                        heartbeat_interval_s=0.15, drain_grace_s=0.0, orphan_kv_s=60.0, store_every_blocks=0,
                        max_batch=4, kv_cache_bytes=KV_CACHE_BYTES, tbt_slo_s=1.0, yield_tbt=0.25, yield_after=0.5, late_check=False,
                        profile="")


class CountedLock(asyncio.Lock):
    """The decode loop's compute lock, counting who asked for it."""

    def __init__(self) -> None:
        super().__init__()
        self.asked = 0

    async def acquire(self) -> bool:
        self.asked += 1
        return await super().acquire()


class Decode:
    """A decode instance's role on tiny-random, not started (the test drives its loop's steps),
    with every TokenChunk it sends to REPLY collected."""

    def __init__(self, service: DecodeService, nc, chunks: list[TokenChunk]) -> None:
        self.service, self.nc, self.chunks = service, nc, chunks
        self.engine = service.engine

    def task(self, rid: str, kv: KvHandle | None = None) -> DecodeTask:
        return DecodeTask(rid, PROMPT, 42, SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True), REPLY,
                          kv or KvHandle("node-t", f"{rid}.kv", [1, 2, 1, len(PROMPT), 1], "float32", 0), 0.0)

    def kv(self) -> torch.Tensor:
        m = self.engine.model
        return torch.zeros(m.num_layers, 2, m.num_kv_heads, len(PROMPT), m.head_dim, dtype=m.dtype)

    async def errors(self) -> list[TokenChunk]:
        """The error chunks sent so far: they come back over the broker, in the order they were sent
        on the connection, so all of them are back once a chunk sent after them is."""
        await self.nc.publish(subjects.tokens_from(REPLY, "worker", "test"), END.to_bytes())
        await until(lambda: END in self.chunks, "a chunk sent after the service's comes back")
        return [c for c in self.chunks if c.error]


REPLY = "moonbus.test.decode-drain"
END = TokenChunk("end-of-test", 0, [])


@pytest.fixture
async def decode(bare_nats_url, tmp_path):
    cfg = config(bare_nats_url, tmp_path)
    worker = models.load_for_worker(cfg.model, cfg.home, 1, cfg.dtype)
    engine = BatchEngine.for_memory(worker.model, cfg.max_batch, cfg.kv_cache_bytes)
    perf, _ = profiles.load(cfg.home, cfg.model, "", cfg.dtype)
    nc = await bus.connect(bare_nats_url, "decode-t")
    service = DecodeService(cfg, nc, engine, None, worker.kv_layout(cfg.block_tokens), runner.TaskGroup(runner.Stop()),
                            perf)
    chunks: list[TokenChunk] = []

    async def on_chunk(msg) -> None:
        chunks.append(TokenChunk.from_bytes(msg.data))

    await bus.subscribe(nc, subjects.tokens_sent_to(REPLY), on_chunk)  # each sender's, below the request's
    await bus.flush(nc)
    yield Decode(service, nc, chunks)
    await bus.shutdown(nc)


async def test_a_request_handed_back_during_a_step_is_failed_once_and_the_loop_lives_on(decode):
    service, engine = decode.service, decode.engine
    task = decode.task("r1")  # one request in the batch, as `admit` leaves it
    engine.add("r1", decode.kv(), task.first_token, task.sampling, 1)
    service.running["r1"] = Running(task, [task.first_token])

    computed, release = threading.Event(), threading.Event()
    step = engine.step

    def held_step():  # the step computes, then waits before it returns
        result = step()
        computed.set()
        release.wait()  # set in the test's `finally`, whatever happens
        return result

    engine.step = held_step
    service.compute_lock = lock = CountedLock()
    try:
        iteration = asyncio.create_task(service.iterate())
        await until(computed.is_set, "the step has computed")
        handing_back = asyncio.create_task(service.hand_back("decode instance decode-t is shutting down"))
        # the hand-back has gone as far as it can while the step is held: it waits for the lock the
        # step holds (or, wrongly, it is done)
        await until(lambda: lock.asked == 2 or handing_back.done(), "the hand-back waits for the step")
        assert not handing_back.done(), "the hand-back took a row out of the engine while its step ran"
        assert "r1" in service.running and "r1" in engine.index
    finally:
        release.set()
    await iteration  # the loop's iteration ends normally: its row was still there
    await handing_back
    assert service.running == {} and "r1" not in engine.index and service.num_held == 0
    errors = await decode.errors()
    assert len(errors) == 1 and errors[0].retryable and errors[0].error_status == 503, decode.chunks
    assert "shutting down" in errors[0].error
    tokens = [c for c in decode.chunks if c.token_ids]  # the step's token went out before the hand-back
    assert [c.index for c in tokens] == [1]


async def test_what_reaches_the_batch_after_the_hand_back_is_handed_back_too(decode):
    """A task whose KV was loading during the hand-back (its room held, not in the batch yet) and
    a hand-off that lands after it each get one retryable 503 and never join the batch."""
    service, engine = decode.service, decode.engine
    handle = kvfiles.write(service.cfg.shm_dir, "node-t", "loading.kv", decode.kv())
    service.joins.waiting.append(decode.task("loading", handle))
    await service.joins.admit_waiting()  # its load starts, its room held
    assert "loading" in service.joins.loading and engine.reserved_tokens > 0
    job = service.joins.loading["loading"].job
    await service.hand_back("decode instance decode-t is shutting down")
    await service.joins.check_in(decode.task("late"))  # landed after the hand-back
    await asyncio.wait([job])
    await service.joins.join_loaded()  # the finished load joins nothing
    assert service.running == {} and not service.joins.waiting and not service.joins.loading and service.num_held == 0
    assert engine.num_running == 0 and engine.reserved_tokens == 0 and not engine.pending
    assert not kvfiles.path_of(service.cfg.shm_dir, handle).exists()
    errors = await decode.errors()
    assert sorted(c.request_id for c in errors) == ["late", "loading"]
    assert all(c.retryable and c.error_status == 503 and "shutting down" in c.error for c in errors)


async def test_the_batch_steps_on_while_a_joining_request_loads_its_kv(decode):
    """A request's KV loads on a thread with its room held: the running rows get tokens meanwhile,
    and it joins between two steps once loaded (held here until the test lets it go)."""
    service, engine = decode.service, decode.engine
    task = decode.task("r1")
    engine.add("r1", decode.kv(), task.first_token, task.sampling, 1)
    service.running["r1"] = Running(task, [task.first_token])
    handle = kvfiles.write(service.cfg.shm_dir, "node-t", "r2.kv", decode.kv())
    service.joins.waiting.append(decode.task("r2", handle))
    release = threading.Event()
    load = service.joins.load

    def held_load(t):
        release.wait()  # set in the test's `finally`, whatever happens
        return load(t)

    service.joins.load = held_load
    loop = asyncio.create_task(service.loop())
    try:
        # while r2's load is held, r1 keeps getting tokens
        await until(lambda: sum(1 for c in decode.chunks if c.request_id == "r1") >= 5, "r1 has 5 tokens")
        assert "r2" in service.joins.loading and "r2" not in engine
        assert engine.reserved_tokens == 2 * service.joins.needed(task)  # r2's room is held while it loads
        assert service.report().joined[-1].request_id == "r2"  # the conductors count it as coming
        release.set()
        await until(lambda: any(c.request_id == "r2" for c in decode.chunks), "r2 has a token")
        assert "r2" in engine and not service.joins.loading
        assert any(c.request_id == "r2" and c.token_ids for c in decode.chunks)
    finally:
        release.set()
        loop.cancel()
