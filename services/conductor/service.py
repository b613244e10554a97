"""Conductor: the global scheduler. Routes each request to a (prefill, decode) pair.

Per route request: the prompt's block keys -> the pure route (common/decide/route.py, the one
the simulator and the conductor bench run too): who holds how long a prefix (this conductor's
own copy of the prefix index, followed from the KV events by common/index_follow.py; or, with
`--prefix-index remote`, a query to the cache index), a snapshot of every instance (queued
prefill seconds, decode batches, bytes being pulled from each node), the policy
(common/decide/policy.py), admission (common/decide/admission.py) and the booking of an
admitted request -> a PrefillTask (with a pull plan when the chosen instance should fetch a
remote prefix) and a `routed` event carrying every candidate and cost term.
The load comes from the instances themselves (common/decide/cluster_state.py): heartbeats every
~150 ms and a progress message at each change of state carry what each holds, and this
conductor adds only its own dispatches that have not arrived yet, so any number of conductors
see the same load. Nothing steers by the audit stream, which is write-only here. Heartbeats also
tell who is alive (a `draining` instance gets nothing new) and whether it agrees with the
cluster's model, block size, chunk and KV layout (one that does not is refused). When an instance's heartbeats stop or it leaves, every
request it held gets a retryable TokenChunk error, so its gateway resumes it elsewhere and no
client hangs. While the conductor's own broker connection is down, nobody is declared lost: the
silence is the conductor's, not the instances'. With `--planner`, a loop decides how many prefill
and decode instances the load needs and publishes it for a driver (planner_loop.py).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import random
import time
from typing import Callable

import msgspec
from nats.aio.msg import Msg
from nats.errors import NoRespondersError, TimeoutError as NatsTimeout

from prometheus_client import Counter, Gauge, Histogram

from common import bus, health, metrics, models, profiles, runner, worker
from common.index_follow import IndexFollower, Resynced
from common.kv.blocks import DEFAULT_SEED, block_keys
from common.decide.perf import Profile
from schemas import subjects
from schemas.codec import WireError
from schemas.events import Event
from schemas.index import IndexQuery, IndexReply
from schemas.prefill import PipelineSpec, PrefillTask, PullSpec
from schemas.route import RouteReply, RouteRequest
from schemas.tokens import Cancel
from schemas.workers import Alive, Exited, Layout, Progress, Refused, StatusReply, WorkerInfo
from common.decide import admission, policy
from common.decide import route as routing
from services.conductor.config import ConductorConfig
from services.conductor.planner_loop import PlannerLoop
from common.decide.cluster_state import UNHELD_S, ClusterState, Refusal

log = logging.getLogger(__name__)

SPOOF_AUDIT_S = 60.0  # a spoofing subject's claim is audited at most this often
POLICY_VERSION = "moonbus-conductor/1"
HEAR_FIRST_S = 1.0  # a starting conductor waits at most this long to hear the workers before it routes
GC_YOUNG_THRESHOLD = 20_000  # tracked allocations between young collections (Python's default: 700)


class ConductorMetrics:
    def __init__(self, follower: IndexFollower | None = None) -> None:
        self.registry = metrics.registry()
        r = self.registry
        self.decisions = Counter("moonbus_conductor_decisions", "route decisions by outcome "
                                 "(admitted, rejected, unavailable, expired, malformed, error)", ["outcome"], registry=r)
        self.decide_s = Histogram("moonbus_conductor_decision_seconds", "the pure decision: snapshot, policy, admission",
                                  buckets=metrics.FAST_BUCKETS, registry=r)
        self.route_s = Histogram("moonbus_conductor_route_seconds", "a route request end to end at the conductor "
                                 "(hashing, the prefix lookup, the decision, dispatch)",
                                 buckets=metrics.FAST_BUCKETS, registry=r)
        self.prefill_queue = Gauge("moonbus_conductor_prefill_queue_seconds", "predicted queued prefill work",
                                   ["instance"], registry=r)
        self.decode_load = Gauge("moonbus_conductor_decode_requests", "requests held by or coming to a decode instance",
                                 ["instance"], registry=r)
        self.in_flight = Gauge("moonbus_conductor_in_flight", "requests this conductor routed that have not ended",
                               registry=r)
        self.instances = Gauge("moonbus_conductor_instances", "live instances by role", ["role"], registry=r)
        self.learned = Gauge("moonbus_conductor_learned_factor", "what an instance really takes against the profile's "
                             "prediction (prefill: a prompt; step: a decode iteration), learned from its measured work",
                             ["instance", "kind"], registry=r)
        self.spoofed = Counter("moonbus_conductor_spoofed", "reports ignored because they speak for an instance their "
                               "subject (their sender's own credentials) does not name", ["kind"], registry=r)
        self.ttft_margin = Gauge("moonbus_conductor_ttft_margin", "what predictive admission multiplies a predicted "
                                 "TTFT by: how much later than predicted first tokens came, near the SLO", registry=r)
        self.threshold = Gauge("moonbus_conductor_balancing_threshold", "the kvcache-centric policy's balancing "
                               "threshold as learned from pulls' TTFT against recomputes'", registry=r)
        if follower is not None:  # --prefix-index local: this conductor's own copy of the index
            index = follower.index
            Gauge("moonbus_conductor_index_holdings", "(block, node) pairs in this conductor's copy of the prefix "
                  "index", registry=r).set_function(index.num_holdings)
            Gauge("moonbus_conductor_index_nodes", "nodes synced into this conductor's copy of the prefix index",
                  registry=r).set_function(lambda: len(index.nodes))
            self.index_resyncs = Counter("moonbus_conductor_index_resyncs", "nodes reloaded from their messenger's "
                                         "snapshot into this conductor's index", ["reason"], registry=r)


class ConductorService:
    def __init__(self, cfg: ConductorConfig, nc, tasks: runner.TaskGroup, perf: Profile, kv_bytes_per_token: int,
                 layout: Layout | None = None) -> None:
        self.cfg = cfg
        self.nc = nc
        self.perf = perf
        self.events = bus.EventPublisher.of(nc, "conductor", cfg)
        self.state = ClusterState(cfg.heartbeat_timeout_s, cfg.lease_s, layout, perf, cfg.kvcache_balancing_threshold,
                                  cfg.admission)
        # NOTE: no `resynced` audit events from here: the cache index writes them, once per cluster
        self.follower = IndexFollower(nc, tasks, cfg.index_resync_timeout_s, cfg.index_node_timeout_s,
                                      on_resynced=self.index_resynced) if cfg.prefix_index == "local" else None
        self.metrics = ConductorMetrics(self.follower)
        self.refused: set[str] = set()  # instance ids told so, not to repeat it every heartbeat
        self.spoofs_audited: dict[tuple[str, str], float] = {}  # (subject, claimed id) -> when last audited
        self.settings = policy.PolicySettings(cfg.policy, cfg.kvcache_balancing_threshold, cfg.link_bytes_s,
                                              cfg.block_tokens, kv_bytes_per_token, cfg.colocate,
                                              tbt_slo_s=cfg.admission.tbt_slo_s)
        self.rng = random.Random()
        self.outcome_counts: dict[str, Counter] = {}  # the route counter's child per outcome (count)
        self.offline = False  # the broker connection was down at the last sweep
        self.planner = PlannerLoop(cfg.planner, self.state, perf, cfg.admission, self.events, cfg.instance_id,
                                   self.metrics.registry) if cfg.planner is not None else None

    async def on_heartbeat(self, info: WorkerInfo, msg: Msg) -> None:
        if not subjects.speaks_for(msg.subject, info.role, info.instance_id):
            return await self.spoof("heartbeat", msg.subject, info.instance_id)
        if await self.heard(info) == "spoofed":
            return
        if self.follower is not None:
            self.follower.heard(info)  # a messenger's: its node is synced into the local index

    async def index_resynced(self, done: Resynced) -> None:
        self.metrics.index_resyncs.labels(done.kind).inc()

    async def on_progress(self, progress: Progress, msg: Msg) -> None:
        """A request changed state at an instance: its report, and the change itself."""
        if not subjects.speaks_for(msg.subject, progress.info.instance_id):
            return await self.spoof("progress", msg.subject, progress.info.instance_id)
        await self.heard(progress.info)
        if progress.kind == "prefilled":
            if self.planner is not None:
                self.planner.prefilled(self.state.routed.get(progress.request_id), progress.attempt, time.monotonic())
            self.state.prefilled(progress.request_id, progress.attempt, time.monotonic())
        elif progress.kind == "unstarted":
            if self.planner is not None:
                self.planner.unstarted()
            self.state.unstarted(progress.request_id, progress.attempt, time.monotonic())
        elif progress.kind in ("finished", "failed"):  # it left the cluster (from decode, or ended at prefill)
            self.state.end(progress.request_id, up_to_attempt=progress.attempt)
            if progress.kind == "finished" and progress.generated:
                self.state.completed(progress.generated)

    async def on_alive(self, alive: Alive, msg: Msg) -> None:
        """A worker's liveness beacon: busy is not dead (its reports may come late under load)."""
        if not subjects.speaks_for(msg.subject, alive.instance_id):
            return await self.spoof("alive", msg.subject, alive.instance_id)
        self.state.alive(alive.instance_id, alive.incarnation, time.monotonic())

    async def on_exited(self, exited: Exited, msg: Msg) -> None:
        """A supervisor saw the process exit: its requests are handed back now, not after a timeout."""
        for info in self.state.dead(exited.instance_id, time.monotonic()):
            log.warning("instance %s (%s) exited (code %d)", info.instance_id, info.role, exited.exit_code)
            self.lost(info.role)
            await self.events.instance("lost", info.instance_id, role=info.role, node=info.node, reason="exited",
                                       exit_code=exited.exit_code)
            await self.fail_requests_of(info.instance_id, "exited")

    def lost(self, role: str) -> None:
        """An instance died: the planner holds its role's target (a death is not load)."""
        if self.planner is not None:
            self.planner.lost(role)

    async def plan(self) -> None:
        if self.planner is not None and self.nc.is_connected:
            await self.planner.tick()

    async def spoof(self, kind: str, subject: str, claimed: str) -> None:
        """A report that speaks for another instance than the one whose subject it came on: ignored,
        counted, and audited (once a minute per subject and claim: a flood writes no flood)."""
        self.metrics.spoofed.labels(kind).inc()
        now = time.monotonic()
        if now - self.spoofs_audited.get((subject, claimed), -SPOOF_AUDIT_S) < SPOOF_AUDIT_S:
            return
        if len(self.spoofs_audited) > 10_000:
            self.spoofs_audited.clear()
        self.spoofs_audited[(subject, claimed)] = now
        log.warning("ignoring a %s on %s that claims to be instance %s", kind, subject, claimed)
        await self.events.instance("spoofed", claimed, kind=kind, subject=subject)

    async def heard(self, info: WorkerInfo) -> str | Refusal | None:
        outcome = self.state.heard(info, time.monotonic())
        if outcome == "spoofed":  # a messenger speaking for a node another messenger holds
            await self.spoof("node", f"node {info.node}, held by {self.state.node_holders.holder(info.node)}",
                             info.instance_id)
        elif isinstance(outcome, Refusal):
            await self.refuse(outcome)
        elif outcome == "joined":
            self.refused.discard(info.instance_id)
            log.info("instance %s joined (%s on node %s)", info.instance_id, info.role, info.node)
            await self.events.instance("joined", info.instance_id, role=info.role, node=info.node)
        elif outcome == "restarted":  # its predecessor died: whatever it held went with it
            log.warning("instance %s restarted (a new process); handing back what the old one held", info.instance_id)
            self.lost(info.role)
            await self.events.instance("lost", info.instance_id, role=info.role, node=info.node, reason="restarted")
            await self.fail_requests_of(info.instance_id, "restarted")
        elif outcome == "left":
            log.info("instance %s left", info.instance_id)
            await self.events.instance("left", info.instance_id, role=info.role, node=info.node)
            await self.fail_requests_of(info.instance_id, "left")
        return outcome

    async def refuse(self, refusal: Refusal) -> None:
        info = refusal.info
        if info.instance_id in self.refused:
            return
        self.refused.add(info.instance_id)
        reason = "it disagrees with the cluster: " + "; ".join(refusal.differences)
        log.error("refusing instance %s (%s on node %s): %s", info.instance_id, info.role, info.node, reason)
        await self.events.instance("refused", info.instance_id, role=info.role, node=info.node, reason=reason)
        await bus.publish(self.nc, subjects.control_refused(info.instance_id),
                          Refused(info.instance_id, reason).to_bytes())

    async def hear_the_cluster(self, stop: asyncio.Event, limit_s: float) -> None:
        """Until a prefill and a decode instance have reported (or `limit_s` passed): a conductor
        that took routes the moment it started (a restart, a replica added) would find nobody and
        answer 503 for a cluster that is there. Meanwhile the gateways ask again (no responders)."""
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline and not stop.is_set():
            if self.state.of_role("prefill") and self.state.of_role("decode"):
                return
            await asyncio.sleep(0.05)

    async def on_route(self, msg: Msg) -> None:
        started = time.perf_counter()
        events: list[tuple[str, str, Callable[[], dict]]] = []  # the route's events, queued once its reply is out
        try:
            request = RouteRequest.from_bytes(msg.data)
        except ValueError as exc:
            reply = RouteReply(False, 400, f"malformed route request: {exc}")
            self.count("malformed")
        else:
            try:
                reply = await self.route(request, events)
            except Exception as exc:  # answered, never a hang
                log.exception("request %s: routing failed", request.request_id)
                reply = RouteReply(False, 500, f"routing failed: {exc}")
                self.count("error")
            self.metrics.route_s.observe(time.perf_counter() - started)
        if msg.reply:
            await bus.publish(self.nc, msg.reply, reply.to_bytes())
        if events:
            # NOTE: after the flusher, which the reply's publish woke first: the reply (and the
            # prefill task) are written before the event is built and sealed (JSON, HMAC)
            asyncio.get_running_loop().call_soon(self.queue_events, events)

    def queue_events(self, events: list[tuple[str, str, Callable[[], dict]]]) -> None:
        for kind, request_id, data in events:
            self.events.queue_request(kind, request_id, data())

    async def event(self, later: list | None, kind: str, request_id: str, data: Callable[[], dict]) -> None:
        """A request event: queued now, or (`later`, a route's list) once the route's reply is out."""
        if later is None:
            await self.events.request(kind, request_id, **data())
        else:
            later.append((kind, request_id, data))

    def count(self, outcome: str) -> None:
        """One more route decided with `outcome` (its counter's child kept: labels() takes a lock and a lookup)."""
        child = self.outcome_counts.get(outcome)
        if child is None:
            child = self.outcome_counts[outcome] = self.metrics.decisions.labels(outcome)
        child.inc()

    async def on_cancel(self, cancel: Cancel, msg: Msg) -> None:
        """The gateway gave up on attempts of a request (client gone, resumed elsewhere): their load ends."""
        self.state.end(cancel.request_id, up_to_attempt=cancel.attempt)

    async def route(self, request: RouteRequest, later: list | None = None) -> RouteReply:
        """The pure route (common/decide/route.py) of a request, its `routed` event, and its dispatch.
        `later`: a list the request's events go to, to be queued once the reply is out (on_route);
        None: queued at once."""
        rid, ids = request.request_id, request.prompt_token_ids
        if request.deadline_ts and time.time() > request.deadline_ts:  # the gateway stopped waiting: not dispatched
            log.warning("request %s: route request arrived after its gateway gave up; dropped", rid)
            self.count("expired")
            return RouteReply(False, 503, "the route request expired before it was served", retry_after_s=1.0)
        # the blocks a prefill instance could reuse: all full blocks but the prompt's last token
        keys = block_keys(ids[:-1], self.cfg.block_tokens, request.key_seed or DEFAULT_SEED)
        # a conductor that follows the KV events matches in its own index; else it asks the cache index
        holders = None if self.follower is not None else await self.prefix_holders(rid, keys)
        now = time.monotonic()
        decide_started = time.perf_counter()
        sampling = request.sampling
        self.settings = self.state.policy_settings(self.settings)  # with the balancing threshold learned so far
        outcome = routing.route(
            routing.ToRoute(rid, keys, len(ids), sampling.max_tokens, sampling.expected_tokens, request.attempt,
                            tuple(request.avoid), request.reply_subject),
            self.follower.index if self.follower is not None else None, self.state, now, self.settings,
            self.cfg.admission, self.perf, self.rng.random(), holders=holders, stages_of=self.pipeline_stages)
        self.metrics.decide_s.observe(time.perf_counter() - decide_started)
        if self.planner is not None:
            self.planner.routed(outcome, len(ids), sampling.max_tokens, sampling.expected_tokens)
        decision = outcome.decision
        if outcome.status == 400:
            self.count("malformed")
            return RouteReply(False, 400, outcome.reason)
        if decision is None:  # no route: an overload (429) or no instance of a kind (503)
            reason, policy_name, retry_after_s = outcome.reason.removeprefix("rejected at arrival: "), self.cfg.policy, \
                outcome.retry_after_s
            await self.event(later, "routed", rid, lambda: dict(
                admitted=False, reason=reason, policy=policy_name, policy_version=POLICY_VERSION,
                retry_after_s=retry_after_s))
            self.count("rejected" if outcome.status == 429 else "unavailable")
            return RouteReply(False, outcome.status, outcome.reason, retry_after_s=outcome.retry_after_s)
        verdict = outcome.verdict
        self.count("admitted" if outcome.admitted else "rejected")
        # NOTE: what the event says is taken now (the threshold and the margin may move before it is built)
        admitted, mode, num_keys = outcome.admitted, self.cfg.admission.mode, len(keys)
        threshold, margin = self.settings.kvcache_balancing_threshold, self.state.ttft_margin.value

        def routed() -> dict:
            terms = decision.to_event()
            del terms["request_id"]
            terms.update(
                admitted=admitted, admission=mode, verdict=verdict.reason, predicted_tbt_s=verdict.tbt_s,
                retry_after_s=verdict.retry_after_s, policy_version=POLICY_VERSION, prompt_blocks=num_keys,
                attempt=request.attempt, resumed_tokens=request.num_generated, tenant=request.tenant,
                balancing_threshold=threshold, ttft_margin=margin)
            return terms

        await self.event(later, "routed", rid, routed)
        if not outcome.admitted:
            return RouteReply(False, 429, outcome.reason, retry_after_s=outcome.retry_after_s)
        pull = decision.pull
        work = decision.prefill_s + decision.transfer_s
        spec = self.pipeline_spec(outcome.stages) if len(outcome.stages) > 1 else None
        deadline = admission.ttft_deadline(request.arrival_ts, self.cfg.admission,
                                           holds_tokens=request.num_generated > 0, pipelined=spec is not None)
        task = PrefillTask(rid, ids, sampling, request.reply_subject, decision.decode_id,
                           decision.decode_node, request.arrival_ts,
                           PullSpec(pull.source_node, pull.first_block, pull.num_blocks) if pull else None,
                           attempt=request.attempt, num_generated=request.num_generated, predicted_s=round(work, 6),
                           key_seed=request.key_seed, ttft_deadline_ts=deadline, tenant=request.tenant)
        if spec is None:
            sent = await bus.publish(self.nc, subjects.prefill_tasks(decision.prefill_id), task.to_bytes())
        else:
            stages, chunk_tokens = list(spec.stages), spec.chunk_tokens
            await self.event(later, "pipelined", rid, lambda: dict(stages=stages, chunk_tokens=chunk_tokens))
            sent = True
            for stage, instance_id in enumerate(spec.stages):
                staged = msgspec.structs.replace(task, pipeline=spec, stage=stage)
                sent &= await bus.publish(self.nc, subjects.prefill_tasks(instance_id), staged.to_bytes())
        if not sent:
            self.state.end(rid)
            return RouteReply(False, 503, "could not dispatch the request", retry_after_s=1.0)
        # the prefill instance that answers for the request: with a pipeline, the stage of the last chunk
        first_token_by = decision.prefill_id if spec is None else spec.stages[spec.last_stage(len(ids))]
        senders = sorted({*(spec.stages if spec is not None else (decision.prefill_id,)), decision.decode_id})
        return RouteReply(True, 200, prefill_id=first_token_by, decode_id=decision.decode_id,
                          predicted_ttft_s=round(decision.ttft_s, 6), senders=senders)

    def pipeline_stages(self, decision: policy.Decision, snapshot: policy.ClusterSnapshot,
                        prompt_tokens: int) -> tuple[str, ...] | None:
        """The prefill instances of a pipelined prefill of the request (`--pipeline-group`), each
        listening for pipeline streams; None: p* alone."""
        stages = policy.pipeline_stages(decision, snapshot, self.cfg.pipeline_group, prompt_tokens,
                                        self.cfg.prefill_chunk)
        if stages is None or not all(getattr(self.state.get(s), "transfer_addr", "") for s in stages):
            return None  # an instance that does not listen for pipeline streams: run alone
        return tuple(stages)

    def pipeline_spec(self, stages: tuple[str, ...]) -> PipelineSpec:
        addrs = [getattr(self.state.get(s), "transfer_addr", "") for s in stages]
        return PipelineSpec(list(stages), addrs, self.cfg.prefill_chunk)

    async def prefix_holders(self, request_id: str, keys: list[int]) -> dict[str, int]:
        """node -> leading blocks of `keys` it holds: from the local index (a node not synced yet
        holds nothing), or asked of the cache index; empty (recompute) if that does not answer."""
        if not keys:
            return {}
        if self.follower is not None:
            return self.follower.holders(keys)
        try:
            msg = await self.nc.request(subjects.INDEX_QUERY, IndexQuery(keys).to_bytes(), timeout=self.cfg.index_timeout_s)
            reply = IndexReply.from_bytes(msg.data)
        except (NoRespondersError, NatsTimeout, WireError) as exc:
            log.warning("request %s: no answer from the cache index (%r); routing as if nothing were cached",
                        request_id, exc)
            return {}
        return {node: prefix.prefix_len for node, prefix in reply.per_node.items() if prefix.prefix_len}

    async def on_status(self, msg: Msg) -> None:
        now = time.monotonic()
        workers = [i.info for i in self.state.instances.values()]
        queues = {w.instance_id: round(self.state.prefill_queue_s(w.instance_id, now), 6)
                  for w in workers if w.role == "prefill"}
        running = {w.instance_id: self.state.decode_running(w.instance_id) for w in workers if w.role == "decode"}
        await msg.respond(StatusReply(workers, len(self.state.routed), queues, running).to_bytes())

    def update_gauges(self) -> None:
        now, m = time.monotonic(), self.metrics
        m.in_flight.set(len(self.state.routed))
        m.threshold.set(self.state.threshold.value)
        m.ttft_margin.set(self.state.ttft_margin.value)
        roles: dict[str, int] = {}
        for known in self.state.instances.values():
            info = known.info
            roles[info.role] = roles.get(info.role, 0) + 1
            if info.role == "prefill":
                m.prefill_queue.labels(info.instance_id).set(self.state.prefill_queue_s(info.instance_id, now))
        for d in self.state.decode_candidates(now):
            m.decode_load.labels(d.instance_id).set(d.num_running)
        for role in ("prefill", "decode", "messenger", "cache_index"):
            m.instances.labels(role).set(roles.get(role, 0))
        for instance, kinds in self.state.learned.snapshot().items():
            for kind, factor in kinds.items():
                m.learned.labels(instance, kind).set(factor)

    async def sweep(self) -> None:
        now = time.monotonic()
        if self.follower is not None:
            self.follower.sweep()
        if not self.nc.is_connected:  # our silence, not theirs: nobody is lost while we are away
            self.offline = True
            return
        if self.offline:
            self.offline = False
            self.state.refresh(now)
            log.info("broker connection back; instance expiry resumes")
        for info in self.state.expire(now):
            log.warning("instance %s (%s) went silent (no report, no liveness beacon)", info.instance_id, info.role)
            self.lost(info.role)
            await self.events.instance("lost", info.instance_id, role=info.role, node=info.node, reason="silent")
            await self.fail_requests_of(info.instance_id, "stopped responding")
        self.update_gauges()
        for request in self.state.expire_unheld(now):
            log.warning("request %s: no instance has held it for %.0f s (its end message was lost); releasing its load",
                        request.request_id, UNHELD_S)
        for request in self.state.expire_leases(now):
            log.warning("request %s: lease expired, releasing its load", request.request_id)

    async def fail_requests_of(self, instance_id: str, why: str) -> None:
        """Every request the instance held gets a retryable error: its gateway resumes it elsewhere."""
        for request in self.state.lost_with(instance_id):
            log.warning("request %s: instance %s %s; handing it back to its gateway", request.request_id, instance_id, why)
            # its decode instance lost: the prefill did (or will do) its part, the request moves on (a migration)
            await worker.reply(self.nc, request.reply_subject, worker.error_chunk(
                request.request_id, request.attempt, -1, f"instance {instance_id} {why}", 503, self.cfg.instance_id,
                retryable=True, stage="decode_lost" if request.decode_id == instance_id else ""), sender_kind="conductor")


