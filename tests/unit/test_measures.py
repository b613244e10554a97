"""tools.moonbus.traces.measures: TBT from runs, percentiles, the summary, load over time."""

import pytest

from tools.moonbus.traces.measures import (OK, REJECTED_ARRIVAL, REJECTED_LATE, RequestResult, effective_capacity,
                             load_over_time, percentile, summarize, tbt_from_runs, tbt_of)


def make_result(i, status=OK, arrival=0.0, ttft=1.0, tbt=0.05, end=5.0, cached=0, inputs=100):
    first = None if ttft is None else arrival + ttft
    return RequestResult(i, status, arrival, inputs, 10, cached, first, end, ttft, tbt)


def test_tbt_is_mean_of_longest_tenth():
    intervals = [0.01] * 18 + [0.5, 0.3]
    assert tbt_of(intervals) == (0.5 + 0.3) / 2  # 10% of 20 = 2 intervals
    assert tbt_of([0.2, 0.1]) == 0.2  # at least one interval
    assert tbt_of([]) is None


def test_tbt_from_runs_equals_expanded_intervals():
    runs = [[0.04, 1], [0.01, 30], [0.02, 9]]
    expanded = [0.04] + [0.01] * 30 + [0.02] * 9
    assert tbt_from_runs(runs) == tbt_of(expanded) == (0.04 + 0.02 * 3) / 4


def test_percentile_interpolates():
    assert percentile([1, 2, 3, 4, 5], 50) == 3
    assert percentile([0, 10], 90) == 9
    assert percentile([], 50) is None


def test_summary_counts_and_capacity():
    results = [
        make_result(0, ttft=1.0, tbt=0.05, cached=50),
        make_result(1, ttft=20.0, tbt=0.05),  # breaks the TTFT SLO
        make_result(2, ttft=1.0, tbt=None),  # one-token reply: no TBT, passes
        make_result(3, REJECTED_ARRIVAL, ttft=None, end=0.0),
        make_result(4, REJECTED_LATE, ttft=2.0, tbt=None, end=2.0),
    ]
    s = summarize(results, ttft_slo_s=10, tbt_slo_s=0.1)
    assert (s["ok"], s["rejected_arrival"], s["rejected_late"], s["failed"]) == (3, 1, 1, 0)
    assert s["meets_slo"] == 2 and s["effective_capacity"] == 2 / 5
    assert s["goodput_rps"] == 2 / 5.0
    assert s["cache_hit_ratio"] == 50 / 400  # ok + late-rejected requests had a prefill
    assert effective_capacity(results, 30, 0.01) == 1 / 5


def test_load_over_time():
    results = [make_result(0, arrival=0.0, ttft=2.0, end=4.0), make_result(1, arrival=1.0, ttft=1.0, end=3.0)]
    times, pre, dec = load_over_time(results, 1.0)
    assert times[:5] == [0, 1, 2, 3, 4]
    assert pre[:5] == [1, 2, 0, 0, 0]
    assert dec[:5] == [0, 0, 2, 1, 0]


def test_attainment_goodput_per_minute_and_rejections_by_reason():
    from tools.moonbus.traces.measures import OK, REJECTED_ARRIVAL, REJECTED_LATE, RequestResult, summarize

    def r(i, status, ttft=1.0, error=""):
        return RequestResult(i, status, arrival_s=float(i), input_tokens=10, ttft_s=ttft if status == OK else None,
                             end_s=float(i) + 2.0, error=error)

    results = [r(0, OK), r(1, OK), r(2, OK, ttft=50.0), r(3, REJECTED_ARRIVAL, error="HTTP 429: rejected at arrival: ttft 40s > slo 30s"),
               r(4, REJECTED_ARRIVAL, error="HTTP 429: rejected at arrival: tbt 1.2s on d0 at prefill end > slo 1s"),
               r(5, REJECTED_LATE, error="{'code': 429, 'message': 'no decode instance has KV room'}")]
    s = summarize(results, ttft_slo_s=30.0, tbt_slo_s=1.0)
    assert s["slo_attainment"] == 2 / 3  # of the three served, one came too late
    assert s["goodput_per_min"] == pytest.approx(60 * 2 / 7.0)  # over the 7 s from the first arrival to the last end
    assert s["rejections"] == {"arrival: ttft": 1, "arrival: tbt": 1, "late: kv room": 1}
