"""The planner: how many prefill and how many decode instances the load needs.

Every interval the caller (the conductor's loop, services/conductor/planner_loop.py, or the
simulator, tools/sim/autoscale.py) builds an `Observation` of the window just past with a
`PlannerWindow` (its own route outcomes, fed as they happen, and the `ClusterState` the router
reads) and asks `Planner.decide` for a `Plan`: a target count per role and the reasons.

Demand is counted in instances' worth of work, absolute, so that neither the instances still
starting nor those lost move it:

    prefill   the predicted work of every request priced in the window (routed or rejected:
              rejected demand is demand) / window  +  the predicted queue beyond
              queue_share x TTFT SLO, at every instance, drained within drain_s
    decode    max(KV room held, KV room the window's admissions hold on average, TBT headroom
              used) x the decode instances. The second is Little's law on the arrivals: each
              admitted request holds its reservation (prompt + max_tokens) for its expected output
              (the conductor's learned lengths) times the step time; unlike the room held now it
              is not hidden by a prefill backlog, nor capped by a full cache. The headroom used =
              (predicted TBT - an empty batch's step) / (TBT SLO - that step): the part of a step
              that load adds, which is what more instances spread

Forecast: a level (exponential smoothing) plus its trend (the least-squares slope of the last
levels: one window's spike does not make a trend) times lead_s, since an instance asked for now
serves only once it has started. Increases judge max(level, forecast); decreases judge the
largest of the level, the last demand and the forecast: a falling trend is never anticipated (a
fall anticipated wrongly costs the SLO, one seen late only instance-hours), and a rising one
keeps what it will need. The defaults were chosen on the day of docs/experiments/7_autoscale.md.

The rules, per role, with target count T and needed = ceil(demand / the role's target utilisation)
(prefill runs hotter than decode: its queue absorbs bursts within the TTFT SLO, while a decode
instance's KV room is a wall):

    up        demand / T above `high` for up_after observations in a row, or the role's rejections
              (TTFT: prefill; TBT and KV room: decode) above reject_share of the arrivals, and
              up_cooldown_s since the role's last change: T = max(needed, T + 1)
    down      demand / T below `low` for down_after observations in a row, with the role's
              rejections not above reject_share and attainment not below its goal, and
              down_cooldown_s since the role's last change: T = max(needed, T - max_step_down x T),
              at least one less; decode one at a time (a few instances, each a big share of the room)
    lost      an instance of the role lost (died, went silent) in the window, or within lost_hold_s
              of one: T is held (its driver replaces the instance) and the role's streaks restart.
              A death is not load: the survivors' queues grow with the requests handed back, and
              that is not a reason for more instances, nor is the smaller count a reason for fewer.
              Rejections while an instance is being restarted are counted apart ("recovering").
    attainment  below attainment_goal while neither role asks for more: the role nearer its high
              watermark goes up by one (after up_after such observations)
    slack     the goal is the SLO attainment, not a utilisation: while attainment stays at or above
              attainment_goal + slack_margin, prefill's target and watermarks rise by slack_step
              (times, up to max_slack); below the goal they fall back twice as fast (not under 1).
              So the planner runs as hot as the goal allows, and prefill's rejections ask for
              more only while attainment is below its goal (within it, they are the misses it allows)
    bounds    min/max per role; max_total caps the sum (an increase is cut to fit)

Pure: the caller passes the time; no I/O.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Mapping

from common.decide.admission import AdmissionSettings
from common.decide.cluster_state import ClusterState
from common.decide.perf import Profile

ROLES = ("prefill", "decode")
# what each kind of rejection says is short: the role whose capacity it lacked ("" for none)
# ("too long": a prompt whose prefill alone takes longer than the TTFT SLO; no instance count helps)
REASON_ROLES = {"ttft": "prefill", "no prefill": "prefill", "tbt": "decode", "kv room": "decode",
                "no decode": "decode", "recovering": "", "too large": "", "too long": "", "other": ""}


@dataclass(frozen=True)
class PlannerSettings:
    """Bounds, watermarks, streaks and cooldowns. Utilisations are shares of the instances' capacity."""

    min_prefill: int = 1
    max_prefill: int = 32
    min_decode: int = 1
    max_decode: int = 32
    max_total: int | None = None  # cap on prefill + decode
    interval_s: float = 30.0  # how often the caller observes and decides
    # prefill: the utilisation a change aims at, and the watermarks (above high: more instances after
    # up_after observations; below low: fewer after down_after). A prefill queue under a TTFT SLO
    # of seconds absorbs bursts (and the backlog term catches what it does not): it can run hot
    target: float = 0.85
    high: float = 0.95
    low: float = 0.72
    # decode: its KV room is a wall (a request without room waits), so it keeps more headroom
    decode_target: float = 0.7
    decode_high: float = 0.85
    decode_low: float = 0.4
    up_after: int = 2
    down_after: int = 3
    up_cooldown_s: float = 60.0  # since the role's last change, before an increase
    down_cooldown_s: float = 90.0  # since the role's last change, before a decrease
    max_step_down: float = 0.5  # a decrease removes at most this share of the (prefill) target
    lead_s: float = 120.0  # how far ahead the trend is followed: an instance's start, and a little more
    smoothing: float = 0.5  # weight of the newest demand in the level
    trend_points: int = 6  # observations the trend is fitted over
    queue_share: float = 0.1  # a predicted queue up to this share of the TTFT SLO is not backlog
    drain_s: float = 60.0  # backlog beyond it is drained within this long
    reject_share: float = 0.01  # a role's rejections above this share of arrivals ask for more of it
    attainment_goal: float = 0.95
    slack_margin: float = 0.02  # attainment this far above its goal lets prefill run hotter ...
    slack_step: float = 0.02  # ... by this much (its target and watermarks times 1 + step) per observation
    max_slack: float = 4.0  # a bound for safety: the attainment feedback is what holds it
    slack_min_ended: int = 20  # a window judging fewer requests than this moves no slack
    lost_hold_s: float = 60.0  # after a loss, the role's target is held this long

    def __post_init__(self) -> None:
        if not 0 <= self.min_prefill <= self.max_prefill or not 0 <= self.min_decode <= self.max_decode:
            raise ValueError("planner bounds need 0 <= min <= max per role")
        if self.max_total is not None and self.max_total < self.min_prefill + self.min_decode:
            raise ValueError("planner max_total is below the sum of the minimums")
        if not (0 < self.low < self.target < self.high and 0 < self.decode_low < self.decode_target < self.decode_high):
            raise ValueError("planner watermarks need 0 < low < target < high")
        if self.up_after < 1 or self.down_after < 1 or self.trend_points < 2 or self.interval_s <= 0:
            raise ValueError("planner streaks need >= 1 observation, the trend >= 2, the interval > 0")
        if not 0 < self.smoothing <= 1 or not 0 < self.max_step_down <= 1:
            raise ValueError("planner smoothing and max_step_down must be in (0, 1]")
        if self.max_slack < 1 or self.slack_step < 0:
            raise ValueError("planner max_slack must be >= 1 and slack_step >= 0")

    def bounds(self, role: str) -> tuple[int, int]:
        return (self.min_prefill, self.max_prefill) if role == "prefill" else (self.min_decode, self.max_decode)

    def watermarks(self, role: str, slack: float = 1.0) -> tuple[float, float, float]:
        """(low, target, high) of a role; prefill's times the slack the attainment allows."""
        if role == "prefill":
            return self.low * slack, self.target * slack, self.high * slack
        return self.decode_low, self.decode_target, self.decode_high


