"""Autoscaling in the simulator: the planner's loop and its driver, a day-shaped load, and the
search for the cheapest fixed split to compare the planner with.

    Scaler       every interval: the reports heard, an Observation of the window (the live
                 conductor's PlannerWindow on the ClusterState the router reads), the planner's
                 decision (common/decide/planner.py, the code the conductor runs), then the driver,
                 with the steps the live drivers take (common/decide/scaling.py): more instances
                 than running or starting -> a draining one serves again, else a new one is started
                 (it serves startup_s later, and counts from the moment it is asked for); fewer ->
                 one not started yet is cancelled, else the least loaded drains (no new work; it
                 leaves once what was routed to it has ended). Instance-seconds are counted from
                 the ask to the leave.
    day_curve    the trace repeated (each copy's hash ids moved past the last's, so copies share no
                 prefix) with its arrival rate scaled by a day: low at night, rising in the morning,
                 peaking in the afternoon (a cosine with its trough at 4:00 and its peak at 16:00)
    search_fixed the cheapest fixed split (fewest instances) whose attainment reaches the goal

Attainment here is the share of all requests served within both SLOs (rejections count as misses).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np

from common.decide.planner import Planner, PlannerSettings, PlannerWindow
from common.decide.scaling import DRAINING, SERVING, STARTING, Member, steps
from schemas.workers import WorkerInfo
from tools.moonbus.traces.measures import OK, REJECTED_LATE, meets
from tools.moonbus.traces.rows import TraceRow
from tools.sim.config import SimConfig
from tools.sim.instances import DecodeInstance, Nic, PoolNode, PrefillInstance

ROLES = ("prefill", "decode")


class Scaler:
    """The planner's loop and its driver inside one simulation (see the module's docstring)."""

    def __init__(self, sim, settings: PlannerSettings) -> None:
        from tools.sim.engine import PLAN

        self.sim = sim
        self.settings = settings
        cfg = sim.cfg
        self.planner = Planner(settings, cfg.prefill, cfg.decode, 0.0)
        self.window = PlannerWindow(0.0, sim.admission)
        self.asked: dict[str, float] = {}  # instance -> when it was asked for
        self.left: dict[str, float] = {}  # instance -> when it left (or its start was cancelled)
        self.kind: dict[str, str] = {}  # instance -> role
        self.live = {"prefill": list(sim.prefills), "decode": list(sim.decodes)}  # up, not gone (draining ones too)
        self.starting: dict[str, list[str]] = {"prefill": [], "decode": []}
        self.names = {"prefill": cfg.prefill, "decode": cfg.decode}  # the next p<k>, d<k>
        self.pending: dict[str, int] = {}  # decode instance -> requests bound to it that have not ended
        for role, instances in self.live.items():
            for inst in instances:
                self.asked[inst.instance_id] = 0.0
                self.kind[inst.instance_id] = role
        self.timeline: list[dict] = []
        self.plans: list[dict] = []
        self.last_arrival = sim.requests[-1].arrival_s if sim.requests else 0.0
        self.act(0.0)  # the initial counts, clamped to the bounds
        self.record(0.0, None, None)
        sim.push(settings.interval_s, PLAN, self)

    # --- what the engine tells it ---------------------------------------------------------------

    def dispatched(self, r) -> None:
        self.pending[r.decode.instance_id] = self.pending.get(r.decode.instance_id, 0) + 1

    def ended(self, r, t: float) -> None:
        if r.status == OK:
            self.window.ended(meets(r.result(), self.sim.cfg.ttft_slo_s, self.sim.cfg.tbt_slo_s))
        elif r.status == REJECTED_LATE:  # the arrival's rejections came with their route
            self.window.reject("ttft" if r.error.startswith("prefill") else
                               "kv room" if ": kv " in r.error else "tbt")
        d = r.decode
        if d is not None and r.prefill is not None:  # it was dispatched
            left = self.pending[d.instance_id] = self.pending[d.instance_id] - 1
            if left == 0 and d.draining:
                self.leave(d, "decode", t)

    def idle(self, p: PrefillInstance, t: float) -> None:
        """A draining prefill instance has nothing left."""
        self.leave(p, "prefill", t)

    # --- the loop ------------------------------------------------------------------------------------

    def plan(self, t: float) -> None:
        from tools.sim.engine import PLAN

        sim = self.sim
        sim.report(t)
        obs = self.window.observe(sim.state, t, sim.perf)
        plan = self.planner.decide(obs)
        if plan.changed:
            self.plans.append({"at": t, **plan.to_event()})
        self.act(t)
        self.record(t, obs, plan)
        if t < self.last_arrival:
            sim.push(t + self.settings.interval_s, PLAN, self)

    def record(self, t: float, obs, plan) -> None:
        """One row of the timeline: the window's load and what each role runs after the decision."""
        row = {"at": t, "arrivals_per_s": obs.arrivals / obs.window_s if obs else None,
               "attainment": obs.attainment if obs else None}
        if plan is not None:
            row |= {"demand_prefill": plan.demand_prefill, "demand_decode": plan.demand_decode,
                    "utilization_prefill": plan.utilization_prefill, "utilization_decode": plan.utilization_decode,
                    "slack": plan.slack, "rejections": dict(obs.rejections), "queue_s": obs.queue_s,
                    "kv_used": obs.kv_used, "tbt_s": obs.tbt_s}
        for role in ROLES:
            serving = [i for i in self.live[role] if not i.draining]
            row[role] = len(serving)
            row[f"{role}_draining"] = len(self.live[role]) - len(serving)
            row[f"{role}_starting"] = len(self.starting[role])
            row[f"{role}_target"] = self.planner.target(role)
        self.timeline.append(row)

    def act(self, t: float) -> None:
        """Bring each role to the planner's target: start or cancel, drain or serve again."""
        from tools.sim.engine import INSTANCE_UP

        for role in ROLES:
            live = {inst.instance_id: inst for inst in self.live[role]}
            starting = self.starting[role]
            members = [Member(name, DRAINING if inst.draining else SERVING, self._held(inst), _order(name))
                       for name, inst in live.items()] + [Member(name, STARTING, 0, _order(name)) for name in starting]
            todo = steps(self.planner.target(role), members)
            for name in todo.resume:  # up already: the cheapest
                live[name].draining = False
                self.sim.dirty.add(live[name])
            for _ in range(todo.start):
                name = f"{role[0]}{self.names[role]}"
                self.names[role] += 1
                self.asked[name], self.kind[name] = t, role
                starting.append(name)
                self.sim.push(t + self.sim.cfg.startup_s, INSTANCE_UP, self, (role, name))
            for name in todo.cancel:  # not started yet
                starting.remove(name)
                self.left[name] = t
            for name in todo.drain:
                inst = live[name]
                inst.draining = True
                self.sim.dirty.add(inst)
                if not self._held(inst):
                    self.leave(inst, role, t)

    def _held(self, inst) -> int:
        """What it holds: a prefill instance's queue and running one, a decode instance's requests bound to it."""
        if isinstance(inst, PrefillInstance):
            return len(inst.queue) + int(inst.busy)
        return self.pending.get(inst.instance_id, 0)

    def up(self, which: tuple[str, str], t: float) -> None:
        """A started instance is up: it reports, and takes work from the next route on."""
        role, name = which
        if name in self.left:  # cancelled before it came up
            return
        self.starting[role].remove(name)
        sim, cfg = self.sim, self.sim.cfg
        nic = sim.nics[name] = Nic(cfg.nic_bytes_s)
        if role == "prefill":
            inst = PrefillInstance(name, PoolNode(name, cfg.dram_tokens // cfg.block_tokens, cfg.eviction, sim.index), nic)
            sim.prefills.append(inst)
            sim.prefill_by_id[name] = inst
        else:
            inst = DecodeInstance(name, nic, sim._batch(), cfg.decode_kv_tokens)
            inst.batch.owner = inst
            inst.on_change = sim.dirty.add
            sim.decodes.append(inst)
            sim.decode_by_id[name] = inst
        self.live[role].append(inst)
        sim.dirty.add(inst)

    def leave(self, inst, role: str, t: float) -> None:
        """A drained instance leaves: it says so (the conductor forgets it), and its cache goes with it."""
        sim = self.sim
        self.live[role].remove(inst)
        sim.dirty.discard(inst)
        if role == "decode":
            inst.on_change = None
        else:
            sim.index.drop_node(inst.node)
        sim.state.heard(WorkerInfo(inst.instance_id, role, inst.node, leaving=True, draining=True), t)
        self.left[inst.instance_id] = t

    def report(self, end_s: float) -> dict:
        """Instance-hours per role (from each ask to its leave, or to the end) and the timelines."""
        seconds = {role: 0.0 for role in ROLES}
        for name, asked in self.asked.items():
            seconds[self.kind[name]] += max(0.0, min(self.left.get(name, end_s), end_s) - asked)
        return {"instance_hours": sum(seconds.values()) / 3600.0,
                "instance_hours_by_role": {role: s / 3600.0 for role, s in seconds.items()},
                "instances_asked": len(self.asked), "timeline": self.timeline, "plans": self.plans}


def _order(name: str) -> int:
    """p3 -> 3: the order the instances of a role were asked for in."""
    return int(name[1:])


# --------------------------------------------------------------------------- the day


def day_rate(hour: np.ndarray | float, peak: float, trough: float):
    """The rate multiplier at an hour of the day: trough at 4:00, peak at 16:00, a cosine between."""
    return trough + (peak - trough) * (1 - np.cos(2 * np.pi * (np.asarray(hour) - 4.0) / 24.0)) / 2


def _day_integral(s: np.ndarray, day_s: float, peak: float, trough: float) -> np.ndarray:
    """Trace seconds consumed by s simulated seconds of the day (the integral of day_rate)."""
    w, c = 2 * np.pi / day_s, day_s * 4.0 / 24.0
    return trough * s + (peak - trough) / 2 * (s - (np.sin(w * (s - c)) + np.sin(w * c)) / w)


def day_curve(rows: list[TraceRow], day_s: float = 3600.0, peak: float = 8.0, trough: float = 1.0) -> list[TraceRow]:
    """One day of `day_s` simulated seconds whose arrival rate is the trace's times day_rate: a
    row at trace second u arrives at the s where the integral of the rate up to s is u. The trace
    is repeated as often as the day needs; copy k's hash ids are moved by k x (largest id + 1)."""
    if not rows or day_s <= 0 or not 0 < trough <= peak:
        raise ValueError("day_curve needs rows, day_s > 0 and 0 < trough <= peak")
    start = rows[0].timestamp_ms
    span_ms = rows[-1].timestamp_ms - start
    gap_ms = max(1, round(span_ms / max(1, len(rows) - 1)))  # one mean gap between the copies
    period_ms = span_ms + gap_ms
    need_s = float(_day_integral(np.array([day_s]), day_s, peak, trough)[0])
    copies = math.ceil(need_s * 1000 / period_ms)
    shift = max((h for row in rows for h in row.hash_ids), default=-1) + 1
    us, chosen = [], []
    for k in range(copies):
        for row in rows:
            u = (k * period_ms + row.timestamp_ms - start) / 1000.0
            if u < need_s:
                us.append(u)
                chosen.append((k, row))
    u = np.array(us)
    lo, hi = np.zeros_like(u), np.full_like(u, day_s)
    for _ in range(60):  # bisection: the integral is increasing
        mid = (lo + hi) / 2
        below = _day_integral(mid, day_s, peak, trough) < u
        lo, hi = np.where(below, mid, lo), np.where(below, hi, mid)
    out = []
    for s, (k, row) in zip(hi.tolist(), chosen):
        ids = row.hash_ids if k == 0 else tuple(h + k * shift for h in row.hash_ids)
        out.append(TraceRow(round(s * 1000), row.input_length, row.output_length, ids))
    return out


# --------------------------------------------------------------------------- fixed splits


def window_attainment(results, ttft_slo_s: float, tbt_slo_s: float, window_s: float) -> list[tuple[float, float]]:
    """(window start, attainment) per window of arrival time that had arrivals."""
    met: dict[int, list[int]] = {}
    for r in results:
        bucket = met.setdefault(int(r.arrival_s // window_s), [0, 0])
        bucket[0] += meets(r, ttft_slo_s, tbt_slo_s)
        bucket[1] += 1
    return [(k * window_s, met[k][0] / met[k][1]) for k in sorted(met)]


@dataclass
class FixedSearch:
    """The fixed splits tried for one criterion, and the cheapest that met it (None: none did).
    window_s None: attainment over the whole run >= goal; else also in every window of arrivals."""

    goal: float
    window_s: float | None = None
    runs: dict[tuple[int, int], dict] = field(default_factory=dict)  # (prefill, decode) -> its numbers
    best: tuple[int, int] | None = None
    outcome: object = None  # the best one's SimOutcome

    def passes(self, split: tuple[int, int]) -> bool:
        n = self.runs[split]
        return not n["stopped"] and n["attainment"] >= self.goal \
            and (self.window_s is None or n["worst_window"] >= self.goal)

    @property
    def criterion(self) -> str:
        return "overall" if self.window_s is None else f"in every {self.window_s:g} s"


def search_fixed(rows: list[TraceRow], cfg: SimConfig, settings: PlannerSettings, goal: float = 0.9,
                 window_s: float | None = None, hint: int | None = None, simulate: Callable | None = None,
                 on_run: Callable[[tuple[int, int], dict], None] | None = None, done: dict | None = None,
                 report_window_s: float | None = None) -> FixedSearch:
    """The cheapest fixed split, within the planner's bounds, that meets the goal (FixedSearch).

    Assumes more instances of a role never lower attainment: the fewest prefill instances that
    meet it with the most decode instances (a binary search, whose first guess is `hint`: the
    planner's peak, say), then the fewest decode instances that meet it with those (binary
    search). A run stops as soon as it can no longer meet it (SimConfig.stop_goal). `done`:
    (prefill, decode) -> (numbers, outcome) of runs already made, shared between searches (a run
    stopped under the overall goal fails every window's too); `report_window_s`: the window each
    full run's worst attainment is reported for."""
    if simulate is None:
        from tools.sim.engine import simulate
    done = {} if done is None else done
    report_window_s = report_window_s or window_s
    total = settings.max_total or settings.max_prefill + settings.max_decode
    search = FixedSearch(goal, window_s)

    def run(p: int, d: int) -> bool:
        known = done.get((p, d))
        # a run stopped for one window's goal says nothing of the overall one; the other way round it does
        if known is None or (window_s is None and known[0]["stopped_for"] is not None):
            out = simulate(rows, replace(cfg, prefill=p, decode=d, autoscale=None, stop_goal=goal,
                                         stop_window_s=window_s))
            stopped = "stopped" in out.stats
            worst = None if stopped else min((a for _, a in window_attainment(
                out.results, cfg.ttft_slo_s, cfg.tbt_slo_s, report_window_s or cfg.stop_window_s or 1e18)),
                default=0.0)
            numbers = {"attainment": None if stopped else out.summary["effective_capacity"], "worst_window": worst,
                       "stopped": stopped, "stopped_for": window_s if stopped else None,
                       "instance_hours": None if stopped else out.stats["instance_hours"],
                       "rejected_arrival": out.summary["rejected_arrival"], "rejected_late": out.summary["rejected_late"]}
            known = done[(p, d)] = (numbers, None if stopped else out)
            if on_run is not None:
                on_run((p, d), numbers)
        search.runs[(p, d)] = known[0]
        return search.passes((p, d))

    d_most = min(settings.max_decode, total - settings.min_prefill)
    p_lo, p_hi = settings.min_prefill, min(settings.max_prefill, total - d_most)
    best = _fewest(p_lo, p_hi, lambda p: run(p, d_most), hint)
    if best is None:
        return search
    fewest_d = _fewest(settings.min_decode, d_most, lambda d: run(best, d), None)
    search.best = (best, fewest_d)
    search.outcome = done[search.best][1]
    return search


def _fewest(lo: int, hi: int, passes: Callable[[int], bool], first: int | None) -> int | None:
    """The least n in [lo, hi] that passes (passing is monotone in n), or None."""
    found = None
    mid = min(hi, max(lo, first)) if first is not None else None
    while lo <= hi:
        if mid is None:
            mid = (lo + hi) // 2
        if passes(mid):
            found, hi = mid, mid - 1
        else:
            lo = mid + 1
        mid = None
    return found


# --------------------------------------------------------------------------- planner against fixed


@dataclass
class Comparison:
    """The planner's run and the fixed-split searches (overall, and in every window) on the same rows."""

    goal: float
    window_s: float
    slos: tuple[float, float]  # TTFT, TBT
    planner: object  # SimOutcome
    searches: list[FixedSearch] = field(default_factory=list)

    @property
    def planner_attainment(self) -> float:
        return self.planner.summary["effective_capacity"]

    @property
    def planner_worst_window(self) -> float:
        return min((a for _, a in window_attainment(self.planner.results, *self.slos, self.window_s)), default=0.0)

    @property
    def planner_hours(self) -> float:
        return self.planner.stats["instance_hours"]

    def ratio(self, search: FixedSearch) -> float | None:
        """Planner instance-hours / that search's best fixed split's (below 1: the planner is cheaper)."""
        return self.planner_hours / search.runs[search.best]["instance_hours"] if search.best else None

    def peak(self, role: str) -> int:
        return max((row[role] for row in self.planner.stats["autoscale"]["timeline"]), default=0)

    def lines(self) -> list[str]:
        """The planner and each search's best side by side, and their ratios."""
        out = [f"{'':<44}{'attainment':>11}{'worst window':>14}{'instance-hours':>16}",
               f"{'planner':<44}{self.planner_attainment:>11.3f}{self.planner_worst_window:>14.3f}"
               f"{self.planner_hours:>16.2f}"]
        for s in self.searches:
            if s.best is None:
                out.append(f"no fixed split within the bounds reaches {self.goal:g} {s.criterion}")
                continue
            n = s.runs[s.best]
            name = f"best fixed ({s.criterion} >= {self.goal:g}): {s.best[0]}P{s.best[1]}D"
            out.append(f"{name:<44}{n['attainment']:>11.3f}{n['worst_window']:>14.3f}{n['instance_hours']:>16.2f}")
        for s in self.searches:
            if s.best is not None:
                ratio = self.ratio(s)
                kept = self.planner_attainment >= self.goal and (s.window_s is None or
                                                                 self.planner_worst_window >= self.goal)
                out.append(f"planner / best fixed ({s.criterion}) instance-hours = {ratio:.3f}: "
                           f"{'fewer' if ratio < 1 else 'more'} instance-hours, and the planner "
                           f"{'meets' if kept else 'does NOT meet'} the same goal")
        return out


def compare(rows: list[TraceRow], cfg: SimConfig, settings: PlannerSettings, goal: float = 0.9,
            window_s: float = 150.0, on_run: Callable[[tuple[int, int], dict], None] | None = None,
            search: bool = True) -> Comparison:
    """Run the planner on `rows`, then search the fixed splits (first guess: the planner's peak):
    the cheapest reaching `goal` over the whole run, then the cheapest reaching it in every
    `window_s` of arrivals too. Windows are reported as their worst attainment."""
    from tools.sim.engine import simulate

    planned = simulate(rows, replace(cfg, autoscale=settings))
    comparison = Comparison(goal, window_s, (cfg.ttft_slo_s, cfg.tbt_slo_s), planned)
    if search:
        hint = max((row["prefill_target"] for row in planned.stats["autoscale"]["timeline"]), default=None)
        done: dict = {}
        overall = search_fixed(rows, cfg, settings, goal, None, hint, simulate, on_run, done, window_s)
        every = search_fixed(rows, cfg, settings, goal, window_s, None, simulate, on_run, done, window_s)
        comparison.searches = [overall, every]
    return comparison
