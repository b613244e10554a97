"""Decode instance: continues requests whose KV has arrived, one token per iteration each.

DecodeTask (NATS) -> load the KV from the node's shared memory -> join the running set ->
every iteration: one forward per running request, sample, publish its token to the gateway,
drop finished or cancelled requests.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import torch
from nats.aio.msg import Msg
from transformers import DynamicCache

from common import bus, engine, kvfiles, models, profiles, runner, sampling
from common.pool_client import PoolClient, PoolUnavailable
from schemas import subjects
from schemas.decode import DecodeTask
from schemas.tokens import TokenChunk
from schemas.workers import WorkerInfo
from services.conductor.admission import decode_admits
from services.conductor.policy import DecodeCandidate
from services.decode.config import DecodeConfig

log = logging.getLogger(__name__)


@dataclass
class Sequence:
    task: DecodeTask
    cache: DynamicCache
    last_token: int
    num_generated: int = 1  # the first token came from prefill
    started: float = field(default_factory=time.perf_counter)
    generated: list[int] = field(default_factory=list)  # every completion token so far

    @property
    def request_id(self) -> str:
        return self.task.request_id


class DecodeService:
    def __init__(self, cfg: DecodeConfig, nc, model, eos_token_id: int | None, max_context: int,
                 layout, tasks: runner.TaskGroup, perf) -> None:
        self.cfg = cfg
        self.nc = nc
        self.model = model
        self.eos_token_id = eos_token_id
        self.max_context = max_context
        self.tasks = tasks
        self.events = bus.EventPublisher(nc, "decode", cfg.instance_id)
        self.pool = PoolClient(nc, cfg.node, layout, self.events)
        self.perf = perf
        self.waiting: asyncio.Queue[DecodeTask] = asyncio.Queue()
        self.running: dict[str, Sequence] = {}  # request_id -> Sequence
        self.cancelled: set[str] = set()

    async def on_task(self, msg: Msg) -> None:
        try:
            await self.waiting.put(DecodeTask.from_bytes(msg.data))
        except ValueError:
            log.exception("dropping malformed decode task")

    async def on_cancel(self, msg: Msg) -> None:
        self.cancelled.add(msg.data.decode())
        if len(self.cancelled) > 10_000:
            self.cancelled.clear()

    async def loop(self) -> None:
        while True:
            if not self.running:
                await self.admit(await self.waiting.get())
            while not self.waiting.empty() and len(self.running) < self.cfg.max_batch:
                await self.admit(self.waiting.get_nowait())
            for rid in [rid for rid in self.running if rid in self.cancelled]:
                del self.running[rid]
            if self.running:
                await self.iterate()

    async def admit(self, task: DecodeTask) -> None:
        rid = task.request_id
        if rid in self.cancelled:
            kvfiles.remove(self.cfg.shm_dir, task.kv)
            return
        if not self.tbt_allows(task):
            await self.reject_late(task)
            return
        try:
            kv = await asyncio.to_thread(kvfiles.read, self.cfg.shm_dir, task.kv, True)
        except (OSError, kvfiles.KvChecksumError) as exc:
            log.error("request %s: cannot load its KV: %s", rid, exc)
            await self.nc.publish(task.reply_subject, TokenChunk(rid, 1, [], error=f"decode could not load KV: {exc}",
                                                                 error_status=500, source=self.cfg.instance_id).to_bytes())
            return
        self.running[rid] = Sequence(task, engine.cache_from_kv(kv), task.first_token, generated=[task.first_token])

    def tbt_allows(self, task: DecodeTask) -> bool:
        """The late TBT re-check (services/conductor/admission.decode_admits) when the KV arrives."""
        if not self.cfg.late_check:
            return True
        context = sum(len(s.task.prompt_token_ids) + s.num_generated for s in self.running.values())
        state = DecodeCandidate(self.cfg.instance_id, self.cfg.node, len(self.running), context)
        return decode_admits(state, len(task.prompt_token_ids), self.perf, self.cfg.tbt_slo_s)

    async def reject_late(self, task: DecodeTask) -> None:
        rid = task.request_id
        kvfiles.remove(self.cfg.shm_dir, task.kv)
        wasted = len(task.prompt_token_ids) - task.cached_tokens
        log.warning("request %s: rejected late (TBT SLO %gs with %d running); %d prefill tokens wasted",
                    rid, self.cfg.tbt_slo_s, len(self.running), wasted)
        await self.events.request("rejected_late", rid, running=len(self.running), tbt_slo_s=self.cfg.tbt_slo_s,
                                  wasted_prefill_tokens=wasted, wasted_prefill_s=round(task.prefill_s, 6))
        chunk = TokenChunk(rid, 1, [], error=f"decode instance {self.cfg.instance_id} cannot meet the TBT SLO",
                           error_status=429, retry_after_s=1.0, source=self.cfg.instance_id, stage="decode",
                           wasted_prefill_tokens=wasted, wasted_prefill_s=task.prefill_s)
        await self.nc.publish(task.reply_subject, chunk.to_bytes())

    async def iterate(self) -> None:
        batch = list(self.running.values())
        tokens = await asyncio.to_thread(self.step, batch)
        for seq, token in zip(batch, tokens):
            index = seq.num_generated
            seq.num_generated += 1
            seq.last_token = token
            seq.generated.append(token)
            finish = self.finish_reason(seq, token)
            if finish is not None:  # the event goes before the last token: the gateway's terminal event follows it
                del self.running[seq.request_id]
                self.tasks.spawn(self.store_kv(seq), f"store-{seq.request_id}")
                await self.events.request("decode_finished", seq.request_id, tokens=seq.num_generated,
                                          seconds=round(time.perf_counter() - seq.started, 6), finish_reason=finish)
            chunk = TokenChunk(seq.request_id, index, [token], finish_reason=finish, source=self.cfg.instance_id)
            await self.nc.publish(seq.task.reply_subject, chunk.to_bytes())

    async def store_kv(self, seq: Sequence) -> None:
        """Keep the prompt's and the completion's KV in the node's pool, so the next turn hits."""
        # the cache holds every token but the last one sampled (it was never fed back)
        tokens = seq.task.prompt_token_ids + seq.generated[:-1]
        try:
            kv = await asyncio.to_thread(engine.kv_from_cache, seq.cache)
            await self.pool.store(seq.request_id, tokens, kv)
        except PoolUnavailable as exc:
            log.warning("request %s: KV not stored: %s", seq.request_id, exc)

    def step(self, batch: list[Sequence]) -> list[int]:
        """One iteration over the running set (runs in a worker thread)."""
        out = []
        for seq in batch:
            logits = engine.decode_step(self.model, seq.last_token, seq.cache)
            out.append(sampling.sample(logits, seq.task.sampling, step=seq.num_generated))
        return out

    def finish_reason(self, seq: Sequence, token: int) -> str | None:
        if token == self.eos_token_id and not seq.task.sampling.ignore_eos:
            return "stop"
        if seq.num_generated >= seq.task.sampling.max_tokens:
            return "length"
        if len(seq.task.prompt_token_ids) + seq.num_generated >= self.max_context:
            return "length"
        return None

    async def heartbeat(self) -> None:
        info = WorkerInfo(self.cfg.instance_id, "decode", self.cfg.node, self.cfg.model,
                          num_queued=self.waiting.qsize(), num_running=len(self.running))
        await self.nc.publish(subjects.WORKER_HEARTBEAT, info.to_bytes())