@dataclass(frozen=True)
class RoleCount:
    """A role's instances as the cluster state sees them at the observation."""

    count: int  # taking new work
    draining: int = 0  # finishing what they hold, taking nothing new
    lost: int = 0  # lost in the window (died, went silent): capacity gone, not load


@dataclass(frozen=True)
class Observation:
    """The window just past: what the conductor routed and what its cluster state holds now."""

    at: float
    window_s: float
    prefill: RoleCount
    decode: RoleCount
    arrivals: int = 0  # route requests (admitted or not)
    routed: int = 0  # admitted
    offered_work_s: float = 0.0  # predicted prefill seconds (work + pull) of every priced request
    routed_work_s: float = 0.0  # of those admitted
    queue_s: float = 0.0  # mean predicted queue at the prefill instance each priced request was given
    ttft_s: float = 0.0  # their mean predicted TTFT
    ttft_slo_s: float = 30.0
    kv_used: float | None = None  # share of the decode instances' KV room their requests hold now
    kv_flow: float | None = None  # share the window's admissions hold on average (Little's law)
    tbt_s: float = 0.0  # mean predicted TBT of the priced requests on their decode instance
    tbt_floor_s: float = 0.0  # an empty batch's step (the weights read): what no instance count removes
    tbt_slo_s: float = 0.1
    rejections: Mapping[str, int] = field(default_factory=dict)  # reason kind -> count (REASON_ROLES)
    attainment: float | None = None  # within both SLOs / ended, rejections counted as misses; None: unknown
    ended: int = 0  # requests the attainment counts

    def role(self, role: str) -> RoleCount:
        return self.prefill if role == "prefill" else self.decode

    def rejected(self, role: str) -> int:
        return sum(n for kind, n in self.rejections.items() if REASON_ROLES.get(kind, "") == role)

    def utilization(self, role: str) -> float:
        """Of the instances taking work: prefill, the predicted work routed to them / their time;
        decode, max(KV room used, TBT headroom used)."""
        if role == "prefill":
            return self.routed_work_s / (self.window_s * self.prefill.count) if self.prefill.count else 0.0
        tbt = 0.0
        if self.tbt_s > 0 and self.tbt_slo_s > self.tbt_floor_s:
            tbt = max(0.0, self.tbt_s - self.tbt_floor_s) / (self.tbt_slo_s - self.tbt_floor_s)
        return max(self.kv_used or 0.0, self.kv_flow or 0.0, tbt)

    def demand(self, role: str) -> float:
        """Instances' worth of work (see the module's docstring)."""
        if role == "prefill":  # the queue beyond the planner's allowance is added by `backlog`
            return self.offered_work_s / self.window_s if self.window_s > 0 else 0.0
        return self.utilization("decode") * self.decode.count

    def backlog(self, drain_s: float, queue_share: float) -> float:
        """Prefill instances that would drain the queue beyond queue_share x TTFT SLO within drain_s."""
        excess = max(0.0, self.queue_s - queue_share * self.ttft_slo_s)
        return excess * self.prefill.count / drain_s


