"""common.decide.planner: how many prefill and decode instances the load needs, with bounds,
cooldowns, hysteresis, and deaths kept apart from load; and the observation it decides on, built
from the cluster state the router reads."""

from __future__ import annotations

from dataclasses import replace

import pytest

from common.decide.admission import AdmissionSettings, Verdict
from common.decide.cluster_state import ClusterState, Routed
from common.decide.perf import HARDWARE_PRESETS, MODEL_PRESETS, analytic_profile
from common.decide.planner import (Observation, Plan, Planner, PlannerSettings, PlannerWindow, RoleCount,
                                   reason_kind)
from common.decide.route import RouteOutcome
from schemas.events import PLANNED, PLANNED_ALL, Planned, planned_subject
from schemas.workers import DecodeReport, PrefillReport, WorkerInfo

WINDOW = 30.0
SETTINGS = PlannerSettings(min_prefill=1, max_prefill=20, min_decode=1, max_decode=20, up_after=2, down_after=3,
                           up_cooldown_s=60.0, down_cooldown_s=120.0, lead_s=0.0, interval_s=WINDOW,
                           low=0.55, target=0.8, high=0.9, decode_low=0.55, decode_target=0.8, decode_high=0.9,
                           max_step_down=0.25)


def obs(at, prefill=4, decode=2, demand=3.2, kv=0.5, lost=(0, 0), rejections=None, arrivals=100,
        attainment=None, queue_s=0.0) -> Observation:
    """An observation whose prefill demand is `demand` instances' worth and decode KV use `kv`."""
    return Observation(at, WINDOW, RoleCount(prefill, lost=lost[0]), RoleCount(decode, lost=lost[1]), arrivals,
                       arrivals, demand * WINDOW, demand * WINDOW, queue_s=queue_s, ttft_s=1.0, ttft_slo_s=30.0,
                       kv_used=kv, tbt_s=0.0, tbt_floor_s=0.011, tbt_slo_s=0.1, rejections=rejections or {},
                       attainment=attainment, ended=arrivals)


def run(planner, observations) -> list[Plan]:
    return [planner.decide(o) for o in observations]


def test_a_load_between_the_watermarks_changes_nothing():
    planner = Planner(SETTINGS, 4, 2)
    plans = run(planner, [obs(t * WINDOW, demand=3.0, kv=0.5) for t in range(1, 10)])
    assert not any(p.changed for p in plans)
    assert (planner.target("prefill"), planner.target("decode")) == (4, 2)


def test_more_instances_only_after_enough_observations_above_the_high_watermark():
    planner = Planner(SETTINGS, 4, 2)
    first = planner.decide(obs(30.0, demand=6.0))
    assert not first.changed  # one observation is a blip
    second = planner.decide(obs(60.0, demand=6.0))
    assert second.prefill == 8  # ceil(6 / 0.8)
    assert second.previous_prefill == 4 and second.changed
    assert second.reasons and second.reasons[0].startswith("prefill 4 -> 8: demand 6.00 is 1.50 of 4 > 0.9")


def test_fewer_instances_only_after_enough_observations_below_the_low_watermark_and_gently():
    planner = Planner(SETTINGS, 16, 2)
    plans = run(planner, [obs(t * WINDOW, prefill=16, demand=2.0) for t in range(1, 4)])
    assert [p.prefill for p in plans] == [16, 16, 12]  # at most a quarter at a time
    assert "prefill 16 -> 12" in plans[-1].reasons[0]


def test_a_role_waits_its_cooldown_after_a_change():
    planner = Planner(replace(SETTINGS, up_after=1), 4, 2)
    assert planner.decide(obs(30.0, demand=6.0)).prefill == 8
    plans = run(planner, [obs(60.0, prefill=8, demand=12.0), obs(90.0, prefill=8, demand=12.0)])
    assert [p.prefill for p in plans] == [8, 14]  # an increase waits up_cooldown_s (60 s) since the last change
    plans = run(planner, [obs(t, prefill=14, demand=1.0) for t in (120.0, 150.0, 180.0, 210.0)])
    assert [p.prefill for p in plans] == [14, 14, 14, 11]  # a decrease waits down_cooldown_s (120 s): 210


def test_targets_stay_within_the_bounds_and_the_total_cap():
    settings = replace(SETTINGS, min_prefill=2, max_prefill=10, min_decode=2, max_decode=6, max_total=12,
                       up_after=1)
    planner = Planner(settings, 1, 1)
    assert (planner.target("prefill"), planner.target("decode")) == (2, 2)
    plan = planner.decide(obs(30.0, prefill=2, decode=2, demand=50.0, kv=3.0))
    assert plan.decode == 6  # its maximum (ceil(3 x 2 / 0.8) = 8 asked)
    assert plan.prefill == 6  # 10 asked, cut so that prefill + decode <= 12
    assert any("capped at 12" in r for r in plan.reasons)


