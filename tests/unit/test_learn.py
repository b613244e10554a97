"""Predictions that learn (common/decide/learn.py): the factor follows measured outcomes, ignores
outliers, never makes more work cheaper; the conductor's state and the simulator learn the same way."""

import pytest

from common.decide import learn
from common.decide.cluster_state import ClusterState, Routed
from common.decide.learn import MAX_THRESHOLD, MIN_SAMPLES, WINDOW, Threshold
from common.decide.policy import PolicySettings
from common.decide.perf import DecodeModel, PrefillModel, Profile
from schemas.workers import DecodeReport, Measured, PrefillReport, WorkerInfo
from tests.unit.test_sim import make_config, make_rows
from tools.sim import simulate


def test_the_profile_stands_until_enough_outcomes():
    f = learn.Factor()
    for _ in range(learn.MIN_SAMPLES - 1):
        f.observe(1.0, 3.0)
    assert f.value == 1.0
    f.observe(1.0, 3.0)
    assert f.value == pytest.approx(3.0)


def test_an_outlier_does_not_move_the_median_and_drift_is_followed():
    f = learn.Factor()
    for actual in (2.0, 2.0, 2.0, 50.0, 2.0):
        f.observe(1.0, actual)
    assert f.value == pytest.approx(2.0)
    for _ in range(learn.WINDOW):  # the machine got faster: the window forgets the old speed
        f.observe(1.0, 0.5)
    assert f.value == pytest.approx(0.5)


def test_nothing_is_learned_from_a_prediction_of_nothing():
    f = learn.Factor()
    for _ in range(5):
        f.observe(0.0, 1.0)
        f.observe(1.0, 0.0)
    assert (f.value, f.samples) == (1.0, 0)


def profile() -> Profile:
    return Profile(PrefillModel((0.0, 0.01, 0.0, 0.0)), DecodeModel((0.05, 0.0, 0.0)))


def prefill_info(seq: int, seconds: float) -> WorkerInfo:
    return WorkerInfo("prefill-0", "prefill", "node-p0",
                      prefill=PrefillReport(0.0, 0, 0, [], [], Measured(seq, seconds, 100, 0)))


def test_the_state_learns_each_measurement_once_and_prices_the_instance_by_it():
    state = ClusterState(3.0, 900.0, perf=profile())
    for seq in range(1, 4):  # 100 tokens predicted at 1 s each took 2.5 s
        state.heard(prefill_info(seq, 2.5), now=float(seq))
        state.heard(prefill_info(seq, 99.0 if seq == 3 else 2.5), now=float(seq) + 0.1)  # a repeat: not new
    [candidate] = state.prefill_candidates(now=4.0)
    assert candidate.speed == pytest.approx(2.5)

    for seq in (7, 8, 9):
        state.heard(WorkerInfo("decode-0", "decode", "node-d0", decode=DecodeReport(
            1, 10, 0, None, 0.0, [], Measured(seq, 0.2, 10, batch=1))), now=5.0)
    assert state.decode_candidates(now=5.0)[0].step_factor == pytest.approx(4.0)  # 0.2 s against 0.05
    assert state.decode_load("decode-0").step_factor == pytest.approx(4.0)


@pytest.mark.parametrize("factor", [0.5, 2.0])
def test_the_simulator_converges_to_a_machine_that_is_not_the_profile(factor):
    outcome = simulate(make_rows(400), make_config(admission="predictive", speed_factor=factor))
    learned = outcome.stats["learned"]
    assert {"p0", "p1", "d0", "d1"} <= set(learned)
    for instance, kinds in learned.items():
        for kind, value in kinds.items():
            assert value == pytest.approx(factor, rel=0.15), (instance, kind, value)


def test_the_simulator_follows_a_drifting_machine():
    rows = make_rows(600, gap_ms=6000)  # an hour of trace: the machine ends 3x slower than it began
    outcome = simulate(rows, make_config(admission="predictive", speed_factor=1.0, drift=2.0))
    end = 1.0 * (1 + 2.0 * rows[-1].timestamp_ms / 1000 / 3600)
    for instance, kinds in outcome.stats["learned"].items():
        assert kinds["prefill" if instance.startswith("p") else "step"] == pytest.approx(end, rel=0.15)