@dataclass(frozen=True)
class Plan:
    """The targets after an observation, why, and what was seen."""

    at: float
    prefill: int
    decode: int
    previous_prefill: int
    previous_decode: int
    reasons: tuple[str, ...] = ()
    demand_prefill: float = 0.0  # instances' worth, as judged (forecast for increases)
    demand_decode: float = 0.0
    utilization_prefill: float = 0.0
    utilization_decode: float = 0.0
    lost_prefill: int = 0  # lost in the window: the driver replaces them; the target does not move
    lost_decode: int = 0
    attainment: float | None = None
    slack: float = 1.0  # prefill's target and watermarks are times this

    @property
    def changed(self) -> bool:
        return (self.prefill, self.decode) != (self.previous_prefill, self.previous_decode)

    @property
    def restores(self) -> bool:
        return bool(self.lost_prefill or self.lost_decode)

    def target(self, role: str) -> int:
        return self.prefill if role == "prefill" else self.decode

    def to_event(self) -> dict[str, Any]:
        """The `planned` event's data (schemas.events.Planned)."""
        return {"prefill": self.prefill, "decode": self.decode, "previous_prefill": self.previous_prefill,
                "previous_decode": self.previous_decode, "reasons": list(self.reasons),
                "demand_prefill": round(self.demand_prefill, 3), "demand_decode": round(self.demand_decode, 3),
                "utilization_prefill": round(self.utilization_prefill, 4),
                "utilization_decode": round(self.utilization_decode, 4),
                "lost_prefill": self.lost_prefill, "lost_decode": self.lost_decode,
                "attainment": None if self.attainment is None else round(self.attainment, 4),
                "slack": round(self.slack, 4)}


