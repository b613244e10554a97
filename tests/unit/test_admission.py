"""Admission verdicts per mode, on hand-built decode loads.

Decode step = 0.01 + 0.01 * batch, TBT SLO 0.1 s: with the new request added, an instance stays
within the SLO while it already runs at most 8 requests. Every request here stays 5 s in decode
(DecodeLoad takes each request's own leave time; these hand-built ones all leave 5 s after joining).
"""

from dataclasses import replace

import pytest

from common.decide.perf import DecodeModel, PrefillModel, Profile
from common.decide import admission
from common.decide.admission import AdmissionSettings, DecodeLoad, DecodeLoads, DecodeLoadSnapshot, admit, has_room, kv_reservation, late_verdict
from common.decide.policy import Decision, DecodeCandidate, DecodeCost

PERF = Profile(PrefillModel((0.0, 0.001, 0.0, 0.0)), DecodeModel((0.01, 0.01, 0.0)))
NOW = 100.0


def make_settings(mode: str) -> AdmissionSettings:
    return AdmissionSettings(mode, ttft_slo_s=5.0, tbt_slo_s=0.1)


STAY_S = 5.0


def make_instance(decode_id: str = "d0", decoding: dict[float, int] | None = None,
                  in_prefill: dict[float, int] | None = None) -> DecodeLoad:
    """`decoding`: start time -> how many requests joined then; `in_prefill`: finish time -> how many.
    Every request has 100 context tokens."""
    starts = [t for t, n in sorted((decoding or {}).items()) for _ in range(n)]
    finishes = [t for t, n in sorted((in_prefill or {}).items()) for _ in range(n)]
    return DecodeLoad(decode_id, tuple(t + STAY_S for t in starts), (100,) * len(starts), tuple(finishes),
                      tuple(t + STAY_S for t in finishes), (100,) * len(finishes))


def make_load(*instances: DecodeLoad) -> DecodeLoadSnapshot:
    return DecodeLoadSnapshot(NOW, instances)


def judge(mode: str, load: DecodeLoadSnapshot, ttft_s: float = 2.0):
    return admit(ttft_s, 100, load, make_settings(mode), PERF)


# Draining: 10 decoding requests that leave at 101, before this prefill ends at 102.
DRAINING = make_load(make_instance(decoding={96.0: 10}))
# Filling: 2 decoding now, 10 in prefill that join at 101 and stay until 106.
FILLING = make_load(make_instance(decoding={99.0: 2}, in_prefill={101.0: 10}))


def test_none_admits_everything():
    v = judge("none", DRAINING, ttft_s=100.0)
    assert v.admit and v.stage == "arrival"


@pytest.mark.parametrize("mode", ["baseline", "early", "predictive"])
def test_ttft_over_slo_rejects_with_retry_after_the_excess(mode):
    v = judge(mode, make_load(make_instance()), ttft_s=8.5)
    assert not v.admit and "ttft" in v.reason
    assert v.retry_after_s == pytest.approx(3.5)


def test_retry_after_is_at_least_one_second():
    assert judge("baseline", make_load(make_instance()), ttft_s=5.2).retry_after_s == 1.0


def test_baseline_ignores_decode_load():
    assert judge("baseline", DRAINING).admit
    assert judge("baseline", FILLING).admit


def test_early_rejects_current_overload_predictive_admits_because_it_drains():
    early = judge("early", DRAINING)
    assert not early.admit
    assert early.tbt_s == pytest.approx(0.12) and early.decode_id == "d0"
    # two departures at 101 bring 10 -> 8 running: 1 s after now
    assert early.retry_after_s == pytest.approx(1.0)
    predictive = judge("predictive", DRAINING)
    assert predictive.admit
    assert predictive.tbt_s == pytest.approx(0.02)  # empty by 102: only this request


def test_early_admits_predictive_rejects_because_prefills_land_on_decode():
    assert judge("early", FILLING).admit
    predictive = judge("predictive", FILLING)
    assert not predictive.admit
    assert predictive.tbt_s == pytest.approx(0.14)  # 2 + 10 running at 102, plus this one
    # departures: 2 at 104, then 10 at 106; under the SLO at 8 running, i.e. 106 - 102
    assert predictive.retry_after_s == pytest.approx(4.0)


