"""A decode instance handing back what it holds (its drain's grace ran out, or it failed) while a
decode step is running: the step's rows stay the engine's until the step returns, the loop lives
on, and each request handed back gets exactly one retryable error.

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

from common import bus, models, profiles, runner
from common.config import NatsAuth
from common.engine.batch import BatchEngine
from common.roles.decode import DecodeService, Running
from common.roles.decode_config import DecodeConfig
from schemas.decode import DecodeTask
from schemas.route import SamplingParams
from schemas.tokens import TokenChunk
from schemas.transfer import KvHandle
from tests.integration.conftest import bare_nats_server
from tools.moonbus.cluster.processes import free_port

pytestmark = pytest.mark.integration
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


@pytest.fixture
async def nats_url():
    port = free_port()
    server = bare_nats_server(port)
    try:
        yield f"nats://127.0.0.1:{port}"
    finally:
        server.kill()
        server.wait()


def config(nats_url: str, home: Path) -> DecodeConfig:
    return DecodeConfig(nats_url, NatsAuth(), "", "decode-t", "node-t", home / "shm", models.TINY_RANDOM, 16, "float32",
                        home, "INFO", "", 0, "127.0.0.1", 1, 0.15, 0.0, 60.0, 0, 4, 4096, 1.0, False, "")


async def test_a_request_handed_back_during_a_step_is_failed_once_and_the_loop_lives_on(nats_url, tmp_path):
    cfg = config(nats_url, tmp_path)
    worker = models.load_for_worker(cfg.model, cfg.home, 1, cfg.dtype)
    engine = BatchEngine(worker.model, cfg.max_batch, cfg.kv_budget_tokens)
    perf, _ = profiles.load(cfg.home, cfg.model, "", cfg.dtype)
    nc = await bus.connect(nats_url, "decode-t")
    stop = runner.Stop()
    service = DecodeService(cfg, nc, engine, None, worker.kv_layout(cfg.block_tokens), runner.TaskGroup(stop), perf)
    chunks: list[TokenChunk] = []

    async def on_chunk(msg) -> None:
        chunks.append(TokenChunk.from_bytes(msg.data))

    reply_subject = "moonbus.test.decode-drain"
    await bus.subscribe(nc, reply_subject, on_chunk)
    await bus.flush(nc)
    # one request in the batch, as `admit` leaves it
    m = worker.model
    kv = torch.zeros(m.num_layers, 2, m.num_kv_heads, len(PROMPT), m.head_dim, dtype=m.dtype)
    task = DecodeTask("r1", PROMPT, 42, SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True), reply_subject,
                      KvHandle("node-t", "r1.kv", list(kv.shape), "float32", 0), 0.0)
    engine.add("r1", kv, task.first_token, task.sampling, 1)
    service.running["r1"] = Running(task, [task.first_token])

    computed, release = threading.Event(), threading.Event()
    step = engine.step

    def held_step():  # the step computes, then waits before it returns
        result = step()
        computed.set()
        release.wait(30)
        return result

    engine.step = held_step
    try:
        iteration = asyncio.create_task(service.iterate())
        assert await asyncio.to_thread(computed.wait, 30)
        handing_back = asyncio.create_task(service.hand_back("decode instance decode-t is shutting down"))
        done, _ = await asyncio.wait({handing_back}, timeout=0.5)
        assert not done, "the hand-back took a row out of the engine while its step ran"
        assert "r1" in service.running and "r1" in engine.index
    finally:
        release.set()
    await iteration  # the loop's iteration ends normally: its row was still there
    await handing_back
    assert service.running == {} and "r1" not in engine.index and service.num_held == 0
    await bus.flush(nc)
    await asyncio.sleep(0.2)  # the chunks come back over the broker
    errors = [c for c in chunks if c.error]
    assert len(errors) == 1 and errors[0].retryable and errors[0].error_status == 503, chunks
    assert "shutting down" in errors[0].error
    tokens = [c for c in chunks if c.token_ids]  # the step's token went out before the hand-back
    assert [c.index for c in tokens] == [1]
    await bus.shutdown(nc)
