"""The event loop: arrivals, prefill ends, KV arrivals at decode, decode segment ends.

    arrive      the live conductor's route (common/decide/route.py: prefix match, snapshot,
                decide, judge, record), on the load the instances report, kept by its ClusterState;
                not admitted -> done (rejected at arrival); else book the prefix pull on the NICs,
                queue at p* (it counts at d* until d* holds it)
    prefill     in arrival order per instance; one that its predicted work would bring past its TTFT
                deadline is rejected late instead of begun (late_start, live code); the next
                starts when the instance is free and the pulled prefix is in;
                reuses the prefix still in its pool at that moment (+ the pulled blocks);
                time = max(compute(n, prefix), prefix bytes / host-to-device) (layer-wise: loading
                layer i+1 overlaps computing layer i). The KV streams to d* layer by layer from
                the prefill's start, over both nodes' NICs: it lands at
                max(prefill end + one layer's share, when the NIC booking completes).
    prefill end first token; the node's pool stores every block (pulled ones too: replication)
    kv arrives  late_verdict (live code) -> late rejection, or wait for KV room (has_room, the
                live code's reservations) and join the batch (decode.py), first come first served
    segment end members that produced their last token are done

Coupled instances (coupled.py) prefill and decode on one GPU: a prefill pauses the batch.
With SimConfig.autoscale, the planner runs every interval and instances come and go (autoscale.py):
    plan        observe the window (common/decide/planner.py, on the state the router reads), decide,
                start instances (up after startup_s) or drain some (no new work; gone once idle)
Ties in time are broken by booking order, so a run is a pure function of (trace, config).
"""

from __future__ import annotations

import heapq
import random
import time
from dataclasses import dataclass, field

from collections.abc import Mapping

from common.decide.cluster_state import ClusterState
from common.kv.blocks import block_keys_from_hash_ids
from tools.moonbus.traces.measures import FAILED, OK, REJECTED_ARRIVAL, REJECTED_LATE, RequestResult, meets, summarize
from common.decide.perf import Profile
from tools.moonbus.traces.rows import TraceRow
from common.decide.index import PrefixIndex
from common.decide.admission import AdmissionSettings, late_start, late_verdict, ttft_deadline
from common.decide.policy import PolicySettings
from common.decide.route import ToRoute, route
from tools.sim.config import SimConfig, build_profile
from tools.sim.coupled import CoupledInstance
from tools.sim.decode import DecodeBatch
from tools.sim.instances import DecodeInstance, Nic, PoolNode, PrefillInstance, transfer
from tools.sim.request import SimRequest

PREFILL_DONE, KV_ARRIVE, SEGMENT_END, PLAN, INSTANCE_UP = range(5)


class GoalMissed(Exception):
    """Attainment can no longer reach SimConfig.stop_goal: the run stops."""


@dataclass
class SimOutcome:
    results: list[RequestResult]
    summary: dict
    stats: dict = field(default_factory=dict)  # wall time, simulated time, pulls, utilisation


def make_requests(rows: list[TraceRow], cfg: SimConfig) -> list[SimRequest]:
    """Trace rows as requests: time / speed, outputs capped or forced, block keys from hash ids."""
    out = []
    for i, row in enumerate(rows):
        output = max(1, row.output_length)
        cap = cfg.max_output or cfg.sim_max_tokens  # the client's max_tokens
        output = cfg.max_output if cfg.force_output and cfg.max_output else min(output, cap)
        out.append(SimRequest(i, row.timestamp_ms / 1000.0 / cfg.speed, max(1, row.input_length), output,
                              block_keys_from_hash_ids(row.hash_ids), cap))
    out.sort(key=lambda r: (r.arrival_s, r.index))
    return out


