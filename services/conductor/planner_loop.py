"""The conductor's planner loop (off by default; `--planner` turns it on).

Every `--planner-interval` seconds it observes the window just past: its own route outcomes
(predicted prefill work offered and routed, predicted queues, TTFTs and TBTs, rejections by
reason), the first tokens it saw against the TTFT SLO (its attainment: TTFT only, rejections as
misses; the TBT is the gateway's to measure), the instances it saw die, and its ClusterState's
instances and KV room (common.decide.planner.PlannerWindow, the code the simulator runs too). The
planner (common.decide.planner.Planner: bounds, cooldowns, hysteresis, deaths held apart from
load) decides, the gauges show the targets, and each decision that changes a target or restores
a lost instance is published as an audited `planned` event:

    subject   moonbus.events.instance.planned.<conductor id>   (schemas.events.PLANNED_ALL: all)
    data      schemas.events.Planned: prefill, decode (targets: instances taking work),
              previous_prefill, previous_decode, reasons (one short sentence each),
              demand_*, utilization_* (instances' worth, shares), lost_* (replace these; the
              targets did not move for them), attainment

A driver acts on it: it starts or drains workers until it runs `prefill` and `decode` of each
(`moonbus up --autoscale`'s supervisor, or `docker service scale` on a swarm), and restarts
the lost. The planner starts from the counts it finds at the first tick that finds an instance of
each role (a conductor starts before its workers have joined: starting from none would be starting
from the minimums), and decides from the next tick on.
Run it on one conductor only: replicas share the routes, so each sees only its share of the demand.
"""

from __future__ import annotations

import logging
import time

from prometheus_client import Counter, Gauge

from common.decide.admission import AdmissionSettings
from common.decide.cluster_state import ClusterState, Routed
from common.decide.perf import Profile
from common.decide.planner import ROLES, Plan, Planner, PlannerSettings, PlannerWindow
from schemas.events import PLANNED

log = logging.getLogger(__name__)


class PlannerLoop:
    def __init__(self, settings: PlannerSettings, state: ClusterState, perf: Profile, admit: AdmissionSettings,
                 events, conductor_id: str, registry, now: float | None = None) -> None:
        self.settings = settings
        self.state = state
        self.perf = perf
        self.admit = admit
        self.events = events
        self.conductor_id = conductor_id
        self.window = PlannerWindow(time.monotonic() if now is None else now, admit)
        self.planner: Planner | None = None  # made at the first tick, from the instances found
        self.targets = Gauge("moonbus_conductor_planned_instances", "the planner's target per role (instances "
                             "taking work)", ["role"], registry=registry)
        self.demand = Gauge("moonbus_conductor_planner_demand", "instances' worth of work the planner judged, per role",
                            ["role"], registry=registry)
        self.utilization = Gauge("moonbus_conductor_planner_utilization", "busy share of a role's instances in the "
                                 "planner's last window (prefill: predicted work routed; decode: KV room or TBT "
                                 "headroom used)", ["role"], registry=registry)
        self.changes = Counter("moonbus_conductor_planner_changes", "the planner's target changes by role and "
                               "direction", ["role", "direction"], registry=registry)

    # --- what the conductor tells it, as it happens --------------------------------------------------

    def routed(self, outcome, prompt_tokens: int = 0, max_tokens: int = 0, expected_tokens: int = 0) -> None:
        self.window.routed(outcome, prompt_tokens, max_tokens, expected_tokens)

    def lost(self, role: str) -> None:
        self.window.lost(role)

    def prefilled(self, request: Routed | None, attempt: int, now: float) -> None:
        """A first token: within the TTFT SLO or not (measured from the route, as the conductor can)."""
        if request is not None and request.attempt == attempt and not request.prefilled:
            self.window.ended(now - request.routed_at <= self.admit.ttft_slo_s)

    def unstarted(self) -> None:
        """Its prefill instance found it could no longer meet the TTFT SLO: a miss, for want of prefill."""
        self.window.reject("ttft")

    # --- the loop ------------------------------------------------------------------------------------

    async def tick(self, now: float | None = None) -> Plan | None:
        now = time.monotonic() if now is None else now
        if self.planner is None:
            counts = {role: len(self.state.of_role(role)) for role in ROLES}
            if not all(counts.values()):  # the workers have not joined yet
                self.window = PlannerWindow(now, self.admit)
                return None
            self.planner = Planner(self.settings, counts["prefill"], counts["decode"], now)
            self.window = PlannerWindow(now, self.admit)
            for role in ROLES:
                self.targets.labels(role).set(self.planner.target(role))
            log.info("planner: starting from %d prefill and %d decode instances (targets %d and %d)",
                     counts["prefill"], counts["decode"], self.planner.target("prefill"), self.planner.target("decode"))
            return None
        plan = self.planner.decide(self.window.observe(self.state, now, self.perf))
        for role in ROLES:
            self.targets.labels(role).set(plan.target(role))
            self.demand.labels(role).set(plan.demand_prefill if role == "prefill" else plan.demand_decode)
            self.utilization.labels(role).set(plan.utilization_prefill if role == "prefill" else plan.utilization_decode)
            before = plan.previous_prefill if role == "prefill" else plan.previous_decode
            if plan.target(role) != before:
                self.changes.labels(role, "up" if plan.target(role) > before else "down").inc()
        if plan.changed or plan.restores:
            log.info("planner: %d prefill, %d decode: %s", plan.prefill, plan.decode, "; ".join(plan.reasons))
            await self.events.instance(PLANNED, self.conductor_id, **plan.to_event())
        return plan
