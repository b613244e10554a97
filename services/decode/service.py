"""Decode instance: continuous batching over every request whose KV has arrived.

DecodeTask (NATS) -> late TBT re-check (reject now rather than break the batch's SLO) -> wait
for KV room -> load the KV from the node's shared memory into the batch -> every iteration ONE
forward for the whole batch (services/decode/batch.py), each request sampled with its own
settings, its token published to its gateway -> finished or cancelled requests leave, and the
KV of finished ones is stored in the node's pool so that the next turn of a conversation hits.

`compute_lock`: in a coupled instance (services/coupled) the PrefillService holds the same lock
around its forward, so an iteration waits while a prefill runs (the prefill pauses the batch).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from dataclasses import dataclass, field

import torch
from nats.aio.msg import Msg

from common import bus, kvfiles, models, profiles, runner
from common.pool_client import PoolClient, PoolUnavailable
from schemas import subjects
from schemas.decode import DecodeTask
from schemas.tokens import TokenChunk
from schemas.workers import WorkerInfo
from services.decode.batch import BatchEngine
from services.decode.config import DecodeConfig

log = logging.getLogger(__name__)


@dataclass
class Running:
    task: DecodeTask
    generated: list[int]  # every completion token so far (the first came from prefill)
    started: float = field(default_factory=time.perf_counter)

    @property
    def request_id(self) -> str:
        return self.task.request_id


class DecodeService:
    def __init__(self, cfg: DecodeConfig, nc, engine: BatchEngine, eos_token_id: int | None,
                 layout, tasks: runner.TaskGroup, perf, compute_lock: asyncio.Lock | None = None) -> None:
        self.cfg = cfg
        self.nc = nc
        self.engine = engine
        self.eos_token_id = eos_token_id
        self.tasks = tasks
        self.perf = perf
        self.events = bus.EventPublisher(nc, "decode", cfg.instance_id)
        self.pool = PoolClient(nc, cfg.node, layout, self.events)
        self.arrived: asyncio.Queue[DecodeTask] = asyncio.Queue()
        self.waiting: collections.deque[DecodeTask] = collections.deque()  # passed the TBT check, no KV room yet
        self.running: dict[str, Running] = {}  # request_id -> Running
        self.cancelled: set[str] = set()
        self.compute_lock = compute_lock or contextlib.nullcontext()

    async def on_task(self, msg: Msg) -> None:
        try:
            await self.arrived.put(DecodeTask.from_bytes(msg.data))
        except ValueError:
            log.exception("dropping malformed decode task")

    async def on_cancel(self, msg: Msg) -> None:
        self.cancelled.add(msg.data.decode())
        if len(self.cancelled) > 10_000:
            self.cancelled.clear()

    async def loop(self) -> None:
        while True:
            if not self.running and not self.waiting:
                await self.check_in(await self.arrived.get())
            while not self.arrived.empty():
                await self.check_in(self.arrived.get_nowait())
            await self.admit_waiting()
            self.drop_cancelled()
            if self.running:
                await self.iterate()
            elif self.waiting:
                await asyncio.sleep(0.01)  # KV room frees only when requests finish: cannot happen here

    async def check_in(self, task: DecodeTask) -> None:
        """A request's KV has arrived: the late TBT re-check, then the wait for KV room."""
        if task.request_id in self.cancelled:
            kvfiles.remove(self.cfg.shm_dir, task.kv)
        elif self.cfg.late_check and not self.engine.tbt_admits(len(task.prompt_token_ids), self.perf, self.cfg.tbt_slo_s):
            await self.reject_late(task, f"decode instance {self.cfg.instance_id} cannot meet the TBT SLO")
        elif self.needed(task) > self.engine.kv_budget_tokens:
            await self.reject_late(task, f"the request needs {self.needed(task)} KV tokens; "
                                         f"the decode budget is {self.engine.kv_budget_tokens}")
        else:
            self.waiting.append(task)

    def needed(self, task: DecodeTask) -> int:
        return self.engine.tokens_needed(len(task.prompt_token_ids), task.sampling, 1)

    async def admit_waiting(self) -> None:
        while self.waiting and self.engine.can_admit(self.needed(self.waiting[0])):
            task = self.waiting.popleft()
            rid = task.request_id
            try:
                kv = await asyncio.to_thread(kvfiles.read, self.cfg.shm_dir, task.kv, True)
            except (OSError, kvfiles.KvChecksumError) as exc:
                log.error("request %s: cannot load its KV: %s", rid, exc)
                await self.reply(task, TokenChunk(rid, 1, [], error=f"decode could not load KV: {exc}",
                                                  error_status=500, source=self.cfg.instance_id))
                continue
            self.engine.add(rid, kv, task.first_token, task.sampling, 1)
            self.running[rid] = Running(task, [task.first_token])

    def drop_cancelled(self) -> None:
        for rid in [rid for rid in self.running if rid in self.cancelled]:
            self.engine.remove(rid)
            del self.running[rid]
        for task in [t for t in self.waiting if t.request_id in self.cancelled]:
            self.waiting.remove(task)
            kvfiles.remove(self.cfg.shm_dir, task.kv)

    async def iterate(self) -> None:
        async with self.compute_lock:
            tokens = await asyncio.to_thread(self.engine.step)
        for rid, token in tokens.items():
            seq = self.running[rid]
            index = len(seq.generated)
            seq.generated.append(token)
            finish = self.finish_reason(seq, token)
            if finish is not None:  # the event goes before the last token: the gateway's terminal event follows it
                kv = self.engine.kv_of(rid)
                self.engine.remove(rid)
                del self.running[rid]
                await self.events.request("decode_finished", rid, tokens=len(seq.generated),
                                          seconds=round(time.perf_counter() - seq.started, 6), finish_reason=finish)
                self.tasks.spawn(self.store_kv(seq, kv), f"store-{rid}")
            await self.reply(seq.task, TokenChunk(rid, index, [token], finish_reason=finish, source=self.cfg.instance_id))

    def finish_reason(self, seq: Running, token: int) -> str | None:
        if token == self.eos_token_id and not seq.task.sampling.ignore_eos:
            return "stop"
        if len(seq.generated) >= seq.task.sampling.max_tokens:
            return "length"
        if len(seq.task.prompt_token_ids) + len(seq.generated) >= self.engine.max_context:
            return "length"
        return None

    async def reject_late(self, task: DecodeTask, why: str) -> None:
        rid = task.request_id
        kvfiles.remove(self.cfg.shm_dir, task.kv)
        wasted = len(task.prompt_token_ids) - task.cached_tokens
        log.warning("request %s: rejected late (%s); %d prefill tokens wasted", rid, why, wasted)
        await self.events.request("rejected_late", rid, reason=why, running=self.engine.num_running,
                                  tbt_slo_s=self.cfg.tbt_slo_s, wasted_prefill_tokens=wasted,
                                  wasted_prefill_s=round(task.prefill_s, 6))
        await self.reply(task, TokenChunk(rid, 1, [], error=why, error_status=429, retry_after_s=1.0,
                                          source=self.cfg.instance_id, stage="decode",
                                          wasted_prefill_tokens=wasted, wasted_prefill_s=task.prefill_s))

    async def store_kv(self, seq: Running, kv: torch.Tensor) -> None:
        """Keep the prompt's and the completion's KV in the node's pool, so the next turn hits."""
        # the KV covers every token but the last one sampled (it was never fed back)
        tokens = seq.task.prompt_token_ids + seq.generated[:-1]
        try:
            await self.pool.store(seq.request_id, tokens, kv)
        except PoolUnavailable as exc:
            log.warning("request %s: KV not stored: %s", seq.request_id, exc)

    async def reply(self, task: DecodeTask, chunk: TokenChunk) -> None:
        await self.nc.publish(task.reply_subject, chunk.to_bytes())

    async def heartbeat(self) -> None:
        info = WorkerInfo(self.cfg.instance_id, "decode", self.cfg.node, self.cfg.model,
                          num_queued=self.arrived.qsize() + len(self.waiting), num_running=self.engine.num_running)
        await self.nc.publish(subjects.WORKER_HEARTBEAT, info.to_bytes())

    async def start(self, stop: asyncio.Event, model_name: str, profile_source: str) -> None:
        """Subscribe, start the batch loop and the heartbeats, announce the instance."""
        cfg = self.cfg
        await self.nc.subscribe(subjects.decode_tasks(cfg.instance_id), cb=self.on_task)
        await self.nc.subscribe(subjects.REQUEST_CANCEL, cb=self.on_cancel)
        self.tasks.spawn(self.loop(), f"decode-loop-{cfg.instance_id}")
        self.tasks.spawn(runner.every(cfg.heartbeat_interval_s, stop, self.heartbeat), f"heartbeat-{cfg.instance_id}")
        await self.events.instance("started", cfg.instance_id, role="decode", node=cfg.node, model=model_name)
        log.info("decode %s ready on node %s (model %s): batch <= %d, KV budget %d tokens, late TBT check %s "
                 "(slo %gs), profile %s", cfg.instance_id, cfg.node, model_name, cfg.max_batch, cfg.kv_budget_tokens,
                 "on" if cfg.late_check else "off", cfg.tbt_slo_s, profile_source)

    async def leave(self) -> None:
        info = WorkerInfo(self.cfg.instance_id, "decode", self.cfg.node, leaving=True)
        await self.nc.publish(subjects.WORKER_HEARTBEAT, info.to_bytes())


async def serve(cfg: DecodeConfig, stop: asyncio.Event) -> None:
    worker = await asyncio.to_thread(models.load_for_worker, cfg.model, cfg.home, cfg.threads)
    perf, source = profiles.load(cfg.home, cfg.model, cfg.profile)
    engine = BatchEngine(worker.model, cfg.max_batch, cfg.kv_budget_tokens)
    nc = await bus.connect(cfg.nats_url, cfg.instance_id)
    tasks = runner.TaskGroup(stop)
    service = DecodeService(cfg, nc, engine, worker.eos_token_id, worker.shape.kv_layout(cfg.block_tokens), tasks, perf)
    await service.start(stop, worker.ref.name, source)
    await stop.wait()
    await service.leave()
    await tasks.cancel_all()
    await bus.shutdown(nc)