class Simulator:
    def __init__(self, requests: list[SimRequest], cfg: SimConfig, profile: Profile) -> None:
        self.cfg = cfg
        self.perf = profile
        self.requests = requests
        self.kv_bytes = profile.kv_bytes_per_token
        self.heap: list = []
        self.seq = 0
        self.rng = random.Random(cfg.seed)
        self.index = PrefixIndex()
        self.ended = 0
        self.pulls = self.pulled_blocks = 0
        self.admission = AdmissionSettings(cfg.admission, cfg.ttft_slo_s, cfg.tbt_slo_s)
        self.policy = PolicySettings(cfg.policy, cfg.kvcache_balancing_threshold, cfg.nic_bytes_s,
                                     cfg.block_tokens, self.kv_bytes, tbt_slo_s=cfg.tbt_slo_s)
        dram_blocks = cfg.dram_tokens // cfg.block_tokens
        self.nics: dict[str, Nic] = {}  # node -> its NIC
        self.prefills: list[PrefillInstance] = []
        self.decodes: list[DecodeInstance] = []
        if cfg.coupled:
            for i in range(cfg.coupled):
                name = f"c{i}"
                nic = self.nics[name] = Nic(cfg.nic_bytes_s)
                dec = DecodeInstance(f"{name}-decode", nic, self._batch(), cfg.decode_kv_tokens, node=name)
                inst = CoupledInstance(name, PoolNode(name, dram_blocks, cfg.eviction, self.index), nic, dec)
                dec.batch.owner = dec
                self.prefills.append(inst)
                self.decodes.append(dec)
        else:
            for i in range(cfg.prefill):
                name = f"p{i}"
                nic = self.nics[name] = Nic(cfg.nic_bytes_s)
                self.prefills.append(PrefillInstance(name, PoolNode(name, dram_blocks, cfg.eviction, self.index), nic))
            for i in range(cfg.decode):
                name = f"d{i}"
                nic = self.nics[name] = Nic(cfg.nic_bytes_s)
                dec = DecodeInstance(name, nic, self._batch(), cfg.decode_kv_tokens)
                dec.batch.owner = dec
                self.decodes.append(dec)
        self.prefill_by_id = {p.instance_id: p for p in self.prefills}
        self.decode_by_id = {d.instance_id: d for d in self.decodes}
        self.handlers = (self.on_prefill_done, self.on_kv_arrive, self.on_segment_end, self.on_plan, self.on_instance_up)
        # the live conductor's bookkeeping; reports are taken, like heartbeats, before each decision
        self.state = ClusterState(float("inf"), float("inf"), perf=profile,
                                  balancing_threshold=cfg.kvcache_balancing_threshold,
                                  admission=self.admission)
        self.dirty: set = set(self.prefills) | set(self.decodes)  # instances whose report is due
        for d in self.decodes:
            d.on_change = self.dirty.add
        self.budget: dict[int, int] = {}  # window of arrivals -> the misses stop_goal allows there
        self.misses: dict[int, int] = {}
        if cfg.stop_goal is not None:
            for r in requests:
                key = self.window_of(r)
                self.budget[key] = self.budget.get(key, 0) + 1
            self.budget = {key: int((1 - cfg.stop_goal) * n + 1e-9) for key, n in self.budget.items()}
        self.scaler = None
        if cfg.autoscale is not None:
            from tools.sim.autoscale import Scaler

            self.scaler = Scaler(self, cfg.autoscale)

    def window_of(self, r: SimRequest) -> int:
        return int(r.arrival_s // self.cfg.stop_window_s) if self.cfg.stop_window_s else 0

    def slowdown(self, t: float) -> float:
        """How much slower than the profile the machine runs at t (SimConfig.speed_factor, drift)."""
        return self.cfg.speed_factor * (1.0 + self.cfg.drift * t / 3600.0)

    def _batch(self) -> DecodeBatch:
        def real_step(batch: int, context: int, t: float) -> float:
            return self.perf.decode.step_seconds(batch, context) * self.slowdown(t)
        return DecodeBatch(real_step, self.cfg.segment_steps, self._book_segment)

    def _book_segment(self, t: float, batch: DecodeBatch, version: int) -> None:
        self.push(t, SEGMENT_END, batch, version)

    def push(self, t: float, kind: int, a, b=None) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, a, b))

    # --- the loop ------------------------------------------------------------------------------------

    def run(self) -> None:
        heap, handlers, arrivals = self.heap, self.handlers, self.requests
        i, n = 0, len(arrivals)
        while True:
            if i < n and (not heap or arrivals[i].arrival_s <= heap[0][0]):
                r = arrivals[i]
                i += 1
                self.on_arrive(r, r.arrival_s)
                continue
            if not heap:
                break
            t, _, kind, a, b = heapq.heappop(heap)
            handlers[kind](a, b, t)

    def end(self, r: SimRequest, t: float, status: str = OK, error: str = "") -> None:
        if r.end_s is not None:
            raise RuntimeError(f"request {r.index} ended twice")
        r.status, r.end_s, r.error = status, t, error
        self.ended += 1
        self.state.end(str(r.index))
        if self.scaler is not None:
            self.scaler.ended(r, t)
        if self.budget and not meets(r.result(), self.cfg.ttft_slo_s, self.cfg.tbt_slo_s):
            key = self.window_of(r)
            self.misses[key] = self.misses.get(key, 0) + 1
            if self.misses[key] > self.budget[key]:
                raise GoalMissed()
        if status == OK and r.output_tokens > 1:  # how long requests run: what the conductor learns from
            self.state.completed(r.output_tokens)

    def report(self, t: float) -> None:
        """Instances that changed send their report (in the live cluster: a progress message)."""
        for instance in self.dirty:
            self.state.heard(instance.info(t), t)
        self.dirty.clear()

    def end_done(self, batch: DecodeBatch) -> None:
        done = batch.take_done()
        for r, t in done:
            self.end(r, t)
        if done and batch.owner.waiting:
            self.admit_waiting(batch.owner, done[-1][1])

    def admit_waiting(self, d: DecodeInstance, t: float) -> None:
        """Requests whose KV arrived join as room frees, in arrival order (a live decode instance's
        `admit_waiting`); members that finish on the way make room for the next."""
        while d.waiting and d.has_room(d.waiting[0]):
            r = d.waiting.popleft()
            r.kv_arrival_s = t
            d.batch.join(r, t)
            for member, end in d.batch.take_done():
                self.end(member, end)

    # --- the conductor ---------------------------------------------------------------------------------

    def on_arrive(self, r: SimRequest, t: float) -> None:
        """The live conductor's route (common/decide/route.py), on the reports heard so far; each
        holder's sender congestion is its NIC's queue."""
        self.report(t)
        self.policy = self.state.policy_settings(self.policy)  # with the balancing threshold learned so far
        outcome = route(ToRoute(str(r.index), r.keys, r.input_tokens, r.max_tokens), self.index, self.state, t,
                        self.policy, self.admission, self.perf, self.rng.random(), queued=_NicQueues(self.nics, t))
        if self.scaler is not None:
            self.scaler.window.routed(outcome, r.input_tokens, r.max_tokens)
        if not outcome.admitted:  # an overload, no instance, or too large: either way, not served
            self.end(r, t, REJECTED_ARRIVAL, outcome.reason)
            return
        self.dispatch(r, outcome.decision, t)

    def dispatch(self, r: SimRequest, decision, t: float) -> None:
        """Send the routed request to its prefill instance (the route booked it in the state)."""
        p = self.prefill_by_id[decision.prefill_id]
        r.decision, r.prefill = decision, p
        r.decode = p.decode if isinstance(p, CoupledInstance) else self.decode_by_id[decision.decode_id]
        if decision.pull is not None:
            r.ready_s = transfer(self.nics[decision.pull.source_node], p.nic, t, decision.pull.nbytes)
            self.pulls += 1
            self.pulled_blocks += decision.pull.num_blocks
        p.queue.push(r, r.arrival_s)
        self.dirty.add(p)
        if self.scaler is not None:
            self.scaler.dispatched(r)
        if not p.busy:
            self.start_prefill(p, t)

    # --- prefill ---------------------------------------------------------------------------------------

    def start_prefill(self, p: PrefillInstance, t: float) -> None:
        """The next request in the queue that can still meet its TTFT deadline begins (the live
        prefill instance's `late_start` check); those that cannot are rejected late, unprefilled."""
        while True:
            r = p.queue.pop()
            late_s = late_start(t, ttft_deadline(r.arrival_s, self.admission), r.decision.prefill_s + r.decision.transfer_s)
            if late_s <= 0:
                break
            self.state.unstarted(str(r.index), 0, t)
            self.end(r, t, REJECTED_LATE, f"prefill {p.instance_id}: its first token would come {late_s:.2f}s past "
                                          "its TTFT SLO")
            self.dirty.add(p)
            if not p.queue:
                return
        p.current = r
        p.busy = True
        start = r.prefill_start_s = max(p.claim_gpu(t), r.ready_s)
        if isinstance(p, CoupledInstance):
            self.end_done(p.decode.batch)
        cfg, n = self.cfg, r.input_tokens
        local = p.pool.local_prefix(r.keys)
        prefix, pull = local, r.decision.pull
        if pull is not None and local >= pull.first_block:  # pulled blocks still extend the local prefix
            prefix = max(local, pull.first_block + pull.num_blocks)
        prefix_tokens = min(prefix * cfg.block_tokens, n - 1)
        r.cached_tokens = prefix_tokens
        compute = self.perf.prefill.seconds(n, prefix_tokens) * self.slowdown(start)
        duration = max(compute, prefix_tokens * self.kv_bytes / cfg.h2d_bytes_s)
        end = start + duration
        # NOTE: the compute is what it reports (the loading bound is this model's, not the profile's)
        p.measured = (p.measured[0] + 1, compute, n, prefix_tokens)
        p.busy_s += duration
        p.prefills_done += 1
        if r.output_tokens > 1 and not isinstance(p, CoupledInstance):
            nbytes = n * self.kv_bytes
            landed = transfer(p.nic, r.decode.nic, start, nbytes)
            r.kv_arrival_s = max(end + nbytes / cfg.nic_bytes_s / cfg.layers, landed)
        self.push(end, PREFILL_DONE, p, r)

    def on_prefill_done(self, p: PrefillInstance, r: SimRequest, t: float) -> None:
        p.pool.store(r.keys)
        r.first_token_s = t
        p.busy = False
        p.current = None
        self.state.prefilled(str(r.index), 0, t)
        self.dirty.add(p)
        coupled = isinstance(p, CoupledInstance)
        if coupled:
            p.release_gpu(t)
            self.end_done(p.decode.batch)
        if r.output_tokens <= 1:
            self.end(r, t)
        elif coupled:
            self.on_kv_arrive(r, None, t)
        else:
            self.push(r.kv_arrival_s, KV_ARRIVE, r)
        if p.queue:
            self.start_prefill(p, t)
        if p.draining and not p.busy:  # a removed instance that finished its queue
            self.scaler.idle(p, t)

    # --- decode ----------------------------------------------------------------------------------------

    def on_kv_arrive(self, r: SimRequest, _unused, t: float) -> None:
        d: DecodeInstance = r.decode
        own = d.own_state(self.state.learned.factor(d.instance_id, "step"))
        why = late_verdict(own, r.input_tokens, d.needed(r), d.kv_tokens, self.perf, self.cfg.tbt_slo_s,
                           check_tbt=self.cfg.admission != "none")
        if why:
            self.end(r, t, REJECTED_LATE, f"decode {d.instance_id}: {why} over budget on kv arrival")
            return
        d.waiting.append(r)
        self.admit_waiting(d, t)
        d.changed()

    def on_segment_end(self, batch: DecodeBatch, version: int, t: float) -> None:
        if version != batch.version or not batch.running:
            return  # superseded: a join closed that segment early
        batch.segment_end(t)
        self.end_done(batch)
        batch.owner.changed()
        if not batch.running:  # a request that was waiting for room may have opened it already
            batch.open(t)

    def on_plan(self, scaler, _unused, t: float) -> None:
        scaler.plan(t)

    def on_instance_up(self, scaler, name: tuple[str, str], t: float) -> None:
        scaler.up(name, t)