@dataclass
class _Role:
    target: int
    changed_at: float
    level: float | None = None
    history: deque = field(default_factory=deque)  # (at, level): what the trend is fitted to
    above: int = 0  # observations in a row asking for more
    below: int = 0  # observations in a row allowing fewer
    lost_at: float | None = None


class Planner:
    """Targets per role, changed by `decide` on each observation (see the module's docstring)."""

    def __init__(self, settings: PlannerSettings, prefill: int, decode: int, now: float = 0.0) -> None:
        self.settings = settings
        self.roles = {role: _Role(self._clamp(role, n), now - max(settings.up_cooldown_s, settings.down_cooldown_s))
                      for role, n in (("prefill", prefill), ("decode", decode))}
        self.starved = 0  # observations in a row below the attainment goal
        self.slack = 1.0  # prefill's target and watermarks are times this (see the module's docstring)

    def _clamp(self, role: str, n: int) -> int:
        lo, hi = self.settings.bounds(role)
        return min(hi, max(lo, n))

    def target(self, role: str) -> int:
        return self.roles[role].target

    def decide(self, obs: Observation) -> Plan:
        s, now = self.settings, obs.at
        before = {role: r.target for role, r in self.roles.items()}
        reasons: list[str] = []
        judged: dict[str, float] = {}
        ratios: dict[str, float] = {}
        held = set()
        poor = obs.attainment is not None and obs.attainment < s.attainment_goal
        if obs.attainment is not None and obs.ended >= s.slack_min_ended \
                and not any(obs.role(role).lost for role in ROLES):
            if poor:
                self.slack = max(1.0, self.slack * (1 - 2 * s.slack_step))
            elif obs.attainment >= s.attainment_goal + s.slack_margin:
                self.slack = min(s.max_slack, self.slack * (1 + s.slack_step))
        for role in ROLES:
            r = self.roles[role]
            lost = obs.role(role).lost
            if lost:
                r.lost_at = now
            if r.lost_at is not None and now - r.lost_at < s.lost_hold_s:
                held.add(role)
                r.above = r.below = 0
                judged[role] = r.level or 0.0
                if lost:
                    reasons.append(f"{role}: {lost} lost, target held at {r.target} (a death is not load: "
                                   "the driver replaces it)")
                continue
            demand = obs.demand(role)
            if role == "prefill":
                demand += obs.backlog(s.drain_s, s.queue_share)
            r.level = demand if r.level is None else s.smoothing * demand + (1 - s.smoothing) * r.level
            r.history.append((now, r.level))
            while len(r.history) > s.trend_points:
                r.history.popleft()
            forecast = max(0.0, r.level + _slope(r.history) * s.lead_s)
            rising, falling = max(r.level, forecast), max(r.level, demand, forecast)
            judged[role] = rising
            ratios[role] = rising / max(r.target, 1)
            low, target, high = s.watermarks(role, self.slack)
            ratios[role] /= high  # how near its high watermark, for the attainment rule
            rejected = obs.rejected(role)
            starved = rejected > s.reject_share * max(obs.arrivals, 1) and (poor or obs.attainment is None
                                                                          or role == "decode")
            r.above = r.above + 1 if (rising / max(r.target, 1) > high or starved) else 0
            r.below = r.below + 1 if (falling / max(r.target, 1) < low and not starved and not poor) else 0
            since = now - r.changed_at
            if r.above >= s.up_after:
                if since < s.up_cooldown_s:
                    continue
                needed = math.ceil(rising / target - 1e-9)
                new = self._clamp(role, max(needed, r.target + 1))
                ratio = rising / max(r.target, 1)
                why = (f"rejections {rejected}/{obs.arrivals}" if starved and ratio <= high else
                       f"demand {rising:.2f} is {ratio:.2f} of {r.target} > {high:.3g}")
                self._move(role, new, now, reasons, f"{why} for {r.above} observations")
            elif r.below >= s.down_after:
                if since < s.down_cooldown_s:
                    continue
                needed = math.ceil(falling / target - 1e-9)
                step = max(1, math.floor(r.target * s.max_step_down)) if role == "prefill" else 1
                new = self._clamp(role, max(needed, r.target - step))
                self._move(role, new, now, reasons,
                           f"demand {falling:.2f} is {falling / max(r.target, 1):.2f} of {r.target} < {low:.3g} "
                           f"for {r.below} observations")
        self._attainment(obs, before, held, ratios, reasons)
        self._cap_total(before, reasons)
        return Plan(now, self.roles["prefill"].target, self.roles["decode"].target, before["prefill"],
                    before["decode"], tuple(reasons), judged.get("prefill", 0.0), judged.get("decode", 0.0),
                    obs.utilization("prefill"), obs.utilization("decode"), obs.prefill.lost, obs.decode.lost,
                    obs.attainment, self.slack)

    def _move(self, role: str, new: int, now: float, reasons: list[str], why: str) -> None:
        r = self.roles[role]
        if new == r.target:
            return
        reasons.append(f"{role} {r.target} -> {new}: {why}")
        r.target, r.changed_at, r.above, r.below = new, now, 0, 0

    def _attainment(self, obs: Observation, before: dict[str, int], held: set[str], ratios: dict[str, float],
                    reasons: list[str]) -> None:
        """Attainment below its goal with neither role raised: the role nearer its high watermark goes up."""
        s = self.settings
        if obs.attainment is None or obs.attainment >= s.attainment_goal or held or not ratios:
            self.starved = 0
            return
        if any(self.roles[role].target > before[role] for role in ROLES):
            self.starved = 0
            return
        self.starved += 1
        if self.starved < s.up_after:
            return
        role = max(ratios, key=lambda name: (ratios[name], name == "prefill"))
        r = self.roles[role]
        if obs.at - r.changed_at < s.up_cooldown_s:
            return
        self._move(role, self._clamp(role, r.target + 1), obs.at, reasons,
                   f"attainment {obs.attainment:.3f} < {s.attainment_goal:g} for {self.starved} observations")
        self.starved = 0

    def _cap_total(self, before: dict[str, int], reasons: list[str]) -> None:
        cap = self.settings.max_total
        if cap is None:
            return
        over = sum(r.target for r in self.roles.values()) - cap
        for role in ROLES:  # the roles that grew give back first
            if over <= 0:
                return
            r = self.roles[role]
            give = min(over, max(0, r.target - before[role]))
            if give:
                r.target -= give
                over -= give
                reasons.append(f"{role} cut to {r.target}: prefill + decode capped at {cap}")


