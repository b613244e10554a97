"""Decode instance: continuous batching over every request whose KV has arrived.

DecodeTask (NATS) -> the way in (join.py: late TBT re-check, wait for KV room, load the KV on a
thread beside the running steps, join the batch between two steps) -> every iteration ONE
forward for the whole batch (common/engine/batch.py), each request sampled with its own
settings, its token published to its gateway -> finished or cancelled requests leave, and the
KV of finished ones is stored in the node's pool so that the next turn of a conversation hits
(keep.py, which also stores a running request's blocks as they fill).

Faults stay with their request: a KV that cannot be loaded, a row that cannot sample or a
publish that fails ends that request with one error (retryable when the cluster, not the
request, is at fault, so the gateway resumes it elsewhere); a forward that raises fails the rows
of that iteration as retryable; the loop itself goes on.

Drain (first SIGTERM): heartbeats say `draining` so the conductor routes nothing new here; the
requests held (and any still arriving) run to completion for up to `drain_grace_s`; whatever is
left then gets a retryable error, so its gateway resumes it on another decode instance.

`compute_lock`: in a coupled instance (services/coupled) the PrefillService holds the same lock
around its forward, so an iteration waits while a prefill runs (the prefill pauses the batch).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time

from nats.aio.msg import Msg

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from common import bus, kvfiles, metrics, runner, worker
from common.pool_client import PoolClient
from common.cores import ComputeThread, CoreShare
from schemas import subjects
from schemas.decode import DecodeTask
from schemas.tokens import Cancel, Probe, ProbeReply, TokenChunk
from schemas.workers import DecodeReport, Joined, Layout, Measured, Progress, WorkerInfo
from common.decide.learn import Factor
from common.decide.yielding import yield_due, yield_pause
from common.engine.batch import BatchEngine
from services.decode.config import DecodeConfig
from services.decode.join import Joins
from services.decode.keep import KvKeeper, Running

log = logging.getLogger(__name__)

YIELD_POLL_S = 0.01  # while yielding, how often a decode instance looks again whether prefill requests still wait


class DecodeMetrics:
    def __init__(self, registry: CollectorRegistry, service: "DecodeService") -> None:
        r = self.registry = registry
        Gauge("moonbus_decode_batch", "requests in the batch", registry=r).set_function(
            lambda: service.engine.num_running)
        Gauge("moonbus_decode_waiting", "requests whose KV arrived, waiting for room or loading into the batch",
              registry=r).set_function(lambda: service.num_queued)
        Gauge("moonbus_decode_kv_reserved_tokens", "KV tokens reserved by the batch", registry=r).set_function(
            lambda: service.engine.reserved_tokens)
        self.step_s = Histogram("moonbus_decode_step_seconds", "one iteration of the whole batch",
                                buckets=metrics.FAST_BUCKETS + (2.5, 5.0), registry=r)
        self.step_over_predicted = Histogram("moonbus_decode_step_over_predicted", "an iteration (tokens out included) / "
                                             "the instance's prediction of it, the profile at its learned speed "
                                             "(1 = exact)", buckets=metrics.RATIO_BUCKETS, registry=r)
        self.tokens = Counter("moonbus_decode_tokens", "tokens generated", registry=r)
        self.room_wait_s = Histogram("moonbus_decode_room_wait_seconds", "from a request's KV arriving to its join of "
                                     "the batch (waiting for KV room or a free row, then loading)",
                                     buckets=metrics.SLOW_BUCKETS, registry=r)
        self.load_s = Histogram("moonbus_decode_kv_load_seconds", "reading a request's KV into its row buffer (on a "
                                "thread, beside the steps)", buckets=metrics.FAST_BUCKETS + (2.5, 5.0), registry=r)
        self.requests = Counter("moonbus_decode_requests", "requests by how they left (finished, failed)",
                                ["outcome"], registry=r)
        self.yielded_s = Counter("moonbus_decode_yielded_seconds", "time the batch waited between steps, leaving the "
                                 "cores to prefill requests waiting on this machine (common/decide/yielding.py)",
                                 registry=r)


class DecodeService:
    def __init__(self, cfg: DecodeConfig, nc, engine: BatchEngine, eos_token_id: int | None,
                 layout, tasks: runner.TaskGroup, perf, compute_lock: asyncio.Lock | None = None,
                 registry: CollectorRegistry | None = None, compute: ComputeThread | None = None) -> None:
        self.cfg = cfg
        self.compute = compute or ComputeThread()  # the thread the batch steps on (common/cores.py)
        self.nc = nc
        self.engine = engine
        self.eos_token_id = eos_token_id
        self.tasks = tasks
        self.perf = perf
        self.incarnation = worker.new_incarnation()
        self.layout = layout  # KvLayout of the model
        self.model_name = cfg.model
        self.cluster_layout: Layout | None = None  # set at start: what the conductors check
        self.events = bus.EventPublisher.of(nc, "decode", cfg, self.incarnation)
        self.pool = PoolClient(nc, cfg.node, layout, f"{cfg.instance_id}:{self.incarnation}")
        self.joins = Joins(self)  # arrived, waiting for room, loading (join.py)
        self.running: dict[str, Running] = {}  # request_id -> Running
        self.cancelled = worker.Cancellations()
        # a coupled instance's, shared with its prefill; else this instance's own. A step holds it, so
        # that nothing takes a row out of the engine while the step runs in its thread (hand_back)
        self.compute_lock = compute_lock or asyncio.Lock()
        # request_id -> (task, tokens, finish reason) of requests that ended here lately, so a
        # token lost to a broker outage can be sent again when the gateway probes
        self.recent: collections.OrderedDict[str, tuple[DecodeTask, list[int], str]] = collections.OrderedDict()
        self.metrics = DecodeMetrics(registry or metrics.registry(), self)
        self.keeper = KvKeeper(engine, self.pool, tasks, cfg.store_every_blocks, cfg.block_tokens, self.metrics.registry)
        self.draining = False
        self.closed = ""  # why everything held was handed back: what arrives after that goes back too
        self.measured: Measured | None = None  # the latest iteration's seconds, for the conductors to learn from
        self.cycle_from: float | None = None  # when the batch's last iteration ended, while it has rows
        self.step_started: float | None = None  # when the batch's last step began (what a yield counts from)
        self.speed = Factor()  # this instance's own step time against the profile: its late check uses it
        self.arrived_at = worker.Stamps()  # when each task (its KV landed) came: its wait for the batch
        self.wakeup = asyncio.Event()  # set when work arrives
        self.gone = asyncio.Event()  # heartbeats go on while draining (they say so) and end with leave()
        self.beacon: worker.AliveBeacon | None = None  # liveness from a thread of its own (start())

    # --- messages -------------------------------------------------------------------------------
    async def on_task(self, task: DecodeTask, msg: Msg) -> None:
        self.arrived_at.put(task.request_id, task.attempt, time.monotonic())
        await self.joins.arrived.put(task)
        self.wakeup.set()
        await self.progress("accepted", task)

    @property
    def num_held(self) -> int:
        return self.num_queued + len(self.running)

    @property
    def num_queued(self) -> int:
        """Requests held that are not in the batch yet: arrived, waiting for room, or loading."""
        return len(self.joins)

    def queued_tasks(self) -> list[DecodeTask]:
        return self.joins.tasks()

    # --- the loop -----------------------------------------------------------------------------------
    async def loop(self) -> None:
        while True:
            if not self.num_held:
                self.wakeup.clear()
                await self.wakeup.wait()
            await self.joins.check_in_arrived()
            await self.joins.join_loaded()
            await self.joins.admit_waiting()
            await self.drop_cancelled()
            if self.running:
                await self.iterate()
                continue
            self.cycle_from = None  # the batch emptied (finished, cancelled, handed back): the next step starts afresh
            if self.joins.loading:  # nothing to step: wait for a load (or new work)
                self.wakeup.clear()
                if not self.joins.any_loaded:
                    await self.wakeup.wait()
            elif self.joins.waiting:
                await asyncio.sleep(0.01)  # KV room frees only when requests finish: cannot happen here

    async def guarded(self, step, task: DecodeTask) -> None:
        """Run one request's step; anything it throws fails that request alone (retryable)."""
        try:
            await step(task)
        except Exception as exc:
            log.exception("request %s: decode failed", task.request_id)
            self.forget(task.request_id)
            kvfiles.remove(self.cfg.shm_dir, task.kv)
            await self.fail(task, f"decode failed: {exc}", 500, retryable=True)

    async def drop_cancelled(self) -> None:
        for seq in [seq for rid, seq in self.running.items() if self.cancelled.covers(rid, seq.task.attempt)]:
            self.forget(seq.request_id)
            await self.progress("finished", seq.task)
        await self.joins.drop_cancelled()

    def forget(self, request_id: str) -> None:
        self.engine.remove(request_id)
        self.running.pop(request_id, None)
        self.joins.forget(request_id)

    async def iterate(self) -> None:
        # NOTE: an iteration is counted from the end of the one before (while the batch had rows), so
        # that what the loop does between steps (check-ins, joins, cancellations) is in the measured
        # interval: a client waits for it as for the step itself
        await self.yield_to_prefill()
        started = self.cycle_from if self.cycle_from is not None else time.perf_counter()
        try:
            async with self.compute_lock:
                self.step_started = time.perf_counter()
                result = await self.compute.run(self.engine.step)
            if self.engine.last_step is not None:
                self.metrics.step_s.observe(self.engine.last_step.seconds)
            self.metrics.tokens.inc(len(result.tokens))
        except Exception as exc:  # the forward itself: no row got a token, so every row is resumed elsewhere
            log.exception("decode iteration failed; resuming its %d requests elsewhere", len(self.running))
            self.cycle_from = None
            for seq in list(self.running.values()):
                self.forget(seq.request_id)
                await self.fail(seq.task, f"decode iteration failed: {exc}", 500, retryable=True)
            return
        for rid, why in result.errors.items():
            seq = self.running.get(rid)
            if seq is None:  # handed back since the step (a drain's grace ran out): resumed elsewhere
                continue
            log.error("request %s: %s", rid, why)
            self.forget(rid)
            await self.fail(seq.task, f"sampling failed: {why}", 500, retryable=False)
        for rid, token in result.tokens.items():
            seq = self.running.get(rid)
            if seq is None:  # handed back while an earlier row's token went out: resumed elsewhere
                continue
            seq.generated.append(token)
            finish = self.finish_reason(seq, token)
            if finish is not None:  # the event goes before the last token: the gateway's terminal event follows it
                kv = self.engine.kv_of(rid)
                self.forget(rid)
                self.remember(seq, finish)
                await self.progress("finished", seq.task, seq.task.num_generated + len(seq.generated))
                await self.events.request("decode_finished", rid, tokens=len(seq.generated),
                                          seconds=round(time.perf_counter() - seq.started, 6), finish_reason=finish,
                                          attempt=seq.task.attempt)
                self.keeper.store_finished(seq, kv)
            await worker.reply(self.nc, seq.task.reply_subject,
                               TokenChunk(rid, seq.index_of_last(), [token], finish_reason=finish,
                                          source=self.cfg.instance_id, attempt=seq.task.attempt))
        self.keeper.store_progress(self.running)
        self.cycle_from = time.perf_counter() if self.running else None
        step = self.engine.last_step
        if step is not None:  # the whole iteration, tokens out included: what a client waits between tokens
            self.measured = Measured((self.measured.seq if self.measured else 0) + 1,
                                     round(time.perf_counter() - started, 6), step.context_tokens, batch=step.batch)
            predicted = self.perf.decode.step_seconds(step.batch, step.context_tokens)
            if predicted > 0:  # against what this instance predicts: the profile at its learned speed
                self.metrics.step_over_predicted.observe(self.measured.seconds / (predicted * self.speed.value))
            self.speed.observe(predicted, self.measured.seconds)

    async def yield_to_prefill(self) -> None:
        """Wait before the next step while a request waiting in a prefill queue on this machine has
        waited long enough and the batch's TBT has room (common/decide/yielding.py); the wait is not
        the step's: the iteration measured for the conductors (and this instance's speed) starts
        after it."""
        cores = self.engine.cores
        if cores is None or self.cfg.yield_tbt <= 0 or self.cycle_from is None:
            return
        began = time.perf_counter()
        while (pause := yield_pause(time.perf_counter(), self.step_started, self.yield_called(cores),
                                    self.cfg.tbt_slo_s, self.cfg.yield_tbt,
                                    self.engine.reserved_tokens / self.engine.kv_budget_tokens)) > 0:
            await asyncio.sleep(min(pause, YIELD_POLL_S))
        waited = time.perf_counter() - began
        if waited > YIELD_POLL_S / 10:
            self.metrics.yielded_s.inc(waited)
            self.cycle_from = time.perf_counter()

    def yield_called(self, cores: CoreShare) -> bool:
        due = yield_due(cores.prefill_urgent(), self.cfg.yield_after)
        return due is not None and due <= time.time()

    def remember(self, seq: Running, finish: str, keep: int = 1000) -> None:
        self.recent[seq.request_id] = (seq.task, seq.generated, finish)
        while len(self.recent) > keep:
            self.recent.popitem(last=False)

    async def on_probe(self, probe: Probe, msg: Msg) -> None:
        """Do we hold this attempt? If so, send its tokens from `from_index` again (they may have
        been lost while the broker was away); the gateway resumes the request elsewhere if not."""
        reply = ProbeReply(False)
        seq = self.running.get(probe.request_id)
        if seq is not None and seq.task.attempt == probe.attempt:
            reply = ProbeReply(True, "decode", await self.resend(seq.task, seq.generated, None, probe.from_index))
        elif probe.request_id in self.recent and self.recent[probe.request_id][0].attempt == probe.attempt:
            task, tokens, finish = self.recent[probe.request_id]
            reply = ProbeReply(True, "finished", await self.resend(task, tokens, finish, probe.from_index))
        elif any(t.request_id == probe.request_id and t.attempt == probe.attempt for t in self.queued_tasks()):
            reply = ProbeReply(True, "queued")
        await msg.respond(reply.to_bytes())

    async def resend(self, task: DecodeTask, tokens: list[int], finish: str | None, from_index: int) -> int:
        skip = from_index - task.num_generated
        if skip < 0 or skip >= len(tokens):
            return 0
        await worker.reply(self.nc, task.reply_subject, TokenChunk(
            task.request_id, from_index, tokens[skip:], finish_reason=finish, source=self.cfg.instance_id,
            attempt=task.attempt))
        return len(tokens) - skip

    def finish_reason(self, seq: Running, token: int) -> str | None:
        if token == self.eos_token_id and not seq.task.sampling.ignore_eos:
            return "stop"
        if len(seq.generated) >= seq.task.sampling.max_tokens:
            return "length"
        if len(seq.task.prompt_token_ids) + len(seq.generated) >= self.engine.max_context:
            return "length"
        return None

    async def fail(self, task: DecodeTask, why: str, status: int, retryable: bool) -> None:
        await worker.reply(self.nc, task.reply_subject, worker.error_chunk(
            task.request_id, task.attempt, task.num_generated + 1, why, status, self.cfg.instance_id, retryable))
        await self.progress("failed", task)

    async def progress(self, kind: str, task: DecodeTask, generated: int = 0) -> None:
        """Tell the conductors (control, not audit), with this instance's load after the change;
        a request that finished says how many tokens it generated."""
        if kind != "accepted":
            self.metrics.requests.labels(kind).inc()
        report = Progress(kind, task.request_id, task.attempt, self.info(), generated)
        await bus.publish(self.nc, subjects.control_progress(self.cfg.instance_id), report.to_bytes())

    def report(self) -> DecodeReport:
        """The batch and the requests waiting for it, as the conductors should see them."""
        now = time.perf_counter()
        engine = self.engine
        joined = [Joined(rid, round(now - seq.started, 6), int(engine.kv_lens[engine.index[rid]]), len(seq.generated),
                         seq.task.sampling.max_tokens, seq.task.sampling.expected_tokens)
                  for rid, seq in self.running.items() if rid in engine.index]
        joined += [Joined(t.request_id, 0.0, len(t.prompt_token_ids), 1, t.sampling.max_tokens, t.sampling.expected_tokens)
                   for t in self.queued_tasks()]
        context = engine.context_tokens
        tbt = self.perf.decode.step_seconds(max(1, engine.num_running), context) * self.speed.value
        return DecodeReport(engine.num_running, context, engine.reserved_tokens,
                            engine.kv_budget_tokens - engine.reserved_tokens, round(tbt, 6), joined, self.measured,
                            engine.kv_cache_bytes)

    async def reject_late(self, task: DecodeTask, why: str) -> None:
        rid = task.request_id
        kvfiles.remove(self.cfg.shm_dir, task.kv)
        wasted = len(task.prompt_token_ids) - task.cached_tokens
        log.warning("request %s: rejected late (%s); %d prefill tokens wasted", rid, why, wasted)
        await self.events.request("rejected_late", rid, reason=why, running=self.engine.num_running,
                                  tbt_slo_s=self.cfg.tbt_slo_s, wasted_prefill_tokens=wasted,
                                  wasted_prefill_s=round(task.prefill_s, 6), attempt=task.attempt)
        await worker.reply(self.nc, task.reply_subject, worker.error_chunk(
            rid, task.attempt, task.num_generated + 1, why, 429, self.cfg.instance_id, False, retry_after_s=1.0,
            stage="decode", wasted_prefill_tokens=wasted, wasted_prefill_s=task.prefill_s))
        await self.progress("failed", task)

    async def sweep_orphans(self) -> None:
        """Files landed for us whose task never came (lost while the broker was away): the request
        was resumed elsewhere, so nothing will ever read them."""
        held = {t.kv.name for t in self.queued_tasks()}
        removed = kvfiles.sweep_incoming(self.cfg.shm_dir, self.cfg.instance_id, self.cfg.orphan_kv_s, held)
        if removed:
            log.warning("removed %d landed KV files whose task never arrived", removed)

    # --- presence and drain ---------------------------------------------------------------------------
    def info(self, leaving: bool = False) -> WorkerInfo:
        return WorkerInfo(self.cfg.instance_id, "decode", self.cfg.node, self.model_name,
                          num_queued=self.num_queued, num_running=self.engine.num_running,
                          leaving=leaving, draining=self.draining, incarnation=self.incarnation,
                          layout=self.cluster_layout, decode=self.report(), sent_at=time.time())

    async def heartbeat(self) -> None:
        await bus.heartbeat(self.nc, self.info())

    async def start(self, stop: asyncio.Event, model_name: str, profile_source: str) -> None:
        """Subscribe, start the batch loop and the heartbeats, announce the instance."""
        cfg = self.cfg
        kvfiles.sweep_incoming(cfg.shm_dir, cfg.instance_id)  # landed for a predecessor that died before reading them
        await bus.receive(self.nc, subjects.decode_tasks(cfg.instance_id), DecodeTask, self.on_task)
        await bus.receive(self.nc, subjects.REQUEST_CANCEL, Cancel, self.cancelled.on_cancel)
        await self.pool.watch_messenger()
        await bus.receive(self.nc, subjects.worker_probe(cfg.instance_id), Probe, self.on_probe)
        await worker.obey_refusal(self.nc, cfg.instance_id, self.tasks)
        self.model_name = model_name
        self.cluster_layout = Layout(model_name, cfg.block_tokens, 0, self.layout.signature)
        self.tasks.spawn(self.loop(), f"decode-loop-{cfg.instance_id}")
        self.tasks.spawn(runner.every(cfg.heartbeat_interval_s, self.gone, self.heartbeat), f"heartbeat-{cfg.instance_id}")
        self.beacon = worker.AliveBeacon(cfg.nats_url, cfg.nats_auth, cfg.instance_id, self.incarnation)
        self.beacon.start()  # liveness from a thread the compute cannot starve
        self.tasks.spawn(runner.every(10.0, self.gone, self.sweep_orphans), f"orphans-{cfg.instance_id}")
        await self.heartbeat()
        await self.events.instance("started", cfg.instance_id, role="decode", node=cfg.node, model=model_name,
                                   incarnation=self.incarnation)
        log.info("decode %s ready on node %s (model %s): batch <= %d, KV %.2f GiB (%d tokens), attention %s, "
                 "late TBT check %s (slo %gs), profile %s", cfg.instance_id, cfg.node, model_name, cfg.max_batch,
                 self.engine.kv_cache_bytes / (1 << 30), self.engine.kv_budget_tokens, self.engine.attention,
                 "on" if cfg.late_check else "off", cfg.tbt_slo_s, profile_source)

    async def drain(self, stop: runner.Stop, grace_s: float) -> None:
        """Finish what is held (route nothing new here), then resume the rest elsewhere."""
        self.draining = True
        await self.heartbeat()
        log.info("decode %s draining: %d requests held, grace %gs", self.cfg.instance_id, self.num_held, grace_s)

        async def emptied() -> None:
            while self.num_held:
                await asyncio.sleep(0.05)

        if not await runner.wait_or_hard(stop, emptied(), grace_s):
            log.warning("decode %s: %d requests left after the grace period; resuming them elsewhere",
                        self.cfg.instance_id, self.num_held)
        await self.hand_back("decode instance %s is shutting down" % self.cfg.instance_id)

    async def hand_back(self, why: str) -> None:
        """Every request still held gets a retryable error: its gateway resumes it elsewhere.

        Not while a step runs: its rows are the engine's until it returns (the lock), and what the
        loop finishes meanwhile is not handed back. Taken out of the batch in one go (no await in
        between), so the loop sees each request either still held or gone; a load under way
        finishes unseen. Final: a task that arrives later is handed back as it checks in."""
        async with self.compute_lock:
            self.closed = why
            held = [seq.task for seq in self.running.values()] + self.queued_tasks()
            for task in held:
                self.forget(task.request_id)
            self.joins.clear()
        for task in held:
            kvfiles.remove(self.cfg.shm_dir, task.kv)
            await self.fail(task, why, 503, retryable=True)

    async def leave(self) -> None:
        self.gone.set()
        if self.beacon is not None:
            await asyncio.to_thread(self.beacon.stop)
        await bus.heartbeat(self.nc, self.info(leaving=True))


