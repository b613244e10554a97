"""`moonbus bench goodput`'s arithmetic and report: each mode's goodput over admission none's, the
goal line, the rows `make bench` gets, and the plan every mode shares (the trace slice, no engine
probes). The live clusters it starts are what `moonbus up` starts (tested there)."""

from __future__ import annotations

import argparse

import orjson
import pytest

from common.audit import Stored

from tools.moonbus.bench import TARGETS, goodput


def mode(goodput_rps: float, completed: int = 40, within: int = 36, rejected: int = 20) -> dict:
    serve = {"completed": completed, "rejected": rejected, "failed": 0, "within_slo": within,
             "slo_attainment": within / completed if completed else 0.0, "ttft_p50_s": 3.0, "ttft_p90_s": 9.0,
             "goodput_rps": goodput_rps, "cpu_use": 0.9}
    return {"serve": serve, "rejections": {"queue": rejected} if rejected else {}, "tbt_p90_s": 0.4,
            "goodput_per_min": goodput_rps * 60}


def result(**modes) -> dict:
    out = {"trace_rows": 60, "scalings": ["60 rows"], "dtype": "float32", "cores": 2, "ttft_slo_s": 30.0,
           "tbt_slo_s": 1.0, "modes": modes}
    out["ratios"] = goodput.ratios(modes)
    return out


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    goodput.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_each_mode_is_measured_against_admitting_everything():
    r = result(none=mode(0.1), early=mode(0.15), predictive=mode(0.2))
    assert r["ratios"] == {"none": 1.0, "early": pytest.approx(1.5), "predictive": pytest.approx(2.0)}
    report = goodput.format_report(r)
    assert "goal: predictive >= 1.5x none's goodput: met" in report
    assert "2.00x" in report and "predictive rejections: queue 20" in report


def test_a_goal_not_met_says_so_and_a_failed_mode_says_why():
    r = result(none=mode(0.1), predictive=mode(0.12), early={"error": "the cluster did not start"})
    report = goodput.format_report(r)
    assert "NOT met" in report and "early       error: the cluster did not start" in report
    rows = goodput.summary(r)
    assert [row["met"] for row in rows] == [None, False]
    assert rows[1]["ratio"] == pytest.approx(1.2) and rows[1]["goal"] == ">= 1.5x"


def test_no_ratio_without_a_measured_baseline():
    assert goodput.ratios({"predictive": mode(0.2)}) == {}
    assert goodput.ratios({"none": mode(0.0), "predictive": mode(0.2)}) == {}
    assert "goal" not in goodput.format_report(result(predictive=mode(0.2)))


def test_every_mode_gets_the_same_trace_slice_and_no_engine_probes():
    args = parse("--rows", "5", "--modes", "none,predictive")
    plan_args = argparse.Namespace(**vars(args), prefill_tokens=1, engine_repeats=0, decode_batches="",
                                   decode_prompt_tokens=1, decode_tokens=2)
    plan, said = goodput.make_plan(plan_args)
    assert len(plan.trace_prompts) == len(plan.arrivals_s) == 5 and plan.arrivals_s[0] == 0.0
    assert plan.prefill_prompts == [] and plan.decode_prompts == {}
    assert said[-1] == "max_tokens 32, ignore_eos"


def test_unknown_modes_are_refused_before_anything_starts(capsys):
    assert goodput.run(parse("--modes", "none,psychic")) == 2
    assert "--modes must be among" in capsys.readouterr().err


def test_registered_for_make_bench():
    assert TARGETS["goodput"] == "tools.moonbus.bench.goodput"


def test_the_ttft_prediction_is_judged_on_first_attempts_per_prefill_instance():
    def routed(rid, prefill, attempt=0, admitted=True):
        return {"kind": "routed", "request_id": rid, "data": {"prefill_id": prefill, "attempt": attempt,
                                                               "admitted": admitted}}

    def first(rid, actual, predicted, attempt=0):
        return {"kind": "first_token", "request_id": rid,
                "data": {"ttft_s": actual, "predicted_ttft_s": predicted, "attempt": attempt}}

    events = [routed("a", "prefill-0"), first("a", 1.0, 1.0), routed("b", "prefill-0"), first("b", 3.0, 2.0),
              routed("c", "prefill-1"), first("c", 0.9, 1.0), routed("d", "prefill-1", attempt=1),
              first("d", 50.0, 1.0, attempt=1), routed("e", "prefill-1"), first("e", 2.0, 0.0)]
    got = goodput.ttft_prediction(events)
    assert got["requests"] == 3 and got["median"] == pytest.approx(1.0)
    assert got["per_instance"] == {"prefill-0": pytest.approx(1.25), "prefill-1": pytest.approx(0.9)}
    assert got["within_20pct"] == pytest.approx(2 / 3)
    assert goodput.ttft_prediction([])["median"] is None
    stored = [Stored(i + 1, "moonbus.events.request.x.r", orjson.dumps(e)) for i, e in enumerate(events)]
    assert goodput.ttft_prediction(goodput.events_of(stored)) == got


def test_disturbances_count_lost_instances_migrations_and_later_attempts():
    events = [{"kind": "routed", "request_id": "a", "data": {"attempt": 0}},
              {"kind": "lost", "request_id": "", "data": {}},
              {"kind": "migrated", "request_id": "a", "data": {"attempt": 1}},
              {"kind": "routed", "request_id": "a", "data": {"attempt": 1}},
              {"kind": "routed", "request_id": "b", "data": {}}]
    assert goodput.disturbances(events) == {"lost": 1, "migrated": 1, "redispatched": 1}
    assert goodput.disturbances([]) == {"lost": 0, "migrated": 0, "redispatched": 0}