def test_predictive_picks_the_instance_that_will_be_lightest():
    load = make_load(make_instance("d1", decoding={99.0: 3}, in_prefill={101.0: 7}), make_instance("d0", decoding={99.0: 9}))
    v = judge("predictive", load)
    # at 102: d0 runs 9 (tbt 0.11), d1 runs 3 + 7 = 10 (tbt 0.12): both over
    assert not v.admit and v.decode_id == "d0" and v.tbt_s == pytest.approx(0.11)
    # d0's 9 and d1's 3 leave at 104, 2 s after the prefill ends
    assert v.retry_after_s == pytest.approx(2.0)


def decision_for(decode_id: str, fits=("d0", "d1", "d2")) -> Decision:
    costs = tuple(DecodeCost(d, f"n-{d}", 0, 0, 0.02, d in fits) for d in ("d0", "d1", "d2"))
    return Decision("r", "kvcache-centric", "p0", "n-p0", decode_id, f"n-{decode_id}", 0, None, 2.0, 0.0, 2.0, 0.0,
                    0.02, 0, None, "policy's pick", (), costs)


def test_the_request_goes_where_admission_found_room_when_its_prefill_ends():
    # d0 (the policy's pick) fills up with prefills landing before 102; d1 will have drained; d2 is busy
    load = make_load(make_instance("d0", decoding={99.0: 2}, in_prefill={101.0: 10}),
                     make_instance("d1", decoding={96.0: 10}), make_instance("d2", decoding={99.0: 8}))
    verdict, decision = admission.judge(decision_for("d0"), 100, DecodeLoads.made(load), make_settings("predictive"), PERF)
    assert verdict.admit and decision.decode_id == verdict.decode_id == "d1" and decision.decode_node == "n-d1"
    assert "within the TBT SLO when the prefill ends" in decision.reason
    # the policy's pick stays when it is within the SLO at that moment, though another is lighter
    verdict, decision = admission.judge(decision_for("d2"), 100, DecodeLoads.made(load), make_settings("predictive"), PERF)
    assert verdict.admit and decision.decode_id == "d2" and decision.reason == "policy's pick"
    # an instance without KV room for the request is never the one
    verdict, decision = admission.judge(decision_for("d0", fits=("d0", "d2")), 100, DecodeLoads.made(load), make_settings("predictive"), PERF)
    assert verdict.admit and decision.decode_id == "d2"


def test_the_policys_instance_is_judged_alone_when_it_meets_the_tbt_slo():
    load = make_load(make_instance("d0", decoding={99.0: 2}, in_prefill={101.0: 10}),
                     make_instance("d1", decoding={96.0: 10}), make_instance("d2", decoding={99.0: 8}))
    made = DecodeLoads.made(load)
    asked: list[str] = []

    def load_of(decode_id: str):
        asked.append(decode_id)
        return made.load_of(decode_id)

    loads = DecodeLoads(made.now, made.ids, load_of)
    settings = make_settings("predictive")
    # d2 meets the SLO when the prefill ends: only its load is made, and the verdict is the one of all three
    verdict, decision = admission.judge(decision_for("d2"), 100, loads, settings, PERF)
    assert asked == ["d2"]
    assert verdict == admission.admit(2.0, 100, load, settings, PERF, chosen="d2") and decision.decode_id == "d2"
    # d0 breaks it then: every instance is judged, and the request goes to the lightest
    asked.clear()
    verdict, decision = admission.judge(decision_for("d0"), 100, loads, settings, PERF)
    assert asked == ["d0", "d0", "d1", "d2"]
    assert verdict == admission.admit(2.0, 100, load, settings, PERF, chosen="d0") and decision.decode_id == "d1"
    # a TTFT past the SLO needs no decode load at all beyond the first look
    asked.clear()
    late = replace(decision_for("d2"), ttft_s=99.0)
    verdict, _ = admission.judge(late, 100, loads, settings, PERF)
    assert not verdict.admit and "ttft" in verdict.reason and asked == ["d2"]