def test_a_lost_instance_holds_its_roles_target_and_is_not_taken_for_load():
    planner = Planner(SETTINGS, 4, 2)
    # a prefill instance died: the survivors' queues and the requests handed back look like load
    plans = run(planner, [obs(30.0, prefill=3, demand=7.0, lost=(1, 0), queue_s=20.0),
                          obs(60.0, prefill=3, demand=7.0, queue_s=20.0)])
    assert [p.prefill for p in plans] == [4, 4]
    assert plans[0].lost_prefill == 1 and plans[0].restores and not plans[0].changed
    assert "1 lost, target held at 4" in plans[0].reasons[0]
    # nor is the smaller count a reason for fewer, and the decode role is judged as usual
    assert plans[1].decode == 2
    # after the hold (60 s), load is load again
    plans = run(planner, [obs(t, prefill=4, demand=7.0) for t in (90.0, 120.0)])
    assert [p.prefill for p in plans] == [4, 9]


def test_rejections_for_a_roles_capacity_ask_for_more_of_it_and_others_do_not():
    planner = Planner(SETTINGS, 4, 2)
    plans = run(planner, [obs(t, demand=3.0, rejections={"ttft": 5}) for t in (30.0, 60.0)])
    assert plans[-1].prefill == 5 and plans[-1].decode == 2
    assert "rejections 5/100" in plans[-1].reasons[0]
    other = Planner(SETTINGS, 4, 2)  # prompts too long for the SLO, and restarts, are no instance count's to fix
    plans = run(other, [obs(t, demand=3.0, rejections={"too long": 9, "recovering": 9}) for t in (30.0, 60.0)])
    assert not any(p.changed for p in plans)


def test_a_rising_demand_is_followed_ahead_by_its_trend():
    settings = replace(SETTINGS, max_prefill=40, lead_s=120.0)
    ahead, behind = Planner(settings, 4, 2), Planner(replace(settings, lead_s=0.0), 4, 2)
    demands = [3.0, 4.0, 5.0]  # +1 instance's worth every 30 s
    ahead_plans = run(ahead, [obs((i + 1) * WINDOW, demand=d) for i, d in enumerate(demands)])
    behind_plans = run(behind, [obs((i + 1) * WINDOW, demand=d) for i, d in enumerate(demands)])
    assert ahead_plans[-1].prefill > behind_plans[-1].prefill
    assert ahead_plans[-1].demand_prefill > 5.0  # the level plus 4 more (120 s of the trend)


def test_decode_demand_is_its_kv_room_or_tbt_headroom_used():
    o = Observation(0.0, WINDOW, RoleCount(4), RoleCount(4), tbt_s=0.0555, tbt_floor_s=0.011, tbt_slo_s=0.1,
                    kv_used=0.3)
    assert o.utilization("decode") == pytest.approx(0.5)  # (55.5 - 11) / (100 - 11)
    assert o.demand("decode") == pytest.approx(2.0)
    planner = Planner(SETTINGS, 4, 2)
    plans = run(planner, [obs(t, decode=2, kv=1.4) for t in (30.0, 60.0)])  # 2.8 instances' worth of KV
    assert plans[-1].decode == 4  # ceil(2.8 / 0.8)


def test_attainment_below_its_goal_raises_the_role_nearest_its_watermark():
    planner = Planner(SETTINGS, 4, 2)
    plans = run(planner, [obs(t, demand=3.4, kv=0.5, attainment=0.8) for t in (30.0, 60.0)])
    assert (plans[-1].prefill, plans[-1].decode) == (5, 2)  # prefill at 0.85 of its target, decode at 0.5
    assert "attainment 0.800 < 0.95" in plans[-1].reasons[0]
    low = Planner(SETTINGS, 16, 2)  # nor does a poor attainment let a role shrink
    plans = run(low, [obs(t, prefill=16, demand=2.0, attainment=0.9) for t in (30.0, 60.0, 90.0, 120.0)])
    assert all(p.prefill == 16 for p in plans)


def test_settings_that_cannot_work_are_refused():
    with pytest.raises(ValueError):
        PlannerSettings(low=0.9, target=0.8, high=0.95)
    with pytest.raises(ValueError):
        PlannerSettings(min_prefill=5, max_prefill=4)
    with pytest.raises(ValueError):
        PlannerSettings(min_prefill=4, min_decode=4, max_total=6)


def test_a_plan_is_the_planned_event_a_driver_decodes():
    planner = Planner(SETTINGS, 4, 2)
    plan = run(planner, [obs(30.0, demand=6.0), obs(60.0, demand=6.0)])[-1]
    planned = Planned.from_dict(plan.to_event())
    assert (planned.prefill, planned.decode, planned.previous_prefill) == (8, 2, 4)
    assert planned.reasons == list(plan.reasons)
    assert planned_subject("c0") == "moonbus.events.instance.planned.c0" and PLANNED == "planned"
    assert PLANNED_ALL == "moonbus.events.instance.planned.*"


