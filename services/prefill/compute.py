"""Prefill instance: computes a prompt's KV and first token, then hands the request to decode.

task (NATS) -> its queue (queue.py) -> the decode node reserves the KV's destination (handoff.py) ->
forward pass in a worker thread, each layer's KV written into that destination while the next
layer computes -> first token to the gateway -> completion notice -> DecodeTask to decode.

A task whose predicted work, begun now, would bring its first token past its deadline (the TTFT
SLO it was admitted under: common/decide/admission.py `late_start`) is rejected with a 429 instead
of begun: no prefill is wasted on a first token that would come too late, and the queue behind it
starts sooner.

Faults stay with their request: anything one task throws ends that task with one retryable
error to its gateway (before the first token the gateway re-dispatches it once; after it, a
failed hand-off is resumed like a lost decode instance), and the loop takes the next task. Drain
(first SIGTERM): heartbeats say `draining`, the queue is worked off for up to `drain_grace_s`, and
what is left gets a retryable error.

`compute_lock`: a coupled instance (services/coupled) shares one model between this service and a
DecodeService and passes both the same lock, so a prefill forward and a decode iteration never
run at once: a prefill pauses the decode batch, as in one vLLM instance. Alone, no lock.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import socket
import time

import torch
from nats.aio.msg import Msg

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from common import bus, kvfiles, metrics, runner, sampling, security, worker
from common.cores import ComputeThread
from common.kv.blocks import DEFAULT_SEED, block_keys
from common.pool_client import PoolClient, PoolUnavailable, Prefix
from common.transport import TransportError, Transports
from common.decide.admission import clamp_retry_after, late_start
from common.decide.perf import queue_ends
from schemas import subjects
from schemas.decode import DecodeTask
from schemas.prefill import PrefillTask
from schemas.tokens import Cancel, Probe, ProbeReply, TokenChunk
from schemas.workers import Coming, Layout, Measured, PrefillReport, Progress, WorkerInfo
from services.prefill import pipeline
from services.prefill.config import PrefillConfig
from services.prefill.handoff import Handoff, HandoffFailed
from services.prefill.queue import ArrivalQueue
from common.engine.layerwise import LayerwisePrefill, LayerStreamer

log = logging.getLogger(__name__)


class PrefillMetrics:
    def __init__(self, registry: CollectorRegistry, service: "PrefillService") -> None:
        r = self.registry = registry
        Gauge("moonbus_prefill_queue", "requests queued or running", registry=r).set_function(
            lambda: service.queue.qsize() + service.running)
        Gauge("moonbus_prefill_queue_seconds", "predicted seconds of work ahead", registry=r).set_function(
            lambda: service.report().queue_s)
        self.tokens = Counter("moonbus_prefill_prompt_tokens", "prompt tokens, by how their KV was obtained",
                              ["source"], registry=r)
        self.seconds = Histogram("moonbus_prefill_seconds", "a request's prefill, pull and prefix load included",
                                 buckets=metrics.SLOW_BUCKETS, registry=r)
        self.queue_wait_s = Histogram("moonbus_prefill_queue_wait_seconds", "a task's wait in this instance's queue",
                                      buckets=metrics.SLOW_BUCKETS, registry=r)
        self.over_predicted = Histogram("moonbus_prefill_work_over_predicted", "a request's prefill work (pull and "
                                        "prefix load included) / the conductor's prediction of it (1 = exact)",
                                        buckets=metrics.RATIO_BUCKETS, registry=r)
        self.requests = Counter("moonbus_prefill_requests", "requests by how they left (prefilled, finished, failed, rejected)",
                                ["outcome"], registry=r)


class PrefillService:
    def __init__(self, cfg: PrefillConfig, nc, model, eos_token_id: int | None, layout,
                 compute_lock: asyncio.Lock | None = None, registry: CollectorRegistry | None = None,
                 cores=None, compute: ComputeThread | None = None) -> None:
        self.cfg = cfg
        self.nc = nc
        self.model = model
        self.engine = LayerwisePrefill(model, cfg.prefill_chunk, cores)
        self.compute = compute or ComputeThread()  # the thread prefills run on (common/cores.py)
        self.layout = layout
        self.eos_token_id = eos_token_id
        self.incarnation = worker.new_incarnation()
        self.events = bus.EventPublisher.of(nc, "prefill", cfg, self.incarnation)
        self.pool = PoolClient(nc, cfg.node, layout, f"{cfg.instance_id}:{self.incarnation}")
        self.block_tokens = layout.block_tokens
        # its most urgent request goes to the decode instances that yield to it (common/decide/yielding.py)
        self.queue = ArrivalQueue(cores.waiting if cores is not None else None)
        self.cancelled = worker.Cancellations()
        self.running = 0
        self.metrics = PrefillMetrics(registry or metrics.registry(), self)
        self.current: PrefillTask | None = None
        self.current_started = 0.0  # monotonic
        self.measured: Measured | None = None  # the latest prefill's seconds, for the conductors to learn from
        self.arrived_at = worker.Stamps()  # when each task came: its wait in the queue
        self.queued_s = 0.0  # how long the current task waited in the queue
        self.model_name = cfg.model
        self.cluster_layout: Layout | None = None  # set at start: what the conductors check
        # request_id -> (attempt, its first token chunk) of requests prefilled here lately: a probe
        # finds them (handed off), and a first token lost to a broker outage is sent again
        self.recent: collections.OrderedDict[str, tuple[int, TokenChunk]] = collections.OrderedDict()
        self.draining = False
        self.gone = asyncio.Event()  # heartbeats go on while draining (they say so) and end with leave()
        self.beacon: worker.AliveBeacon | None = None  # liveness from a thread of its own (start())
        self.compute_lock = compute_lock or contextlib.nullcontext()
        self.secret = security.read_secret(cfg.cluster_secret_file)  # peers on the transports prove they hold it
        self.transports = Transports(cfg.transport, self.secret, cfg.transfer_timeout_s, tcp_streams=cfg.tcp_streams,
                                     tcp_stripe_min=cfg.tcp_stripe_min,
                                     tls=security.link_tls(cfg.link_cert, cfg.link_ca),
                                     allow=cfg.link_peers)  # handoffs, pipeline slices
        self.receiver = pipeline.SliceReceiver(self.engine.new_assembly,
                                               self.transports if cfg.pipeline_listener else None)
        self.stream_addr = ""  # host:port of the pipeline KV listener, announced in heartbeats

    async def on_task(self, task: PrefillTask, msg: Msg) -> None:
        if task.pipeline is not None:
            self.receiver.expect(task.request_id, len(task.prompt_token_ids))
        self.arrived_at.put(task.request_id, task.attempt, time.monotonic())
        await self.queue.put(task)
        await self.progress("accepted", task)

    async def work_loop(self) -> None:
        while True:
            task = await self.queue.get()
            if self.cancelled.covers(task.request_id, task.attempt):
                await self.drop_stage(task)
                await self.progress("finished", task)
                continue
            late_s = late_start(time.time(), task.ttft_deadline_ts, task.predicted_s)
            if late_s > 0:
                await self.reject_late(task, late_s)
                continue
            self.running = 1
            self.current = task
            self.current_started = time.monotonic()
            self.queued_s = self.arrived_at.waited(task.request_id, task.attempt, self.current_started)
            self.metrics.queue_wait_s.observe(self.queued_s)
            outcome = "failed"
            try:
                if task.pipeline is not None:
                    outcome = await self.run_stage(task)
                else:
                    outcome = await self.run_task(task)
            except Exception as exc:
                log.exception("request %s: prefill failed", task.request_id)
                await self.fail(task, task.num_generated, f"prefill failed: {exc}",
                                stage="transfer" if transfer_failure(exc) else "")
            finally:
                self.running = 0
                self.current = None
                await self.drop_stage(task)
            if outcome is not None:
                self.metrics.requests.labels(outcome).inc()
                await self.progress(outcome, task)

    async def reject_late(self, task: PrefillTask, late_s: float) -> None:
        """Begun now, its prefill would bring the first token `late_s` past its deadline: rejected
        before any of it is computed, so that the queue behind it starts sooner."""
        rid = task.request_id
        queued_s = self.arrived_at.waited(rid, task.attempt, time.monotonic())
        why = (f"prefill instance {self.cfg.instance_id} would begin it {queued_s:.1f}s after it was queued, and its "
               f"first token would come {late_s:.2f}s past its TTFT SLO")
        log.warning("request %s: rejected late, before its prefill (%s)", rid, why)
        self.metrics.queue_wait_s.observe(queued_s)
        await self.events.request("rejected_late", rid, reason=why, stage="prefill", late_s=round(late_s, 6),
                                  queued_s=round(queued_s, 6), predicted_s=task.predicted_s, wasted_prefill_tokens=0,
                                  attempt=task.attempt)
        await worker.reply(self.nc, task.reply_subject, worker.error_chunk(
            rid, task.attempt, task.num_generated, why, 429, self.cfg.instance_id, False,
            retry_after_s=clamp_retry_after(late_s), stage="prefill"))
        self.metrics.requests.labels("rejected").inc()
        await self.progress("unstarted", task)

    async def drop_stage(self, task: PrefillTask) -> None:
        if task.pipeline is not None:  # its region: waits for peers' writes in flight on it
            await asyncio.to_thread(self.receiver.drop, task.request_id)

    async def progress(self, kind: str, task: PrefillTask) -> None:
        """Tell the conductors (control, not audit), with this instance's load after the change."""
        report = Progress(kind, task.request_id, task.attempt, self.info())
        await bus.publish(self.nc, subjects.control_progress(self.cfg.instance_id), report.to_bytes())

    def report(self) -> PrefillReport:
        """The queue as the conductors should see it: each request's predicted end, in order."""
        now = time.monotonic()
        held = ([self.current] if self.current is not None else []) + self.queue.tasks()
        running_for = now - self.current_started if self.current is not None else None
        ends = queue_ends((task.predicted_s for task in held), running_for)
        ids = [task.request_id for task in held]
        queued_tokens = sum(len(task.prompt_token_ids) for task in held[1 if self.current is not None else 0:])
        coming = [Coming(task.request_id, task.decode_id, round(end, 6), len(task.prompt_token_ids),
                         task.sampling.max_tokens, task.sampling.expected_tokens)
                  for task, end in zip(held, ends)
                  if task.sampling.max_tokens > 1 and (task.pipeline is None or task.stage == task.pipeline.last_stage(
                      len(task.prompt_token_ids)))]  # it will join its decode instance (one stage says so)
        running = len(self.current.prompt_token_ids) if self.current is not None else 0
        return PrefillReport(round(ends[-1] if ends else 0.0, 6), queued_tokens, running, ids, coming, self.measured)

    async def fail(self, task: PrefillTask, index: int, why: str, status: int = 500, stage: str = "") -> None:
        """A retryable error: the gateway re-dispatches (before the first token) or resumes (after).
        `stage` "transfer": the KV could not reach its decode node (not this instance's fault)."""
        await worker.reply(self.nc, task.reply_subject, worker.error_chunk(
            task.request_id, task.attempt, index, why, status, self.cfg.instance_id, retryable=True, stage=stage))

    async def run_task(self, task: PrefillTask) -> str:
        """Prefill, answer the first token, hand off; returns how the request left this instance."""
        rid, ids = task.request_id, task.prompt_token_ids
        started = time.perf_counter()
        # the destination is reserved at the decode node while the prefix loads; each layer's KV
        # goes there while the next layer computes (none for a request that ends at its first token)
        handoff = self.new_handoff(task) if task.sampling.max_tokens > 1 else None
        prefix = await self.prepare(task, handoff)
        cached = prefix.num_blocks * self.block_tokens
        try:
            async with self.compute_lock:
                result = await self.compute.run(self.engine.run, ids, prefix.kv, handoff.sink if handoff else None)
            first = sampling.sample(result.logits, task.sampling, step=task.num_generated)
        except BaseException:
            if handoff is not None:
                await handoff.abort()
            raise
        prefill_s = time.perf_counter() - started
        self.measured = Measured((self.measured.seq if self.measured else 0) + 1, round(prefill_s, 6), len(ids), cached)
        self.metrics.seconds.observe(prefill_s)
        if task.predicted_s > 0:
            self.metrics.over_predicted.observe(prefill_s / task.predicted_s)
        self.metrics.tokens.labels("cached").inc(cached)
        self.metrics.tokens.labels("computed").inc(len(ids) - cached)
        finish = self.finish_reason(first, task)
        going = finish is None and handoff is not None and not self.cancelled.covers(rid, task.attempt)
        # the completion notice goes out while the first token does
        completing = asyncio.ensure_future(handoff.complete()) if going else None
        # NOTE: the event goes first so that the audit log keeps causal order (first_token after it)
        await self.events.request(
            "prefilled", rid, prompt_tokens=len(ids), cached_tokens=cached, computed_tokens=len(ids) - cached,
            seconds=round(prefill_s, 6), decode_id=task.decode_id, finished=finish is not None, attempt=task.attempt,
            queued_s=round(self.queued_s, 6), predicted_s=task.predicted_s,
        )
        await self.reply(task, TokenChunk(rid, task.num_generated, [first], finish_reason=finish, cached_tokens=cached,
                                          source=self.cfg.instance_id, attempt=task.attempt))
        outcome = "finished"
        if completing is not None:
            outcome = await self.hand_off(task, first, handoff, completing, cached, prefill_s, result.computed_at)
        elif handoff is not None:
            await handoff.abort()
        await self.store_prompt(rid, ids, result.kv, prefix.num_blocks, task.key_seed)
        return outcome

    def new_handoff(self, task: PrefillTask) -> Handoff:
        return Handoff(self.nc, self.transports, task, self.cfg.node, self.cfg.shm_dir, self.layout,
                       f"{self.cfg.instance_id}:{self.incarnation}", self.cfg.transfer_timeout_s,
                       cancelled=lambda: self.cancelled.covers(task.request_id, task.attempt))

    async def prepare(self, task: PrefillTask, handoff: Handoff | None) -> Prefix:
        """The reusable prefix and the handoff's destination, at once. A destination that cannot be
        reserved fails the task before its first token (the gateway dispatches it again)."""
        if handoff is None:
            return await self.reusable_prefix(task)
        prefix, opened = await asyncio.gather(self.reusable_prefix(task), handoff.open(), return_exceptions=True)
        if isinstance(opened, BaseException):
            await handoff.abort()
            raise opened
        if isinstance(prefix, BaseException):
            await handoff.abort()
            raise prefix
        return prefix

    async def run_stage(self, task: PrefillTask) -> str | None:
        """One stage of a pipelined prefill (pipeline.py); no cached prefix is used.
        Returns how the request left (None from a stage that does not hand off: the last one will)."""
        rid, ids, spec = task.request_id, task.prompt_token_ids, task.pipeline
        started = time.perf_counter()
        kv = self.receiver.assembly(rid, len(ids))
        chunks = pipeline.my_chunks(len(ids), spec.chunk_tokens, task.stage, len(spec.stages))
        last = task.stage == pipeline.last_stage(len(ids), spec.chunk_tokens, len(spec.stages))
        handoff = self.new_handoff(task) if last and task.sampling.max_tokens > 1 else None
        sink = await asyncio.to_thread(pipeline.PeerSink, rid, len(ids), spec, task.stage, self.transports,
                                       self.cfg.transfer_timeout_s, tuple(kv.kv.shape), kv.kv.element_size())
        try:
            if handoff is not None:
                await handoff.open()
            streamer = LayerStreamer(sink)
            work = asyncio.ensure_future(self.compute.run(self.compute_stage, ids, chunks, kv, streamer))
            try:
                logits = await asyncio.wait_for(asyncio.shield(work), self.cfg.transfer_timeout_s)
            except asyncio.TimeoutError:
                kv.fail(TimeoutError(f"pipeline stage {task.stage}: no KV from the other stages in time"))
                await work  # raises PrefillAborted from the waiting layer
            await self.events.request("prefill_stage", rid, stage=task.stage, stages=spec.stages,
                                      chunks=[list(c) for c in chunks], seconds=round(time.perf_counter() - started, 6))
            if not last:
                return None
            full = await asyncio.to_thread(kv.wait_all, self.cfg.transfer_timeout_s)
            if handoff is not None:  # the whole KV, a layer per write (the other stages' slices are here)
                await asyncio.to_thread(handoff.write_all, full)
        except BaseException:
            sink.close()
            if handoff is not None:
                await handoff.abort()
            raise
        computed_at = time.perf_counter()
        first = sampling.sample(logits, task.sampling, step=task.num_generated)
        prefill_s = time.perf_counter() - started
        finish = self.finish_reason(first, task)
        going = finish is None and handoff is not None and not self.cancelled.covers(rid, task.attempt)
        completing = asyncio.ensure_future(handoff.complete()) if going else None
        await self.events.request("prefilled", rid, prompt_tokens=len(ids), cached_tokens=0, computed_tokens=len(ids),
                                  seconds=round(prefill_s, 6), decode_id=task.decode_id, finished=finish is not None,
                                  pipeline=spec.stages, attempt=task.attempt)
        await self.reply(task, TokenChunk(rid, task.num_generated, [first], finish_reason=finish,
                                          source=self.cfg.instance_id, attempt=task.attempt))
        outcome = "finished"
        if completing is not None:
            outcome = await self.hand_off(task, first, handoff, completing, 0, prefill_s, computed_at)
        elif handoff is not None:
            await handoff.abort()
        await self.store_prompt(rid, ids, full, 0, task.key_seed)
        return outcome

    def compute_stage(self, ids: list[int], chunks: list[tuple[int, int]], kv, streamer) -> torch.Tensor:
        """This stage's chunks, in order, each layer waiting for the chunks before it (worker thread)."""
        logits = None
        try:
            with torch.inference_mode():
                for start, end in chunks:
                    logits = self.engine.compute_chunk(ids, start, end, kv, streamer)
        finally:
            streamer.close()
        return logits

    async def reusable_prefix(self, task: PrefillTask) -> Prefix:
        """Pull what the conductor asked for, then load the longest prefix held on this node."""
        rid = task.request_id
        # reusable blocks must leave at least one prompt token to compute (it yields the logits)
        keys = block_keys(task.prompt_token_ids[:-1], self.block_tokens, task.key_seed or DEFAULT_SEED)
        try:
            if task.pull is not None and task.pull.num_blocks > 0:
                spec = task.pull
                wanted = keys[spec.first_block: spec.first_block + spec.num_blocks]
                reply = await self.pool.pull(rid, spec.source_node, wanted, spec.first_block)
                await self.events.request("kv_pulled", rid, source_node=spec.source_node, dest_node=self.cfg.node,
                                          blocks=reply.num_blocks, requested_blocks=len(wanted),
                                          bytes=reply.nbytes, seconds=round(reply.seconds, 6), transport=reply.transport)
            return await self.pool.load_prefix(rid, keys)
        except PoolUnavailable as exc:
            log.warning("request %s: KV pool unavailable, recomputing the whole prompt: %s", rid, exc)
            return Prefix(None, 0)

    async def hand_off(self, task: PrefillTask, first: int, handoff: Handoff, completing: asyncio.Future, cached: int,
                       prefill_s: float, computed_at: float) -> str:
        """Wait for the completion notice and hand the request over ("prefilled"). The first token is
        already out, so a failure here is answered at the next index: the gateway resumes with that
        token ("failed")."""
        rid = task.request_id
        try:
            handle = await completing
        except HandoffFailed as exc:
            log.error("request %s: %s", rid, exc)
            await self.fail(task, task.num_generated + 1, str(exc), 503, stage="transfer")
            return "failed"
        # tail: from the end of the last layer's compute to the decode node holding the whole KV
        tail_s = time.perf_counter() - computed_at
        await self.events.request(
            "kv_transferred", rid, src_node=self.cfg.node, dest_node=task.decode_node, bytes=handoff.nbytes,
            seconds=round(tail_s, 6), tail_s=round(tail_s, 6), transport=handoff.transport, streamed=True,
            attempt=task.attempt,
        )
        decode = DecodeTask(rid, task.prompt_token_ids, first, task.sampling, task.reply_subject, handle,
                            task.arrival_ts, cached, prefill_s, task.attempt, task.num_generated, task.key_seed,
                            tenant=task.tenant)
        if not await bus.publish(self.nc, subjects.decode_tasks(task.decode_id), decode.to_bytes()):
            await self.fail(task, task.num_generated + 1, f"could not hand the request to {task.decode_id}", 503)
            return "failed"
        return "prefilled"

    async def store_prompt(self, rid: str, ids: list[int], kv: torch.Tensor, num_cached: int, seed: int) -> None:
        """Keep the prompt's new full blocks in this node's pool, so later requests reuse them.
        Best effort: the request is already answered, so nothing here may fail it."""
        if len(ids) // self.block_tokens <= num_cached:
            return
        try:
            stored = await self.pool.store(rid, ids, kv, seed)
        except Exception as exc:  # PoolUnavailable, a slab that went away with its messenger, ...
            log.warning("request %s: prompt KV not stored: %r", rid, exc)
            return
        if stored:
            log.debug("request %s: stored %d new blocks", rid, stored)

    def finish_reason(self, token: int, task: PrefillTask) -> str | None:
        if token == self.eos_token_id and not task.sampling.ignore_eos:
            return "stop"
        if task.sampling.max_tokens <= 1:
            return "length"
        return None

    async def reply(self, task: PrefillTask, chunk: TokenChunk) -> None:
        if chunk.token_ids:
            self.recent[task.request_id] = (task.attempt, chunk, task.reply_subject)
            while len(self.recent) > 1000:
                self.recent.popitem(last=False)
        await worker.reply(self.nc, task.reply_subject, chunk)

    async def on_probe(self, probe: Probe, msg: Msg) -> None:
        """Do we hold (or did we just prefill) this attempt? The gateway resumes it elsewhere if not."""
        rid, attempt = probe.request_id, probe.attempt
        reply = ProbeReply(False)
        if self.current is not None and (self.current.request_id, self.current.attempt) == (rid, attempt):
            reply = ProbeReply(True, "prefill")
        elif any((t.request_id, t.attempt) == (rid, attempt) for t in self.queue.tasks()):
            reply = ProbeReply(True, "queued")
        elif rid in self.recent and self.recent[rid][0] == attempt:
            _, chunk, subject = self.recent[rid]
            resent = 0
            if chunk.index >= probe.from_index:  # the first token itself went missing
                await worker.reply(self.nc, subject, chunk)
                resent = len(chunk.token_ids)
            reply = ProbeReply(True, "handed_off", resent)
        await msg.respond(reply.to_bytes())

    def info(self, leaving: bool = False) -> WorkerInfo:
        return WorkerInfo(self.cfg.instance_id, "prefill", self.cfg.node, self.model_name, transfer_addr=self.stream_addr,
                          transport=self.transports.label,
                          num_queued=self.queue.qsize(), num_running=self.running, leaving=leaving,
                          draining=self.draining, incarnation=self.incarnation, layout=self.cluster_layout,
                          prefill=self.report(), sent_at=time.time())

    async def heartbeat(self) -> None:
        await bus.heartbeat(self.nc, self.info())

    async def start(self, tasks: runner.TaskGroup, stop: asyncio.Event, model_name: str) -> None:
        """Subscribe, start the work loop and the heartbeats, announce the instance."""
        cfg = self.cfg
        kvfiles.sweep_outgoing(cfg.shm_dir)  # written by a predecessor that died before sending them
        if cfg.pipeline_listener:  # only a cluster that pipelines long prompts needs the listener open
            self.stream_addr = self.transports.listen(cfg.stream_host, 0, self.advertised_host()).get("tcp", "")
        await bus.receive(self.nc, subjects.prefill_tasks(cfg.instance_id), PrefillTask, self.on_task)
        await bus.receive(self.nc, subjects.REQUEST_CANCEL, Cancel, self.cancelled.on_cancel)
        await self.pool.watch_messenger()
        await bus.receive(self.nc, subjects.worker_probe(cfg.instance_id), Probe, self.on_probe)
        await worker.obey_refusal(self.nc, cfg.instance_id, tasks)
        self.model_name = model_name
        self.cluster_layout = Layout(model_name, cfg.block_tokens, cfg.prefill_chunk, self.layout.signature)
        tasks.spawn(self.work_loop(), f"prefill-work-{cfg.instance_id}")
        tasks.spawn(runner.every(cfg.heartbeat_interval_s, self.gone, self.heartbeat), f"heartbeat-{cfg.instance_id}")
        self.beacon = worker.AliveBeacon(cfg.nats_url, cfg.nats_auth, cfg.instance_id, self.incarnation)
        self.beacon.start()  # liveness from a thread the compute cannot starve
        await self.heartbeat()
        await self.events.instance("started", cfg.instance_id, role="prefill", node=cfg.node, model=model_name,
                                   incarnation=self.incarnation)
        log.info("prefill %s ready on node %s (model %s)", cfg.instance_id, cfg.node, model_name)

    async def drain(self, stop: runner.Stop, grace_s: float) -> None:
        """Work off the queue (route nothing new here); what is left after the grace is re-dispatched."""
        self.draining = True
        await self.heartbeat()
        log.info("prefill %s draining: %d queued, grace %gs", self.cfg.instance_id, self.queue.qsize() + self.running, grace_s)

        async def emptied() -> None:
            while self.queue.qsize() or self.running:
                await asyncio.sleep(0.05)

        if not await runner.wait_or_hard(stop, emptied(), grace_s):
            log.warning("prefill %s: work left after the grace period; re-dispatching it", self.cfg.instance_id)
        await self.hand_back(f"prefill instance {self.cfg.instance_id} is shutting down")

    async def hand_back(self, why: str) -> None:
        while not self.queue.empty():
            task = self.queue.get_nowait()
            await self.fail(task, task.num_generated, why, 503)

    def advertised_host(self) -> str:
        """How other prefill instances reach this one's pipeline listener."""
        if self.cfg.advertise_host:
            return self.cfg.advertise_host
        if self.cfg.stream_host in ("0.0.0.0", "::"):  # e.g. a scaled container: its own address
            return socket.gethostbyname(socket.gethostname())
        return self.cfg.stream_host

    async def leave(self) -> None:
        self.gone.set()
        if self.beacon is not None:
            await asyncio.to_thread(self.beacon.stop)
        await bus.heartbeat(self.nc, self.info(leaving=True))


def transfer_failure(exc: BaseException) -> bool:
    """Did the request fail because its KV could not reach the decode node (a dead or frozen
    messenger there, a broken connection), rather than here?"""
    while exc is not None:
        if isinstance(exc, (HandoffFailed, TransportError)):
            return True
        exc = exc.__cause__
    return False
