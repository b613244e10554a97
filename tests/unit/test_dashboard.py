"""The dashboard's pure parts: the ring of recent routing decisions, the per-second outcome series,
the views of the conductor's and messengers' replies, and the state cache's sharing."""

from __future__ import annotations

import asyncio

import pytest

from schemas.events import Event
from schemas.pool import PoolStatus
from schemas.workers import DecodeReport, StatusReply, WorkerInfo
from services.gateway.dashboard import OutcomeSeries, RatioSeries, RecentDecisions, StateCache, instances_view, pool_view


def make_routed(rid: str, ts: float = 100.0, **data) -> Event:
    base = {"prefill_id": "prefill-0", "decode_id": "decode-0", "ttft_s": 0.5, "queue_s": 0.1, "prefill_s": 0.3,
            "transfer_s": 0.1, "tbt_s": 0.02, "reason": "kvcache-centric", "admitted": True, "verdict": "ok",
            "prefill_costs": [{"instance_id": "prefill-0", "node": "node-p0", "queue_s": 0.1, "local_blocks": 1,
                               "prefix_blocks": 2, "pull_blocks": 1, "prefill_s": 0.3, "transfer_s": 0.1,
                               "ttft_s": 0.5}],
            "decode_costs": [{"instance_id": "decode-0", "node": "node-d0", "num_running": 0, "context_tokens": 0,
                              "tbt_s": 0.02, "fits": True}],
            "pull": None, "best_holder": None}
    return Event("routed", ts, "conductor", "conductor-0", rid, base | data)


# --- RecentDecisions -----------------------------------------------------------------------

def test_a_decision_keeps_the_fields_the_page_shows_and_its_candidates():
    ring = RecentDecisions(3)
    record = ring.add(make_routed("r1"))
    assert record == {
        "ts": 100.0, "request_id": "r1", "prefill_id": "prefill-0", "decode_id": "decode-0", "ttft_s": 0.5,
        "queue_s": 0.1, "prefill_s": 0.3, "transfer_s": 0.1, "tbt_s": 0.02, "reason": "kvcache-centric",
        "admitted": True, "verdict": "ok",
        "prefill_costs": [{"instance_id": "prefill-0", "queue_s": 0.1, "prefix_blocks": 2, "pull_blocks": 1,
                           "prefill_s": 0.3, "transfer_s": 0.1, "ttft_s": 0.5}],
        "decode_costs": [{"instance_id": "decode-0", "num_running": 0, "context_tokens": 0, "tbt_s": 0.02,
                          "fits": True}],
    }


def test_the_ring_keeps_the_newest_capacity_decisions_newest_first():
    ring = RecentDecisions(3)
    for i in range(5):
        ring.add(make_routed(f"r{i}", ts=100.0 + i))
    assert [d["request_id"] for d in ring.newest_first()] == ["r4", "r3", "r2"]
    assert len(ring) == 3


def test_a_decision_with_no_route_has_no_candidates():
    """The conductor's NoInstances event: admitted=False and a reason, nothing priced."""
    event = Event("routed", 5.0, "conductor", "conductor-0", "r9",
                  {"admitted": False, "reason": "no prefill instance", "policy": "kvcache-centric"})
    assert RecentDecisions().add(event) == {"ts": 5.0, "request_id": "r9", "admitted": False,
                                            "reason": "no prefill instance", "policy": "kvcache-centric",
                                            "prefill_costs": [], "decode_costs": []}


def test_a_malformed_candidate_list_is_kept_as_empty_entries():
    record = RecentDecisions().add(make_routed("r1", prefill_costs=["junk"], decode_costs=None))
    assert record["prefill_costs"] == [{}] and record["decode_costs"] == []


def test_capacity_must_be_positive():
    with pytest.raises(ValueError):
        RecentDecisions(0)


# --- OutcomeSeries -------------------------------------------------------------------------

def test_counts_land_in_their_second_oldest_first():
    series = OutcomeSeries(window_s=4)
    series.record("completed", 10.2)
    series.record("completed", 10.9)
    series.record("rejected_arrival", 12.0)
    series.record("completed", 13.5)
    out = series.series(13.7)
    assert out["start"] == 10 and out["window_s"] == 4
    assert out["points"] == {"completed": [2, 0, 0, 1], "rejected_arrival": [0, 0, 1, 0],
                             "rejected_late": [0, 0, 0, 0], "failed": [0, 0, 0, 0]}
    assert out["totals"] == {"completed": 3, "rejected_arrival": 1, "rejected_late": 0, "failed": 0}


def test_seconds_older_than_the_window_leave_the_series_but_not_the_totals():
    series = OutcomeSeries(window_s=3)
    series.record("completed", 1.0)
    series.record("failed", 2.0)
    series.record("completed", 5.0)  # the window is now seconds 3..5: 1 and 2 are dropped
    assert sorted(series._seconds) == [5]
    out = series.series(5.0)
    assert out["start"] == 3
    assert out["points"]["completed"] == [0, 0, 1] and out["points"]["failed"] == [0, 0, 0]
    assert out["totals"]["completed"] == 2 and out["totals"]["failed"] == 1