def settle_collector() -> None:
    """Once started: what start-up made (modules, the profile, the subscriptions, the first reports)
    goes out of the garbage collector's walks (gc.freeze), and young collections come every
    GC_YOUNG_THRESHOLD tracked allocations instead of 700. A route's objects die young (reference
    counting frees them), so the walks find little: rarer ones pause fewer routes and cost less
    in all (over a `moonbus bench conductor` live run, 72-80 ms of collections became 30-35 ms;
    its peak memory stayed 94-97 MiB: cyclic garbage only waits longer)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])


async def serve(cfg: ConductorConfig, stop: asyncio.Event) -> bool:
    ref = await models.prepare_for_service(cfg.model, cfg.home, stop)  # may wait for model-init
    if ref is None:
        return True  # stopped while it waited
    perf, source = profiles.load(cfg.home, cfg.model, cfg.profile, cfg.dtype)
    nc = await bus.connect(cfg.nats_url, cfg.instance_id, cfg.nats_auth)
    await bus.ensure_events_stream(nc, replicas=cfg.events_replicas)
    shape = models.read_shape(ref)
    layout = Layout(ref.name, cfg.block_tokens, cfg.prefill_chunk, shape.kv_layout(cfg.block_tokens, cfg.dtype).signature)
    tasks = runner.TaskGroup(stop)
    service = ConductorService(cfg, nc, tasks, perf, shape.kv_bytes_per_token(cfg.dtype), layout)
    if service.follower is not None:  # before the heartbeats: no event after a node's first snapshot is missed
        await bus.receive(nc, subjects.KV_EVENTS_ALL, Event, service.follower.on_kv_event, background=True)
    await bus.receive(nc, subjects.WORKER_HEARTBEAT_ALL, WorkerInfo, service.on_heartbeat, background=True)
    await service.hear_the_cluster(stop, HEAR_FIRST_S)
    await bus.subscribe(nc, subjects.CONDUCTOR_ROUTE, service.on_route, queue=subjects.CONDUCTOR_QUEUE)
    await bus.subscribe(nc, subjects.CONDUCTOR_STATUS, service.on_status)
    await bus.receive(nc, subjects.CONTROL_PROGRESS_ALL, Progress, service.on_progress)
    await bus.receive(nc, subjects.CONTROL_ALIVE_ALL, Alive, service.on_alive, background=True)
    await bus.receive(nc, subjects.CONTROL_EXITED_ALL, Exited, service.on_exited)
    await bus.receive(nc, subjects.REQUEST_CANCEL, Cancel, service.on_cancel)
    tasks.spawn(runner.every(cfg.sweep_interval_s, stop, service.sweep), "sweep")
    if service.planner is not None:
        tasks.spawn(runner.every(cfg.planner.interval_s, stop, service.plan), "planner")
    tasks.spawn(bus.watchdog(nc), "broker-watchdog")
    tasks.spawn(health.beacon(cfg.health_file, nc, stop), "health", essential=False)
    metrics.serve(cfg.metrics_port, service.metrics.registry, cfg.metrics_host)
    settle_collector()
    log.info("conductor %s ready: policy %s%s, admission %s (ttft slo %gs, tbt slo %gs), profile %s, %s prefix index",
             cfg.instance_id, cfg.policy, " (colocated)" if cfg.colocate else "", cfg.admission.mode,
             cfg.admission.ttft_slo_s, cfg.admission.tbt_slo_s, source, cfg.prefix_index)
    await runner.serving(stop)
    await tasks.cancel_all()
    await bus.shutdown(nc)
    return not tasks.failed
