"""The simulator: determinism, one end per request, zero-load TTFT, a hand-computed trace."""

import pytest

from tools.moonbus.traces.measures import OK
from common.decide.perf import LLAMA3_70B
from tools.moonbus.traces.rows import TraceRow
from tools.sim import SimConfig, build_profile, simulate

PROFILE, EXTRAS = build_profile("llama3-70b", "8xa800")
KVB = LLAMA3_70B.kv_bytes_per_token


def make_config(**kw) -> SimConfig:
    base = dict(prefill=2, decode=2, admission="none", profile=PROFILE) | EXTRAS
    return SimConfig(**(base | kw))


def make_rows(n: int, gap_ms: int = 200, seed: int = 1) -> list[TraceRow]:
    """A busy synthetic trace: shared system prompt ids, some repeated conversations."""
    import random

    rnd = random.Random(seed)
    rows = []
    for i in range(n):
        blocks = rnd.randint(1, 12)
        conv = rnd.randint(0, n // 4)
        ids = (0,) + tuple(1000 * conv + b for b in range(blocks))
        rows.append(TraceRow(i * gap_ms, len(ids) * 512 - rnd.randint(0, 500), rnd.randint(1, 60), ids))
    return rows


def test_deterministic_under_a_seed():
    rows = make_rows(300)
    for policy in ("random", "kvcache-centric"):
        a = simulate(rows, make_config(policy=policy, admission="predictive", seed=7))
        b = simulate(rows, make_config(policy=policy, admission="predictive", seed=7))
        assert [r.to_json() for r in a.results] == [r.to_json() for r in b.results]
        assert a.summary == b.summary


def test_every_request_ends_exactly_once():
    rows = make_rows(400, gap_ms=20)  # overloaded: rejections of both kinds happen
    for cfg in (make_config(admission="baseline", tbt_slo_s=0.02, ttft_slo_s=3.0),
                make_config(admission="early", tbt_slo_s=0.02, ttft_slo_s=3.0),
                make_config(coupled=3, admission="none")):
        out = simulate(rows, cfg)
        assert out.stats["ended"] == len(rows)
        assert sorted(r.index for r in out.results) == list(range(len(rows)))
        assert all(r.end_s is not None and r.end_s >= r.arrival_s for r in out.results)
        s = out.summary
        assert s["ok"] + s["rejected_arrival"] + s["rejected_late"] + s["failed"] == len(rows)
        assert s["failed"] == 0
        for r in out.results:
            if r.status == OK and r.tbt_s is not None:
                assert sum(c for _, c in r.intervals) == r.output_tokens - 1


def test_zero_load_ttft_is_predicted_prefill():
    # requests 1000 s apart with distinct prefixes: no queue, no cache hit
    rows = [TraceRow(i * 1_000_000, 512 * (i + 1), 5, tuple(range(100 * i, 100 * i + i + 1))) for i in range(6)]
    out = simulate(rows, make_config())
    for row, r in zip(rows, out.results):
        assert r.ttft_s == pytest.approx(PROFILE.prefill.seconds(row.input_length, 0), rel=1e-12)


def test_hand_made_trace():
    """1P+1D. Request 0: 3 blocks, 3 output tokens. Request 1, 100 s later: same blocks, 1 token."""
    n = 1536
    rows = [TraceRow(0, n, 3, (1, 2, 3)), TraceRow(100_000, n, 1, (1, 2, 3))]
    cfg = make_config(prefill=1, decode=1)
    out = simulate(rows, cfg)
    r0, r1 = out.results
    prefill0 = PROFILE.prefill.seconds(n, 0)
    assert r0.ttft_s == pytest.approx(prefill0)
    # KV streams from the prefill's start; it is in well before the end, so it lands one layer
    # after the prefill ends; the batch of one then runs 2 steps at context n + 1
    nbytes = n * KVB
    assert nbytes / cfg.nic_bytes_s < prefill0
    kv_in = prefill0 + nbytes / cfg.nic_bytes_s / cfg.layers
    step = PROFILE.decode.step_seconds(1, n + 1)
    assert r0.end_s == pytest.approx(kv_in + 2 * step)
    assert [c for _, c in r0.intervals] == [1, 1]
    assert [s for s, _ in r0.intervals] == pytest.approx([kv_in + step - prefill0, step])
    assert r0.tbt_s == pytest.approx(kv_in + step - prefill0)  # 10% of 2 intervals: the longest
    # request 1 reuses all but the last token from the pool (3 blocks stored by request 0)
    assert r1.cached_tokens == n - 1
    want = max(PROFILE.prefill.seconds(n, n - 1), (n - 1) * KVB / cfg.h2d_bytes_s)
    assert r1.ttft_s == pytest.approx(want)
    assert out.summary["cache_hit_ratio"] == pytest.approx((n - 1) / (2 * n))


def test_global_pool_pulls_and_replicates():
    """Two prefill nodes; the policy pulls a long cached prefix instead of recomputing it."""
    ids = tuple(range(40))
    rows = [TraceRow(0, 40 * 512, 1, ids), TraceRow(0, 40 * 512, 1, ids + (99,))]
    out = simulate(rows, make_config(prefill=2, decode=1))
    # request 1 arrives while p0 is busy with request 0 and nothing is cached yet: p1 computes
    assert out.stats["pulls"] == 0
    rows.append(TraceRow(200_000, 41 * 512, 1, ids + (98,)))
    rows.append(TraceRow(200_000, 41 * 512, 1, ids + (97,)))
    out = simulate(rows, make_config(prefill=2, decode=1, policy="kvcache-centric"))
    assert out.results[2].cached_tokens == 40 * 512 and out.results[3].cached_tokens == 40 * 512


def test_coupled_prefill_pauses_the_batch():
    # a long decode, then a long prefill on the same coupled instance: one big interval
    rows = [TraceRow(0, 512, 200, (1,)), TraceRow(500, 60 * 512, 1, tuple(range(10, 70)))]
    out = simulate(rows, make_config(coupled=1))
    long_prefill = PROFILE.prefill.seconds(60 * 512, 0)
    assert max(s for s, _ in out.results[0].intervals) >= long_prefill
    dis = simulate(rows, make_config(prefill=1, decode=1))
    assert max(s for s, _ in dis.results[0].intervals) < 0.1


def test_a_prefill_that_cannot_start_in_time_is_rejected_unprefilled_and_goodput_gains(monkeypatch):
    """A machine twice slower than its profile: the queues fall behind what admission predicted.
    The prefill instances' deadline check (the live code's `late_start`) rejects the requests
    whose first token would come too late instead of prefilling them, and those behind them start
    sooner. Against the same run with the check switched off: more requests within both SLOs."""
    import tools.sim.engine as engine

    rows = make_rows(400, gap_ms=50)
    cfg = make_config(admission="predictive", ttft_slo_s=3.0, tbt_slo_s=0.2, speed_factor=2.0)
    checked = simulate(rows, cfg)
    monkeypatch.setattr(engine, "late_start", lambda now, deadline, work_s: 0.0)
    unchecked = simulate(rows, cfg)

    def late_ttft(out) -> int:
        return sum(1 for r in out.results if r.status == OK and r.ttft_s > cfg.ttft_slo_s)

    at_prefill = [r for r in checked.results if r.status == "rejected_late" and r.error.startswith("prefill")]
    assert at_prefill and all(r.first_token_s is None and r.output_tokens == 0 for r in at_prefill)
    assert not [r for r in unchecked.results if r.error.startswith("prefill")]
    assert late_ttft(checked) < late_ttft(unchecked)
    assert checked.summary["meets_slo"] > unchecked.summary["meets_slo"]