def simulate(rows: list[TraceRow], cfg: SimConfig, profile: Profile | None = None) -> SimOutcome:
    """Run the trace through the simulated cluster; results are in trace row order."""
    if profile is None:
        profile = cfg.profile or build_profile()[0]
    requests = make_requests(rows, cfg)
    sim = Simulator(requests, cfg, profile)
    started = time.perf_counter()
    stopped = False
    try:
        sim.run()
    except GoalMissed:
        stopped = True
    wall = time.perf_counter() - started
    for r in requests:
        if stopped and r.end_s is None:  # not simulated: a miss, as far as the search that stopped it cares
            r.status, r.end_s, r.error = FAILED, r.arrival_s, "not simulated: the run stopped (goal missed)"
        elif r.end_s is None:  # cannot happen; kept so that a bug shows up as failures, not as a hang
            sim.end(r, r.arrival_s, FAILED, "never ended")
    results = sorted((r.result() for r in requests), key=lambda x: x.index)
    sim_s = max((r.end_s for r in requests), default=0.0)
    stats = {
        "wall_s": wall, "simulated_s": sim_s, "sim_s_per_wall_s": sim_s / wall if wall > 0 else None,
        "ended": sim.ended, "pulls": sim.pulls, "pulled_blocks": sim.pulled_blocks,
        "prefill_utilisation": {p.instance_id: round(p.busy_s / sim_s, 4) if sim_s else 0.0 for p in sim.prefills},
        "index_keys": len(sim.index),
        "prefill_mean_s": sum(p.busy_s for p in sim.prefills) / max(1, sum(p.prefills_done for p in sim.prefills)),
        "learned": sim.state.learned.snapshot(),  # instance -> kind -> factor (what the conductor learned)
        "balancing_threshold": sim.state.threshold.value,  # as learned from pulls' TTFT against recomputes'

    }
    if sim.scaler is not None:
        stats["autoscale"] = sim.scaler.report(sim_s)
        stats["instance_hours"] = stats["autoscale"]["instance_hours"]
    elif not cfg.coupled:
        stats["instance_hours"] = (cfg.prefill + cfg.decode) * sim_s / 3600.0
    if stopped:
        stats["stopped"] = f"attainment can no longer reach {cfg.stop_goal:g}" + \
            (f" in every {cfg.stop_window_s:g} s of arrivals" if cfg.stop_window_s else "")
    return SimOutcome(results, summarize(results, cfg.ttft_slo_s, cfg.tbt_slo_s), stats)


class _NicQueues(Mapping):
    """node -> bytes queued at its NIC at `t`, computed for the nodes a route asks about only."""

    def __init__(self, nics: dict[str, Nic], t: float) -> None:
        self.nics, self.t = nics, t

    def __getitem__(self, node: str) -> int:
        return self.nics[node].queued_bytes(self.t)

    def __iter__(self):
        return iter(self.nics)

    def __len__(self) -> int:
        return len(self.nics)