async def serve(cfg: DecodeConfig, stop: asyncio.Event) -> None:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    ref = models.prepare(cfg.model, cfg.home)
    model = await asyncio.to_thread(models.load_model, ref)
    eos = model.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    shape = models.read_shape(ref)
    nc = await bus.connect(cfg.nats_url, cfg.instance_id)
    tasks = runner.TaskGroup(stop)
    perf, source = profiles.load(cfg.home, cfg.model, cfg.profile)
    log.info("decode %s: late TBT check %s (slo %gs), profile %s", cfg.instance_id,
             "on" if cfg.late_check else "off", cfg.tbt_slo_s, source)
    service = DecodeService(cfg, nc, model, eos, shape.max_context, shape.kv_layout(cfg.block_tokens), tasks, perf)
    await nc.subscribe(subjects.decode_tasks(cfg.instance_id), cb=service.on_task)
    await nc.subscribe(subjects.REQUEST_CANCEL, cb=service.on_cancel)
    tasks.spawn(service.loop(), "decode-loop")
    tasks.spawn(runner.every(cfg.heartbeat_interval_s, stop, service.heartbeat), "heartbeat")
    await service.events.instance("started", cfg.instance_id, role="decode", node=cfg.node, model=ref.name)
    log.info("decode %s ready on node %s (model %s)", cfg.instance_id, cfg.node, ref.name)
    await stop.wait()
    await nc.publish(subjects.WORKER_HEARTBEAT, WorkerInfo(cfg.instance_id, "decode", cfg.node, leaving=True).to_bytes())
    await tasks.cancel_all()
    await nc.drain()