def test_a_new_instance_starts_from_its_peers_not_from_the_profile():
    learned = learn.Learned()
    assert learned.factor("decode-9", "step") == 1.0  # nobody measured yet: the profile
    for instance, ratio in (("decode-0", 0.5), ("decode-1", 0.6), ("decode-2", 0.7)):
        for _ in range(learn.MIN_SAMPLES):
            learned.observe(instance, "step", 1.0, ratio)
    assert learned.factor("decode-9", "step") == pytest.approx(0.6)
    assert learned.factor("decode-9", "prefill") == 1.0  # another kind is not a peer


def test_the_balancing_threshold_follows_how_late_pulls_run_against_recomputes():
    t = Threshold(1.25)
    for _ in range(MIN_SAMPLES - 1):
        t.observe(True, 1.0, 2.0)
        t.observe(False, 1.0, 1.0)
    assert t.value == 1.25  # too few outcomes of each kind: the configured value stands
    t.observe(True, 1.0, 2.0)
    t.observe(False, 1.0, 1.0)
    assert t.value == 2.5  # pulls take twice their prediction, recomputes theirs: pulling must gain twice as much
    for _ in range(WINDOW):
        t.observe(True, 1.0, 0.5)
    assert t.value == 1.0  # pulls run early: the threshold falls, never below 1 (an equal prefix is never pulled)
    for _ in range(WINDOW):
        t.observe(True, 1.0, 50.0)
    assert t.value == MAX_THRESHOLD


def test_the_conductor_learns_the_threshold_from_prefill_ends_and_hands_it_to_the_policy():
    state = ClusterState(timeout_s=3.0, lease_s=100.0, balancing_threshold=1.25)
    settings = PolicySettings("kvcache-centric", 1.25)
    for i in range(MIN_SAMPLES):
        state.route(Routed(f"p{i}", ("p0",), "d0", "", 100, 0.0, 1.0, 1.0, pull_source="n2", pull_bytes=10))
        state.route(Routed(f"r{i}", ("p0",), "d0", "", 100, 0.0, 1.0, 1.0))
        state.prefilled(f"p{i}", 0, now=1.5)
        state.prefilled(f"r{i}", 0, now=1.0)
        state.prefilled(f"r{i}", 0, now=9.0)  # a duplicate report teaches nothing
    assert state.threshold.value == 1.875
    assert state.policy_settings(settings).kvcache_balancing_threshold == 1.875


def test_the_ttft_margin_is_how_late_first_tokens_came_near_the_slo():
    from common.decide.learn import MARGIN_MIN_SAMPLES, TtftMargin

    margin = TtftMargin(min_predicted_s=7.5, quantile=0.9)  # a quarter of a 30 s SLO
    for _ in range(50):  # short predictions, far later than predicted: fixed overheads, not a queue
        margin.observe(0.2, 1.0)
    assert margin.value == 1.0 and not margin.ratios
    for i in range(MARGIN_MIN_SAMPLES - 1):
        margin.observe(20.0, 24.0)
    assert margin.value == 1.0  # too few yet: the prediction stands
    for i in range(40):  # 1.0x to 1.39x late, evenly: the 90th percentile is about 1.35
        margin.observe(20.0, 20.0 * (1.0 + (i % 40) / 100))
    assert 1.3 <= margin.value <= 1.4
    early = TtftMargin(7.5)
    for _ in range(20):
        early.observe(20.0, 10.0)  # first tokens came early: never below 1 (what is predicted late stays out)
    assert early.value == 1.0
    off = TtftMargin(7.5, quantile=0.0)
    for _ in range(20):
        off.observe(20.0, 30.0)
    assert off.value == 1.0


def test_predictive_admission_judges_the_predicted_ttft_times_the_margin():
    from common.decide.admission import AdmissionSettings, DecodeLoadSnapshot, admit
    from common.decide.perf import A800_X8, LLAMA3_70B, analytic_profile

    perf = analytic_profile(LLAMA3_70B, A800_X8)
    load = DecodeLoadSnapshot(0.0, ())
    predictive = AdmissionSettings("predictive", ttft_slo_s=30.0, tbt_slo_s=1.0)
    late = admit(25.0, 100, load, predictive, perf, ttft_margin=1.3)  # 32.5 s once corrected
    assert not late.admit and "x1.30 margin" in late.reason and late.retry_after_s == pytest.approx(2.5)
    assert "no decode instance" in admit(25.0, 100, load, predictive, perf, ttft_margin=1.1).reason  # 27.5: past TTFT
    baseline = AdmissionSettings("baseline", ttft_slo_s=30.0, tbt_slo_s=1.0)
    assert admit(25.0, 100, load, baseline, perf, ttft_margin=1.3).admit  # the paper's baseline stays as it was