def _slope(points: deque) -> float:
    """Least-squares slope of (time, demand) points, per second; 0 with fewer than two."""
    n = len(points)
    if n < 2:
        return 0.0
    mt = sum(t for t, _ in points) / n
    md = sum(d for _, d in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    return sum((t - mt) * (d - md) for t, d in points) / var if var > 0 else 0.0


# --------------------------------------------------------------------------- the observation


def reason_kind(status: int, reason: str) -> str:
    """A route's refusal as a kind of REASON_ROLES (429 ttft -> "ttft", a KV room overload -> "kv
    room", a 429 while an instance is being restarted -> "recovering": lost capacity, not load)."""
    text = reason.lower()
    if "being restarted" in text:
        return "recovering"
    if status == 400:
        return "too large"
    if "kv room" in text:
        return "kv room"
    text = text.removeprefix("rejected at arrival: ")
    for kind in ("ttft", "tbt", "no prefill", "no decode"):
        if text.startswith(kind):
            return kind
    return "other"


class PlannerWindow:
    """What one window held: the caller's route outcomes, late rejections, requests ended and
    instances lost, fed as they happen; `observe` adds the cluster state's view and starts a new window."""

    def __init__(self, start: float, admit: AdmissionSettings) -> None:
        self.start = start
        self.admit = admit
        self._reset()

    def _reset(self) -> None:
        self.arrivals = self.routed_count = self.priced = 0
        self.offered_s = self.routed_s = self.queue_sum = self.ttft_sum = self.tbt_sum = 0.0
        self.tbt_priced = 0
        self.joining: list[tuple[int, int, int]] = []  # admitted ones that will decode: (reservation, max, hint)
        self.rejections: dict[str, int] = {}
        self.met = self.ended_count = 0
        self.lost_count = {role: 0 for role in ROLES}

    def routed(self, outcome, prompt_tokens: int = 0, max_tokens: int = 0, expected_tokens: int = 0) -> None:
        """A route's outcome (common.decide.route.RouteOutcome), admitted or not, and its request's
        prompt, max_tokens and output hint (for the KV room it will hold at decode)."""
        self.arrivals += 1
        decision = outcome.decision
        if decision is not None and not outcome.admitted \
                and decision.prefill_s + decision.transfer_s > self.admit.ttft_slo_s:
            self.reject("too long")  # its prefill alone breaks the SLO: no demand an instance would serve
            return
        if decision is not None:
            work = decision.prefill_s + decision.transfer_s
            self.priced += 1
            self.offered_s += work
            self.queue_sum += decision.queue_s
            self.ttft_sum += decision.ttft_s
            verdict = outcome.verdict
            tbt = verdict.tbt_s if verdict is not None and verdict.tbt_s > 0 else decision.tbt_s
            if tbt > 0:
                self.tbt_sum += tbt
                self.tbt_priced += 1
            if outcome.admitted:
                self.routed_s += work
        if outcome.admitted:
            self.routed_count += 1
            if max_tokens > 1:
                self.joining.append((prompt_tokens + max_tokens, max_tokens, expected_tokens))
        else:
            self.reject(reason_kind(outcome.status, outcome.reason))

    def reject(self, kind: str) -> None:
        """A rejection by kind (REASON_ROLES): at arrival (from `routed`) or late."""
        self.rejections[kind] = self.rejections.get(kind, 0) + 1

    def ended(self, met: bool) -> None:
        """A request that ran ended (met: within both SLOs, as far as the caller knows)."""
        self.ended_count += 1
        self.met += met

    def lost(self, role: str) -> None:
        if role in self.lost_count:
            self.lost_count[role] += 1

    def observe(self, state: ClusterState, now: float, perf: Profile) -> Observation:
        admit = self.admit
        counts = {role: [0, 0] for role in ROLES}  # taking work, draining
        for role in ROLES:
            counts[role][0] = len(state.of_role(role))
        for known in state.instances.values():
            if known.info.role in counts and known.info.draining:
                counts[known.info.role][1] += 1
        # KV room as the decode instances report it, held (what routed requests will reserve when
        # their prefill ends is not counted: a prefill backlog would look like decode load)
        used = room = 0
        candidates = state.decode_candidates(now)
        for c in candidates:
            report = state.get(c.instance_id).decode
            if report is None or report.kv_free_tokens is None:
                continue
            room += report.kv_used_tokens + report.kv_free_tokens
            used += report.kv_used_tokens
        tbt = self.tbt_sum / self.tbt_priced if self.tbt_priced else 0.0
        if not self.tbt_priced and candidates:  # nothing priced: the batches as they are
            tbt = sum(perf.decode.step_seconds(max(1, c.num_running), c.context_tokens) * c.step_factor
                      for c in candidates) / len(candidates)
        window_s = max(now - self.start, 1e-9)
        remaining = state.outputs.remaining
        step_s = max(tbt, perf.decode.step_seconds(1, 0))
        token_s = sum(room * remaining(1, most, hint) * step_s for room, most, hint in self.joining)
        rejected = sum(self.rejections.values())
        judged = self.ended_count + rejected
        obs = Observation(
            now, window_s,
            RoleCount(counts["prefill"][0], counts["prefill"][1], self.lost_count["prefill"]),
            RoleCount(counts["decode"][0], counts["decode"][1], self.lost_count["decode"]),
            self.arrivals, self.routed_count, self.offered_s, self.routed_s,
            self.queue_sum / self.priced if self.priced else 0.0, self.ttft_sum / self.priced if self.priced else 0.0,
            admit.ttft_slo_s, used / room if room else None, token_s / window_s / room if room else None, tbt,
            perf.decode.step_seconds(1, 0), admit.tbt_slo_s,
            dict(self.rejections), self.met / judged if judged > 0 else None, judged)
        self.start = now
        self._reset()
        return obs
