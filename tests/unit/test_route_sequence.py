"""One route sequence (common/decide/route.py): the live conductor, the simulator and the conductor
bench all route through it, so the same reports and the same request get the same decision from
each: prefix, snapshot, decide, judge, record, the 400 for a request no instance could hold, and the
429 / 503 split."""

from __future__ import annotations

import copy

import pytest

from common.decide import route as routing
from common.decide.index import KvEvent
from common.decide.route import ToRoute, route
from schemas.workers import WorkerInfo
from services.conductor import service as conductor
from tools.moonbus.bench import conductor as bench
from tools.sim import SimConfig, build_profile
from tools.sim import engine as sim_engine
from tools.sim.request import SimRequest

PROFILE, EXTRAS = build_profile("llama3-70b", "8xa800")


class Draw:
    """The policy's random draw, the same for every caller."""

    def random(self) -> float:
        return 0.37

    def choice(self, seq):
        return seq[0]


def make_sim(decode_kv_tokens: int | None = None, admission: str = "predictive") -> sim_engine.Simulator:
    cfg = SimConfig(**(EXTRAS | dict(prefill=2, decode=2, admission=admission, profile=PROFILE, ttft_slo_s=5.0,
                                     tbt_slo_s=0.2, decode_kv_tokens=decode_kv_tokens)))
    sim = sim_engine.Simulator([], cfg, PROFILE)
    sim.rng = Draw()
    keys = [101, 102, 103, 104]
    sim.index.apply(KvEvent("p1", 1, "stored", tuple(keys[:3]), "dram"))  # p1 holds a prefix
    sim.report(0.0)
    return sim


def three_ways(sim: sim_engine.Simulator, request: SimRequest, monkeypatch) -> list[routing.RouteOutcome]:
    """The request routed by the simulator, by the bench's route, and by route() as the conductor
    calls it, each on its own copy of the same state."""
    states = [copy.deepcopy(sim.state) for _ in range(2)]
    seen = []

    def spy(*args, **kwargs):
        outcome = route(*args, **kwargs)
        seen.append(outcome)
        return outcome

    monkeypatch.setattr(sim_engine, "route", spy)
    sim.on_arrive(request, 0.0)
    to_route = ToRoute(str(request.index), request.keys, request.input_tokens, request.max_tokens)
    queued = {node: nic.queued_bytes(0.0) for node, nic in sim.nics.items()}
    live = route(to_route, sim.index, states[0], 0.0, sim.policy, sim.admission, sim.perf, Draw().random(), queued)
    query = bench.Query(bench.RequestInfo(str(request.index), request.input_tokens, len(request.keys)), request.keys)
    monkeypatch.setattr(bench, "route", lambda to, *a, **k: route(
        ToRoute(to.request_id, to.keys, to.prompt_tokens, request.max_tokens), *a, **k | {"queued": queued}))
    _, benched = bench._decide_once(sim.index, query, bench.State(0.0, states[1], Draw()), sim.policy,
                                    sim.admission, sim.perf, reports=0)
    return [seen[0], live, benched]


def summary(outcome: routing.RouteOutcome) -> tuple:
    d = outcome.decision
    return (outcome.status, outcome.reason, d and (d.prefill_id, d.decode_id, d.prefix_blocks, round(d.ttft_s, 9)))


def test_the_conductor_routes_through_the_shared_sequence():
    assert conductor.routing.route is route


def test_an_admitted_request_gets_the_same_route_from_all_three(monkeypatch):
    sim = make_sim()
    request = SimRequest(0, 0.0, 4 * 512, 40, [101, 102, 103, 104], 64)
    outcomes = three_ways(sim, request, monkeypatch)
    assert len({summary(o) for o in outcomes}) == 1, [summary(o) for o in outcomes]
    sim_outcome = outcomes[0]
    assert sim_outcome.admitted and sim_outcome.decision.prefill_id == "p1"  # where its prefix is
    assert sim_outcome.decision.prefix_blocks == 3
    assert "0" in sim.state.routed  # recorded: its prefill's queue and the decode load it brings


@pytest.mark.parametrize("case, kv_tokens, max_tokens, status", [
    ("too large for any decode instance", 3000, 4000, 400),
    ("fits an empty decode instance", 3000, 100, 200),
])
def test_refusals_are_the_same_from_all_three(monkeypatch, case, kv_tokens, max_tokens, status):
    sim = make_sim(decode_kv_tokens=kv_tokens)
    request = SimRequest(1, 0.0, 2 * 512, 10, [201, 202], max_tokens)
    outcomes = three_ways(sim, request, monkeypatch)
    assert len({summary(o) for o in outcomes}) == 1, [summary(o) for o in outcomes]
    assert outcomes[0].status == status, (case, outcomes[0].reason)


def test_no_instance_of_a_kind_is_a_429_while_one_comes_back_else_a_503():
    sim = make_sim()
    decodes = [i for i in sim.state.instances if i.startswith("d")]
    lost = copy.deepcopy(sim.state)
    for instance_id in decodes:
        lost.dead(instance_id, 0.0)  # their process exited: being restarted
    outcome = route(ToRoute("x", [9], 100, 10), sim.index, lost, 1.0, sim.policy, sim.admission, sim.perf, 0.5)
    assert (outcome.status, outcome.retry_after_s) == (429, routing.RECOVERY_RETRY_S) and outcome.decision is None
    assert "while one is being restarted" in outcome.reason
    outcome = route(ToRoute("x", [9], 100, 10), sim.index, lost, 1000.0, sim.policy, sim.admission, sim.perf, 0.5)
    assert outcome.status == 503 and outcome.reason == "no decode instance is available"


def test_instances_cut_off_by_their_lost_messengers_are_a_429_while_the_messengers_come_back():
    sim = make_sim()
    cut = copy.deepcopy(sim.state)
    nodes = sorted({cut.instances[i].info.node for i in cut.instances if i.startswith("d")})
    for n, node in enumerate(nodes):
        cut.heard(WorkerInfo(f"m{n}", "messenger", node), 0.0)
        cut.dead(f"m{n}", 0.0)  # its process exited: being restarted
    outcome = route(ToRoute("x", [9], 100, 10), sim.index, cut, 1.0, sim.policy, sim.admission, sim.perf, 0.5)
    assert (outcome.status, outcome.retry_after_s) == (429, routing.RECOVERY_RETRY_S) and outcome.decision is None
    outcome = route(ToRoute("x", [9], 100, 10), sim.index, cut, 1000.0, sim.policy, sim.admission, sim.perf, 0.5)
    assert outcome.status == 503 and outcome.reason == "no decode instance is available"