def test_a_quiet_gateway_still_gets_a_full_window_of_zeros():
    series = OutcomeSeries(window_s=5)
    series.record("completed", 100.0)
    out = series.series(200.0)  # long after: nothing in the window
    assert out["start"] == 196 and out["points"]["completed"] == [0] * 5 and out["totals"]["completed"] == 1


def test_a_clock_step_back_counts_in_its_second_while_that_second_is_in_the_window():
    series = OutcomeSeries(window_s=10)
    series.record("completed", 20.0)
    series.record("completed", 22.0)
    series.record("rejected_late", 20.5)  # the wall clock stepped back
    series.record("completed", 21.0)
    series.record("failed", 12.9)  # past the window (13..22): only the totals count it
    out = series.series(22.0)
    assert out["points"]["rejected_late"][-3:] == [1, 0, 0]
    assert out["points"]["completed"][-3:] == [1, 1, 1]
    assert out["points"]["failed"] == [0] * 10
    assert out["totals"] == {"completed": 3, "rejected_arrival": 0, "rejected_late": 1, "failed": 1}
    assert sorted(series._seconds) == [20, 21, 22]


def test_an_unknown_outcome_is_refused():
    with pytest.raises(ValueError):
        OutcomeSeries().record("succeeded", 1.0)
    with pytest.raises(ValueError):
        OutcomeSeries(window_s=0)


# --- views -----------------------------------------------------------------------------------

def test_instances_are_listed_by_role_then_id_with_the_conductors_load():
    decode = DecodeReport(3, 900, 1200, 8800, 0.05, kv_cache_bytes=10 << 20)
    status = StatusReply(
        workers=[WorkerInfo("prefill-1", "prefill", "node-p1", num_queued=2, num_running=1),
                 WorkerInfo("decode-0", "decode", "node-d0", num_running=3, draining=True, decode=decode),
                 WorkerInfo("prefill-0", "prefill", "node-p0")],
        in_flight=4, prefill_queue_s={"prefill-1": 1.5}, decode_running={"decode-0": 3})
    no_kv = {"kv_cache_bytes": None, "kv_used_tokens": None, "kv_free_tokens": None}
    assert instances_view(status) == [
        {"instance_id": "decode-0", "role": "decode", "node": "node-d0", "num_queued": 0, "num_running": 3,
         "draining": True, "queue_s": None, "decode_running": 3, "kv_cache_bytes": 10 << 20, "kv_used_tokens": 1200,
         "kv_free_tokens": 8800},
        {"instance_id": "prefill-0", "role": "prefill", "node": "node-p0", "num_queued": 0, "num_running": 0,
         "draining": False, "queue_s": None, "decode_running": None, **no_kv},
        {"instance_id": "prefill-1", "role": "prefill", "node": "node-p1", "num_queued": 2, "num_running": 1,
         "draining": False, "queue_s": 1.5, "decode_running": None, **no_kv},
    ]


def test_a_pool_view_is_its_tiers_or_why_it_is_unavailable():
    pool = PoolStatus("node-p0", "e1", "/dev/shm/x", 100, 7, 400, 3, 2, {"a:b/r": 2}, 0, 0)
    assert pool_view("node-p0", pool, "") == {"node": "node-p0", "available": True, "dram_capacity_blocks": 100,
                                              "dram_used_blocks": 7, "ssd_capacity_blocks": 400,
                                              "ssd_used_blocks": 3, "pinned_blocks": 2}
    assert pool_view("node-d0", None, "no answer (TimeoutError)") == {
        "node": "node-d0", "available": False, "error": "no answer (TimeoutError)"}


# --- StateCache ------------------------------------------------------------------------------

async def test_concurrent_pollers_share_one_gathering_and_a_fresh_one_is_reused():
    calls = []
    release = asyncio.Event()

    async def gather():
        calls.append(1)
        await release.wait()
        return {"n": len(calls)}

    cache = StateCache(gather, max_age_s=60.0)
    waiters = [asyncio.ensure_future(cache.get()) for _ in range(3)]
    await asyncio.sleep(0)
    release.set()
    assert await asyncio.gather(*waiters) == [{"n": 1}] * 3
    assert await cache.get() == {"n": 1}  # younger than max_age_s: served again
    assert len(calls) == 1
    cache.max_age_s = 0.0
    await asyncio.sleep(0.01)
    assert await cache.get() == {"n": 2}


async def test_a_poller_that_goes_away_does_not_cancel_the_gathering():
    release = asyncio.Event()

    async def gather():
        await release.wait()
        return {"ok": True}

    cache = StateCache(gather)
    first = asyncio.ensure_future(cache.get())
    await asyncio.sleep(0)
    first.cancel()
    second = asyncio.ensure_future(cache.get())
    release.set()
    assert await second == {"ok": True}


def test_ratio_series_is_the_median_per_second_over_the_window():
    series = RatioSeries(window_s=3)
    for ratio in (1.0, 3.0, 1.2):
        series.record(ratio, now=100.2)
    series.record(0.5, now=102.9)
    assert series.series(now=102.0) == {"start": 100, "window_s": 3, "points": [1.2, None, 0.5]}
    series.record(2.0, now=104.0)  # 100 leaves the window
    assert series.series(now=104.0)["points"] == [0.5, None, 2.0]