def test_load_at_counts_arrivals_and_departures():
    d = make_instance(decoding={96.0: 3, 99.0: 2}, in_prefill={101.0: 4, 103.0: 1, 95.0: 1})
    assert d.at(NOW, predictive=False) == (5, 500)
    # at 102: the 3 from 96 and the prefill done at 95 have left; 2 still + 4 joined; 103 not yet
    assert d.at(102.0, predictive=True) == (6, 600)
    assert list(d.departures(102.0, predictive=True)) == [(104.0, 100)] * 2 + [(106.0, 100)] * 4


def test_each_request_leaves_at_its_own_time():
    # one that will stay 30 s more, one about to leave, and one in prefill that will generate little
    d = DecodeLoad("d0", (100.5, 130.0), (100, 100), (101.0,), (101.8,), (100,))
    assert d.at(101.0, predictive=True) == (2, 200)  # the short one left, the new one joined
    assert d.at(102.0, predictive=True) == (1, 100)  # the new one is already gone again


def test_decode_load_rejects_mismatched_lengths():
    with pytest.raises(ValueError):
        DecodeLoad("d0", (1.0, 2.0), (100,))
    with pytest.raises(ValueError):
        DecodeLoad("d0", (), (), (1.0,), (), (100,))


def test_no_decode_instance_rejects():
    v = judge("early", make_load())
    assert not v.admit and v.retry_after_s == 1.0


def test_the_late_check_on_kv_arrival():
    assert late_verdict(DecodeCandidate("d0", "n", 8, 800), 100, 132, None, PERF, 0.1) == ""
    assert late_verdict(DecodeCandidate("d0", "n", 9, 900), 100, 132, None, PERF, 0.1) == "tbt"
    # no room now is not a rejection (it waits for room); more than the whole budget is
    assert late_verdict(DecodeCandidate("d0", "n", 0, 0, kv_free_tokens=50), 100, 132, 200, PERF, 0.1) == ""
    assert late_verdict(DecodeCandidate("d0", "n", 0, 0, kv_free_tokens=50), 100, 232, 200, PERF, 0.1) == "kv"


def test_a_reservation_counts_the_steps_still_to_run_and_room_counts_rows_and_tokens():
    assert kv_reservation(100, 32, 1) == 131 and kv_reservation(100, 32, 40) == 100
    assert kv_reservation(100, 32, 1, max_context=120) == 120
    assert has_room(1, 2, 100, 100, 200) and not has_room(2, 2, 0, 1, 200) and not has_room(0, 2, 101, 100, 200)
    assert has_room(5, None, 10**9, 10**9, None)


@pytest.mark.parametrize("kwargs", [{"mode": "eager"}, {"tbt_slo_s": 0},
                                    {"min_retry_after_s": 5, "max_retry_after_s": 1}])
def test_settings_are_validated(kwargs):
    with pytest.raises(ValueError):
        AdmissionSettings(**kwargs)


def test_predictive_verdict_matches_decode_load_at_exactly():
    """admit's predictive verdict is, to the bit, min over instances of step(DecodeLoad.at(T) + this) * factor."""
    import random

    from common.decide.perf import analytic_profile

    rng = random.Random(3)
    perf = analytic_profile()
    for _ in range(300):
        now = 1000.0 + rng.random()
        loads = []
        for i in range(rng.randrange(1, 6)):
            leaves = sorted(now + rng.uniform(-5, 30) for _ in range(rng.randrange(0, 12)))
            finishes = sorted(now + rng.uniform(-3, 6) for _ in range(rng.randrange(0, 5)))
            loads.append(DecodeLoad(f"d{rng.randrange(9)}", tuple(leaves), tuple(rng.randrange(1, 9000) for _ in leaves),
                                    tuple(finishes), tuple(f + rng.uniform(0, 20) for f in finishes),
                                    tuple(rng.randrange(1, 9000) for _ in finishes), rng.choice([0.5, 1.0, 2.0])))
        ttft, ctx = rng.uniform(0, 4), rng.randrange(1, 9000)
        settings = AdmissionSettings("predictive", ttft_slo_s=5.0, tbt_slo_s=rng.choice([0.01, 0.0105, 0.011, 1.0]))
        v = admit(ttft, ctx, DecodeLoadSnapshot(now, tuple(loads)), settings, perf)
        judged = []
        for d in loads:
            batch, context = d.at(now + ttft, True)
            judged.append((perf.decode.step_seconds(batch + 1, context + ctx) * d.step_factor, d.decode_id))
        best_tbt, best_id = min(judged)
        assert (v.tbt_s, v.decode_id, v.admit) == (best_tbt, best_id, best_tbt <= settings.tbt_slo_s)