@pytest.mark.parametrize("status,reason,kind", [
    (429, "rejected at arrival: ttft 41.9s > slo 30s", "ttft"),
    (429, "rejected at arrival: tbt 0.2s on d0 now > slo 0.1s", "tbt"),
    (429, "rejected at arrival: no decode instance has KV room for the prompt", "kv room"),
    (429, "rejected at arrival: no prefill instance while one is being restarted", "recovering"),
    (503, "no decode instance is available", "no decode"),
    (400, "the request needs 9 KV tokens", "too large"),
])
def test_refusals_are_told_apart_by_the_capacity_they_lacked(status, reason, kind):
    assert reason_kind(status, reason) == kind


# --- the observation, from the cluster state ------------------------------------------------------

PERF = analytic_profile(MODEL_PRESETS["llama3-70b"], HARDWARE_PRESETS["8xA800"])


class _Decision:
    def __init__(self, prefill_s, queue_s, tbt_s=0.02, reason="kvcache-centric"):
        self.prefill_s, self.transfer_s, self.queue_s, self.ttft_s, self.tbt_s = prefill_s, 0.0, queue_s, \
            queue_s + prefill_s, tbt_s
        self.reason = reason


def outcome(status=200, reason="ok", prefill_s=1.0, queue_s=2.0, priced=True) -> RouteOutcome:
    decision = _Decision(prefill_s, queue_s) if priced else None
    verdict = Verdict(status == 200, reason, tbt_s=0.03) if priced else None
    return RouteOutcome(status, reason, decision=decision, verdict=verdict)


def test_the_observation_is_built_from_the_cluster_state_and_the_windows_routes():
    perf = PERF
    state = ClusterState(timeout_s=3.0, lease_s=100.0, perf=perf)
    state.heard(WorkerInfo("p0", "prefill", "n0", prefill=PrefillReport(2.0, 0, 0)), 0.0)
    state.heard(WorkerInfo("p1", "prefill", "n1", prefill=PrefillReport(0.0, 0, 0)), 0.0)
    state.heard(WorkerInfo("p2", "prefill", "n2", draining=True, prefill=PrefillReport(0.0, 0, 0)), 0.0)
    state.heard(WorkerInfo("d0", "decode", "n3", decode=DecodeReport(0, 0, 300, 700, 0.01)), 0.0)
    state.heard(WorkerInfo("d1", "decode", "n4", decode=DecodeReport(0, 0, 100, 900, 0.01)), 0.0)
    # one of our requests is on its way to d1: the room it will reserve is not decode's load yet
    state.route(Routed("r9", ("p0",), "d1", "reply", 150, 0.0, 1.0, 3.0, max_tokens=50))
    window = PlannerWindow(0.0, AdmissionSettings("predictive", 30.0, 0.1))
    window.routed(outcome(prefill_s=1.5, queue_s=2.0), 100, 50)  # it will hold 150 tokens for 49 steps
    window.routed(outcome(prefill_s=0.5, queue_s=4.0), 100, 1)  # it ends with its first token
    window.routed(outcome(429, "rejected at arrival: ttft 31s > slo 30s", prefill_s=2.0, queue_s=29.0))
    window.routed(outcome(429, "rejected at arrival: ttft 45s > slo 30s", prefill_s=45.0, queue_s=0.0))
    window.routed(outcome(503, "no decode instance is available", priced=False))
    window.ended(True)
    window.ended(False)
    window.lost("decode")
    o = window.observe(state, 10.0, perf)
    assert (o.prefill.count, o.prefill.draining, o.decode.count, o.decode.lost) == (2, 1, 2, 1)
    assert (o.arrivals, o.routed, o.window_s) == (5, 2, 10.0)
    assert o.offered_work_s == pytest.approx(4.0)  # the two routed and the one a queue rejected; not the 45 s prompt
    assert o.routed_work_s == pytest.approx(2.0)
    assert o.queue_s == pytest.approx((2.0 + 4.0 + 29.0) / 3)
    assert o.rejections == {"ttft": 1, "too long": 1, "no decode": 1}
    assert o.kv_used == pytest.approx((300 + 100) / 2000)
    assert o.kv_flow == pytest.approx(150 * 49 * 0.03 / 10.0 / 2000)  # Little's law: held for 49 steps of 30 ms
    assert o.tbt_s == pytest.approx(0.03)
    assert o.attainment == pytest.approx(1 / 5)  # 1 met of 2 ended and 3 rejected
    assert o.utilization("prefill") == pytest.approx(2.0 / (10.0 * 2))
    again = window.observe(state, 40.0, perf)  # a new window starts empty
    assert (again.arrivals, again.window_s, again.decode.lost, again.attainment) == (0, 30.0, 0, None)