def test_without_kv_room_retry_when_enough_requests_have_left():
    from common.decide.admission import kv_retry_after

    full = DecodeCandidate("d0", "n", 3, 300, kv_free_tokens=20)
    # three requests of 100 context tokens leave at 101, 103 and 110; the prompt needs 150
    load = DecodeLoad("d0", (101.0, 103.0, 110.0), (100, 100, 100))
    assert kv_retry_after(150, [full], [load], NOW, make_settings("predictive")) == pytest.approx(3.0)
    assert kv_retry_after(9000, [full], [load], NOW, make_settings("predictive")) == 60.0  # never: the most


def test_a_resumed_attempt_is_not_judged_again():
    load = make_load(make_instance("d0", decoding={99.0: 20}))  # far over the TBT SLO
    late = Decision("r", "kvcache-centric", "p0", "n-p0", "d0", "n-d0", 0, None, 99.0, 97.0, 2.0, 0.0, 0.02, 0, None,
                    "policy's pick", (), (DecodeCost("d0", "n-d0", 20, 2000, 0.2, True),))
    verdict, _ = admission.judge(late, 100, DecodeLoads.made(load), make_settings("predictive"), PERF)
    assert not verdict.admit
    verdict, decision = admission.judge(late, 100, DecodeLoads.made(load), make_settings("predictive"), PERF, resumed=True)
    assert verdict.admit and decision == late


def test_an_admitted_request_carries_a_deadline_unless_admission_is_off_or_its_first_token_came():
    assert admission.ttft_deadline(1000.0, make_settings("predictive")) == 1005.0
    assert admission.ttft_deadline(1000.0, make_settings("baseline")) == 1005.0
    assert admission.ttft_deadline(1000.0, make_settings("none")) == 0.0
    assert admission.ttft_deadline(1000.0, make_settings("predictive"), holds_tokens=True) == 0.0
    # re-dispatched before its first token (the default): its client holds nothing, the deadline stands
    assert admission.ttft_deadline(1000.0, make_settings("predictive"), holds_tokens=False) == 1005.0
    assert admission.ttft_deadline(1000.0, make_settings("predictive"), pipelined=True) == 0.0


def test_a_prefill_that_would_bring_the_first_token_past_its_deadline_is_late_to_start():
    assert admission.late_start(now=1003.0, deadline=1005.0, work_s=1.5) == pytest.approx(-0.5)  # in time
    assert admission.late_start(now=1004.0, deadline=1005.0, work_s=1.5) == pytest.approx(0.5)
    assert admission.late_start(now=1e9, deadline=0.0, work_s=1.5) == 0.0  # no deadline: never late
    assert admission.clamp_retry_after(0.5) == 1.0 and admission.clamp_retry_after(1e6) == 60.0


def test_room_within_the_horizon_is_room_a_request_can_wait_for():
    from common.decide.admission import DecodeLoad, room_within
    from common.decide.policy import DecodeCandidate

    full = DecodeCandidate("d0", "n0", 3, 3000, kv_free_tokens=100)
    unlimited = DecodeCandidate("d1", "n1", 1, 500, kv_free_tokens=None)
    load = DecodeLoad("d0", leaves=(12.0, 25.0, 60.0), leave_context=(800, 1200, 1000), leave_room=(900, 1500, 1100))
    # at t=10 with 30 s to wait: the first two leave by 40 s, their reservations come back; the third's does not
    later = room_within([full, unlimited], [load, DecodeLoad("d1")], now=10.0, horizon_s=30.0)
    assert later[0].kv_free_tokens == 100 + 900 + 1500 and later[1] == unlimited
    assert room_within([full], [load], now=10.0, horizon_s=1.0)[0].kv_free_tokens == 100  # nobody leaves so soon
    # a request still in prefill: its room is taken already (decode_candidates), and comes back as it leaves
    coming = DecodeLoad("d0", joins=(11.0,), join_leaves=(20.0,), join_context=(200,), join_room=(500,))
    assert room_within([full], [coming], now=10.0, horizon_s=30.0)[0].kv_free_tokens == 600