# --- the conductor's loop --------------------------------------------------------------------------


class _Events:
    def __init__(self):
        self.published = []

    async def instance(self, kind, instance_id, /, **data):
        self.published.append((kind, instance_id, data))


def test_the_conductors_loop_publishes_a_planned_event_when_a_target_changes_and_sets_its_gauges():
    import asyncio

    from prometheus_client import CollectorRegistry

    from services.conductor.planner_loop import PlannerLoop

    state = ClusterState(timeout_s=3.0, lease_s=100.0, perf=PERF)
    events, registry = _Events(), CollectorRegistry()
    loop = PlannerLoop(replace(SETTINGS, up_after=1), state, PERF, AdmissionSettings("predictive", 30.0, 0.1),
                       events, "c0", registry, now=0.0)
    state.heard(WorkerInfo("p0", "prefill", "n0", prefill=PrefillReport(0.0, 0, 0)), 0.0)
    assert asyncio.run(loop.tick(0.0)) is None and loop.planner is None  # no decode instance yet: it waits
    state.heard(WorkerInfo("p1", "prefill", "n2", prefill=PrefillReport(0.0, 0, 0)), 0.0)
    state.heard(WorkerInfo("d0", "decode", "n1", decode=DecodeReport(0, 0, 0, 1000, 0.01)), 0.0)
    assert asyncio.run(loop.tick(0.0)) is None  # the first tick that finds both roles takes the counts it finds
    assert (loop.planner.target("prefill"), loop.planner.target("decode")) == (2, 1)
    for _ in range(30):  # 30 s of 2 s of prefill work each: 2 instances' worth
        loop.routed(outcome(prefill_s=2.0, queue_s=0.0))
    plan = asyncio.run(loop.tick(30.0))
    assert plan.prefill == 3 and plan.decode == 1  # ceil(2 / 0.8)
    [(kind, conductor, data)] = events.published
    assert (kind, conductor) == ("planned", "c0")
    assert Planned.from_dict(data).prefill == 3
    assert registry.get_sample_value("moonbus_conductor_planned_instances", {"role": "prefill"}) == 3
    assert registry.get_sample_value("moonbus_conductor_planner_changes_total", {"role": "prefill",
                                                                                 "direction": "up"}) == 1
    loop.lost("decode")  # a death is published too (the driver replaces it), with the targets unchanged
    plan = asyncio.run(loop.tick(60.0))
    assert not plan.changed and plan.lost_decode == 1 and len(events.published) == 2
    assert asyncio.run(loop.tick(90.0)).restores is False and len(events.published) == 2


def test_while_attainment_stays_above_its_goal_prefill_runs_hotter_and_below_it_backs_off():
    planner = Planner(SETTINGS, 4, 2)
    plans = run(planner, [obs(t * WINDOW, demand=3.0, attainment=0.99) for t in range(1, 40)])
    assert plans[0].slack == pytest.approx(1.02) and plans[-1].slack > 1.5
    assert plans[-1].prefill < 4  # the same demand, served hotter
    assert plans[-1].decode == 2  # decode's KV room is a wall: no slack there
    slack, serving = plans[-1].slack, plans[-1].prefill
    poor = run(planner, [obs(t * WINDOW, prefill=serving, demand=3.0, attainment=0.9) for t in range(40, 43)])
    assert poor[0].slack == pytest.approx(slack * 0.96) and poor[-1].slack < poor[0].slack
    assert all(p.prefill >= serving for p in poor)  # and a poor attainment never lets a role shrink


def test_a_decrease_keeps_what_a_rising_trend_will_need():
    settings = replace(SETTINGS, lead_s=120.0, max_step_down=1.0)
    rising, flat = Planner(settings, 16, 2), Planner(settings, 16, 2)
    up = run(rising, [obs(t * WINDOW, prefill=16, demand=d) for t, d in ((1, 4.0), (2, 5.0), (3, 6.0))])
    level = run(flat, [obs(t * WINDOW, prefill=16, demand=6.0) for t in (1, 2, 3)])
    assert level[-1].prefill == 8  # ceil(6 / 0.8)
    assert up[-1].prefill == 10  # the level (5.25) and its trend 120 s ahead (7.75): ceil(7.75 / 0.8)


def test_decode_gives_back_one_instance_at_a_time():
    planner = Planner(SETTINGS, 4, 8)
    plans = run(planner, [obs(t * WINDOW, decode=8, demand=3.2, kv=0.05) for t in range(1, 4)])
    assert [p.decode for p in plans] == [8, 8, 7]
