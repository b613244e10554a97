"""`moonbus soak`'s pure parts: the schedule and capacity estimate, outcomes, exactly-once, leaks, exit status.

Everything runs on made-up data; `send_one` is checked against a fake gateway (aiohttp, in process).
"""

import json
import mmap
import os
import random
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from tools.moonbus.traces.measures import FAILED, OK, REJECTED_ARRIVAL, REJECTED_LATE, RequestResult
from tools.moonbus.traces.rows import TraceRow
from schemas.events import Event
from schemas.pool import PoolStatus
from tools.moonbus.traces import replay
from tools.moonbus.soak import cluster as sc
from tools.moonbus.soak import load as sl
from tools.moonbus.soak import report as soak_report
from tools.moonbus.soak import verdict as sv


def make_rows(*timestamps_ms: int, input_length: int = 1024) -> list[TraceRow]:
    return [TraceRow(t, input_length, 64, (i, i + 1)) for i, t in enumerate(timestamps_ms)]


def make_result(status=OK, http_status=200, error="", error_code=0, request_id="cmpl-1",
                first_token_s: float | None = None) -> RequestResult:
    r = RequestResult(0, status, 0.0, 10, error=error, request_id=request_id, http_status=http_status,
                      first_token_s=first_token_s)
    r.error_code = error_code
    return r


def make_pool(pinned=0, files=0, holders=None) -> PoolStatus:
    return PoolStatus("node-p0", "e1", "/dev/shm/x/slab", 100, 7, 1000, 0, pinned, holders or {}, files, files * 4096)


class LinearPrefill:
    def seconds(self, input_tokens: int, prefix_tokens: int) -> float:
        return 0.01 + 0.001 * (input_tokens - prefix_tokens)


# --------------------------------------------------------------------------- load


def test_resolve_trace_names_and_paths(tmp_path, monkeypatch):
    from tools.moonbus.traces.rows import resolve_trace

    monkeypatch.setenv("MOONBUS_TRACES", str(tmp_path))
    (tmp_path / "synthetic_trace.jsonl").write_text("")
    assert resolve_trace("synthetic") == tmp_path / "synthetic_trace.jsonl"
    assert resolve_trace("conversation").name == "conversation_trace.jsonl"
    assert resolve_trace("/tmp/x.jsonl") == Path("/tmp/x.jsonl")


def test_schedule_wraps_around_keeping_the_trace_rate():
    rows = make_rows(1000, 2000, 4000)  # span 3 s, mean gap 1.5 s: one pass is 4.5 s
    assert sl.cycle_ms(rows) == 4500
    assert sl.trace_rate(rows) == pytest.approx(3 / 4.5)
    plan = sl.schedule(rows, time_scale=0.5, count=7)
    assert [a.row_index for a in plan] == [0, 1, 2, 0, 1, 2, 0]
    assert [a.seq for a in plan] == list(range(7))
    assert [a.at_s for a in plan] == pytest.approx([0, 0.5, 1.5, 2.25, 2.75, 3.75, 4.5])
    by_time = sl.schedule(rows, time_scale=0.5, duration_s=2.75)
    assert [a.at_s for a in by_time] == pytest.approx([0, 0.5, 1.5, 2.25])
    with pytest.raises(ValueError):
        sl.schedule(rows, 1.0)


def test_schedule_of_rows_at_one_instant_is_one_pass_per_second():
    rows = make_rows(0, 0)
    assert [a.at_s for a in sl.schedule(rows, 1.0, count=5)] == [0, 0, 1, 1, 2]


def test_capacity_is_prefill_instances_over_mean_predicted_prefill():
    lengths = [sl.prompt_length(r, 16, None) for r in make_rows(0, 0, input_length=1024)]  # 32 tokens each
    assert lengths == [32, 32]
    # 0.01 + 0.032 = 0.042 s each: 2 instances take 2 / 0.042 req/s
    assert sl.capacity_rps(LinearPrefill(), lengths, 2) == pytest.approx(2 / 0.042)
    assert sl.prompt_length(make_rows(0)[0], 16, 20) == 20
    with pytest.raises(ValueError):
        sl.capacity_rps(LinearPrefill(), [], 1)


def test_load_sets_the_time_scale_from_the_target_rate():
    rows = make_rows(0, 1000, 2000, 3000)  # 1 req/s of trace time
    assert sl.time_scale_for(rows, target_rps=4.0) == pytest.approx(0.25)
    assert sl.time_scale_for(rows, speed=2.0) == pytest.approx(0.5)
    plan = sl.schedule(rows, sl.time_scale_for(rows, target_rps=4.0), duration_s=2.0)
    assert len(plan) == 8  # 4 req/s for 2 s
    assert sl.workload_rows(rows, 6) == rows + rows[:2]


# --------------------------------------------------------------------------- outcomes


@pytest.mark.parametrize("result, kind, reason", [
    (make_result(), "completed", ""),
    (make_result(REJECTED_ARRIVAL, 429, "HTTP 429: busy"), "429", ""),
    (make_result(REJECTED_LATE, 200, "{'code': 429}", 429, first_token_s=1.0), "failed",
     "rejected late, after the stream started (its prefill wasted): {'code': 429}"),
    (make_result(REJECTED_LATE, 200, "{'code': 429}", 429), "failed",  # a stream begins with a token: an event
     "rejected late, after the stream started (its prefill wasted): {'code': 429}"),
    (make_result(FAILED, 503, "HTTP 503: no instance"), "503", ""),
    (make_result(FAILED, 200, "{'code': 503}", 503), "failed", "error event 503 in the stream: {'code': 503}"),
    (make_result(FAILED, 500, "HTTP 500: internal"), "failed", "HTTP 500: internal"),
    (make_result(FAILED, 200, "{'code': 504}", 504), "failed", "error event 504 in the stream: {'code': 504}"),
    (make_result(FAILED, 0, "ClientConnectorError: refused", request_id=""), "failed", "connection error: ClientConnectorError: refused"),
    (make_result(FAILED, 200, ""), "failed", "the stream ended without [DONE]"),
])
def test_classify(result, kind, reason):
    o = sv.classify(result)
    assert (o.kind, o.reason, o.timed_out) == (kind, reason, False)


def test_a_timeout_fails_and_never_ended():
    o = sv.classify(make_result(FAILED, 200, "TimeoutError: "))
    assert (o.kind, o.timed_out) == ("failed", True)
    assert sv.classify(make_result(FAILED, 0, "ServerTimeoutError: read")).timed_out


def test_event_log_records_terminal_migrated_restarted_once_per_stream_sequence():
    log = sv.EventLog()
    log.add(Event("completed", 0, "gateway", "g", "a"), 1)
    log.add(Event("completed", 0, "gateway", "g", "a"), 1)  # redelivered: same sequence
    log.add(Event("routed", 0, "conductor", "c", "a"), 2)
    log.add(Event("migrated", 0, "conductor", "c", "b", {"attempt": 1}), 3)
    log.add(Event("failed", 0, "gateway", "g", "b"), 4)
    log.add(Event("cancelled", 0, "gateway", "g", "b"), 5)
    log.add(Event("restarted", 0, "supervisor", "up", "", {"kind": "prefill", "pid": 9}), 6)
    assert log.terminal == {"a": ["completed"], "b": ["failed", "cancelled"]}
    assert log.migrated == {"b": 1} and log.restarted == {"prefill": 1}


def test_each_kill_names_the_requests_it_handed_back_and_how_they_ended():
    log, t0 = sv.EventLog(), 1000.0
    kills = [sc.Kill(8.0, "decode", "decode-0", 11), sc.Kill(16.0, "messenger", "messenger-d1", 12)]
    log.add(Event("migrated", t0 + 8.3, "gateway", "g", "a", {"attempt": 1, "reason": "instance decode-0 exited",
                                                            "resumed_tokens": 40, "before_first_token": False}), 1)
    log.add(Event("prefilled", t0 + 8.5, "prefill", "prefill-0", "a", {"attempt": 1, "cached_tokens": 96}), 2)
    log.add(Event("migrated", t0 + 8.4, "gateway", "g", "b", {"attempt": 1, "reason": "instance decode-0 exited",
                                                            "resumed_tokens": 0, "before_first_token": True}), 3)
    # names no process: the latest kill before it; a request handed back before any kill is no kill's
    log.add(Event("migrated", t0 + 17.0, "gateway", "g", "c", {"attempt": 1, "reason": "the KV transfer failed",
                                                             "resumed_tokens": 0, "before_first_token": True}), 4)
    log.add(Event("migrated", t0 + 2.0, "gateway", "g", "d", {"attempt": 1, "reason": "shutting down"}), 5)
    results = [make_result(request_id=i) for i in "abcd"]
    outcomes = [sv.Outcome(sv.COMPLETED), sv.Outcome(sv.COMPLETED), sv.Outcome(sv.REJECTED_429), sv.Outcome(sv.COMPLETED)]
    first, second = sv.touched_by_kills(kills, t0, log, results, outcomes)
    assert [(r["request_id"], r["how"], r["cached_tokens"], r["ended"]) for r in first["requests"]] == [
        ("a", "resumed", 96, "completed"), ("b", "re-dispatched", None, "completed")]
    assert [(r["request_id"], r["ended"]) for r in second["requests"]] == [("c", "429")]
    report = make_report()
    report["chaos"]["touched"] = [first, second]
    text = soak_report.format_text(report)
    assert ("kill at 8.0 s of decode-0 (decode): 2 requests handed back: 1 re-dispatched before their first token, "
            "1 resumed after their first token (cached tokens of the new prefill: median 96, min 96, max 96); "
            "they ended completed 2") in text


def test_exactly_once_finds_ended_twice_and_never_ended():
    results = [make_result(request_id="a"), make_result(request_id="b"), make_result(request_id="c"),
               make_result(FAILED, 200, "TimeoutError: ", request_id="d"), make_result(FAILED, 0, "refused", request_id="")]
    outcomes = [sv.classify(r) for r in results]
    twice, never = sv.exactly_once(results, outcomes, {"a": ["completed"], "b": ["completed", "failed"], "d": ["cancelled"]})
    assert twice == [{"request_id": "b", "seq": 1, "terminal": ["completed", "failed"]}]
    assert [(n["request_id"], n["seq"]) for n in never] == [("c", 2), ("d", 3)]
    violations = sv.request_violations(results, outcomes, twice, never)
    assert [v.subject for v in violations] == ["d", "#4", "b", "c", "d"]
    assert str(violations[2]) == "request b: ended twice: completed, failed"
    assert sv.exit_code(violations) == 1


# --------------------------------------------------------------------------- leaks


def test_an_idle_cluster_has_no_leak():
    probe = sv.Probe(0, {"node-p0": make_pool(files=2)}, {}, {}, {"node-p0": 2})  # 2 files left by an earlier run
    assert probe.idle() and probe.unknown() == [] and probe.pool_request_files == 0
    assert sv.leak_violations(probe, dev_shm_growth=10 << 20) == []
    assert sv.exit_code([]) == 0


def test_leaks_by_resource():
    probe = sv.Probe(2, {"node-p0": make_pool(3, 1, {"prefill-0:x/cmpl-9": 3}), "node-d0": None},
                     {"node-d0": "no reply (TimeoutError)"}, {"node-p0/cmpl-9.kv": 4096, "node-p0/cmpl-8.kv": 4096})
    assert not probe.idle()
    assert probe.unknown() == ["messenger node-d0: no reply (TimeoutError)"]
    got = [str(v) for v in sv.leak_violations(probe, dev_shm_growth=200 << 20, slab_growth=100 << 20)]
    assert got == [
        "resource conductor: 2 requests still in flight",
        "resource messenger node-d0: no status until the drain timeout (no reply (TimeoutError))",
        "resource messenger node-p0: 3 blocks pinned: prefill-0:x/cmpl-9 (3)",
        "resource messenger node-p0: 1 more request KV files than at the start (1 now, 4096 bytes)",
        "resource shm directory: 2 request KV files left (8192 bytes): node-p0/cmpl-8.kv, node-p0/cmpl-9.kv",
        "resource /dev/shm: grew by 200.0 MiB (100.0 MiB of it our slabs, 0.0 MiB others' files): more than 64 MiB unexplained",
    ]


def test_slab_growth_is_not_a_dev_shm_leak_and_unknown_conductor_is():
    probe = sv.Probe(None, {})
    assert not probe.idle() and probe.unknown() == ["conductor: no status reply"]
    got = sv.leak_violations(probe, dev_shm_growth=1300 << 20, slab_growth=250 << 20, others_growth=1024 << 20)
    assert [str(v) for v in got] == ["resource conductor: no status reply until the drain timeout"]
    got = sv.leak_violations(sv.Probe(0, {}, {}, {}), dev_shm_growth=1400 << 20, slab_growth=250 << 20, others_growth=1024 << 20)
    assert [v.subject for v in got] == ["/dev/shm"]  # 126 MiB that no file explains
    got = sv.leak_violations(sv.Probe(0, {}, {}, {}), 512 << 20, deleted_maps=["prefill-0: /dev/shm/m/slab-1 (deleted)"])
    assert str(got[0]).endswith("unexplained; removed files still mapped: prefill-0: /dev/shm/m/slab-1 (deleted)")


# --------------------------------------------------------------------------- the cluster's state file


NEW_STATE = {"url": "http://127.0.0.1:8000", "nats_url": "nats://127.0.0.1:4333", "model": "tiny-random", "home": "/h",
             "shm_root": "/dev/shm/moonbus-4333", "profile": "", "prefill": 2, "decode": 1, "coupled": 0,
             "supervisor_pid": 1, "processes": {
                 "prefill-0": {"kind": "prefill", "node": "node-p0", "pid": 11, "restarts": 1, "state": "running"},
                 "prefill-1": {"kind": "prefill", "node": "node-p1", "pid": 12, "restarts": 0, "state": "restarting"},
                 "messenger-p0": {"kind": "messenger", "node": "node-p0", "pid": 13, "restarts": 2, "state": "running"},
                 "messenger-d0": {"kind": "messenger", "node": "node-d0", "pid": 14, "restarts": 0, "state": "running"},
                 "nats": {"kind": "nats", "node": "", "pid": 10, "restarts": 0, "state": "gave_up"}}}


def test_state_file_new_and_old_formats():
    state = sc.ClusterState.from_dict(NEW_STATE)
    assert state.missing == () and state.num_prefill == 2
    assert state.messenger_nodes() == ["node-d0", "node-p0"]
    assert state.restarts_by_kind() == {"prefill": 1, "messenger": 2, "nats": 0}
    old = sc.ClusterState.from_dict({"url": "http://x", "nats_url": "nats://127.0.0.1:4555"})
    assert old.processes == {} and old.num_prefill == 0 and "processes" in old.missing and "shm_root" in old.missing
    assert sc.guess_shm_root(old.nats_url) == "/dev/shm/moonbus-4555"


def test_chaos_picks_only_running_processes_of_listed_kinds_reproducibly():
    state = sc.ClusterState.from_dict(NEW_STATE)
    picks = [sc.choose_victim(state, ["prefill", "nats"], random.Random(s)).name for s in range(20)]
    assert set(picks) == {"prefill-0"}  # prefill-1 is restarting, nats gave up
    a = [sc.choose_victim(state, ["prefill", "messenger"], random.Random(7)).name for _ in range(3)]
    assert a == [sc.choose_victim(state, ["prefill", "messenger"], random.Random(7)).name for _ in range(3)]
    assert sc.choose_victim(state, ["decode"], random.Random(0)) is None


def test_others_shm_bytes_skips_our_directory(tmp_path: Path):
    (tmp_path / "ours").mkdir()
    (tmp_path / "ours" / "slab").write_bytes(b"x" * 8192)
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "slab").write_bytes(b"x" * 4096)
    (tmp_path / "loose").write_bytes(b"x" * 4096)
    assert 8192 <= sc.others_shm_bytes(str(tmp_path / "ours"), str(tmp_path)) < 8192 + 8192


def test_deleted_shm_maps_names_a_removed_file_still_mapped(tmp_path: Path):
    slab = tmp_path / "slab-old"
    slab.write_bytes(b"\0" * 4096)
    with open(slab, "r+b") as f:
        mapped = mmap.mmap(f.fileno(), 4096)
    slab.unlink()
    state = sc.ClusterState(processes={"prefill-0": sc.ProcInfo("prefill-0", "prefill", pid=os.getpid())})
    try:
        assert sc.deleted_shm_maps(state, str(tmp_path)) == [f"prefill-0: {slab} (deleted)"]
    finally:
        mapped.close()
    assert sc.deleted_shm_maps(state, str(tmp_path)) == []


def test_scan_shm_counts_request_files_apart_from_slabs(tmp_path: Path):
    (tmp_path / "node-p0").mkdir()
    (tmp_path / "node-p0" / "slab").write_bytes(b"x" * 8192)
    (tmp_path / "node-p0" / "cmpl-1.kv").write_bytes(b"x" * 5000)
    (tmp_path / "node-p0" / ".cmpl-2.kv.tmp").write_bytes(b"x")
    usage = sc.scan_shm(str(tmp_path))
    assert sorted(usage.request_files) == ["node-p0/.cmpl-2.kv.tmp", "node-p0/cmpl-1.kv"] and usage.slab_files == 1
    assert usage.slab_bytes >= 8192 and usage.request_bytes >= 5000
    assert usage.summary()["request_files"] == 2
    assert sc.scan_shm(str(tmp_path / "absent")) is None


# --------------------------------------------------------------------------- send_one against a fake gateway


async def test_send_one_records_request_id_status_and_stream_error_code():
    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body["max_tokens"] == 1:
            return web.json_response({"error": {"message": "rejected at arrival: ttft 31.2s > slo 30s", "code": "overloaded"}},
                                     status=429, headers={"X-Request-Id": "cmpl-r"})
        if body["max_tokens"] == 2:  # admitted, then turned away by its prefill instance before its first token
            return web.json_response({"error": {"message": "rejected: prefill instance p0 would begin it 27.4s after it "
                                                           "was queued", "code": "overloaded"}},
                                     status=429, headers={"X-Request-Id": "cmpl-l"})
        resp = web.StreamResponse(headers={"X-Request-Id": "cmpl-s"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"token_ids": [5]}]}\n\n')
        await resp.write(b'data: {"error": {"message": "instance lost", "code": 503}}\n\ndata: [DONE]\n\n')
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    try:
        async with aiohttp.ClientSession() as session:
            rejected = await replay.send_one(session, url, "m", 0, [5, 6], 1, 0.0, 0.0)
            late = await replay.send_one(session, url, "m", 2, [5, 6], 2, 0.0, 0.0)
            broken = await replay.send_one(session, url, "m", 1, [5, 6], 4, 0.0, 0.0)
    finally:
        await runner.cleanup()
    assert (rejected.status, rejected.http_status, rejected.request_id, rejected.error_code) == (REJECTED_ARRIVAL, 429, "cmpl-r", 0)
    # the measures count it as turned away after admission; the soak, as any HTTP 429
    assert (late.status, late.http_status, late.request_id, sv.classify(late).kind) == (REJECTED_LATE, 429, "cmpl-l", "429")
    assert (broken.status, broken.http_status, broken.request_id, broken.error_code) == (FAILED, 200, "cmpl-s", 503)
    assert broken.output_tokens == 1
    # a stream that started and broke is a failed request, not a 503 (its migration failed)
    assert [sv.classify(r).kind for r in (rejected, broken)] == ["429", "failed"]


# --------------------------------------------------------------------------- the report


def make_report(violations=()) -> dict:
    return {
        "cluster": {"url": "http://127.0.0.1:8000"}, "trace": "t", "sent": 3, "span_s": 2.5, "load_end_s": 2.5,
        "load": {"load": 2.0, "speed": 4.0, "time_scale": 0.25, "target_rps": 1.5},
        "capacity": {"rps": 0.75, "num_prefill": 1, "profile": "p.json", "mean_prefill_s": 1.333},
        "scalings": ["16 tokens per hash id"], "outcomes": {"completed": 2, "429": 1, "503": 0, "failed": 0},
        "migrated": 1, "exactly_once": {"ended_twice": [], "never_ended": [], "terminal_events": 3},
        "chaos": {"kinds": ["prefill"], "every_s": 1.0, "kills": [{"at_s": 1.0, "kind": "prefill", "name": "prefill-0", "pid": 9}],
                  "kills_by_kind": {"prefill": 1}, "restarts_by_kind": {"prefill": 1}, "restarted_events_by_kind": {"prefill": 1}},
        "rss_peak_by_kind": {"prefill": 300 << 20},
        "shm": {"root": "/dev/shm/m", "before": {"request_files": 0, "request_bytes": 0, "slab_files": 1, "slab_bytes": 0},
                "after": {"request_files": 0, "request_bytes": 0, "slab_files": 1, "slab_bytes": 4 << 20},
                "dev_shm_before": 100 << 20, "dev_shm_after": 104 << 20, "dev_shm_growth": 4 << 20, "slab_growth": 4 << 20,
                "others_growth": 0},
        "slabs": {"before": {"node-p0": {"used": 0, "capacity": 100}}, "after": {"node-p0": None}},
        "drain": {"seconds": 1.2, "idle": True, "probe": sv.Probe(0, {}, {}, {}).to_json(), "unknown_seen": []},
        "latency": {"ttft_p50_s": 0.1, "ttft_p90_s": 0.2}, "notes": ["a note"],
        "timeline": [{"t": 0.0, "rss": {"prefill": 200 << 20}, "dev_shm_used": 100 << 20, "shm_request_files": 0,
                      "shm_request_bytes": 0, "shm_slab_bytes": 0, "outcomes": {}},
                     {"t": 1.0, "rss": {"prefill": 300 << 20}, "dev_shm_used": 104 << 20, "shm_request_files": 1,
                      "shm_request_bytes": 4096, "shm_slab_bytes": 4 << 20, "outcomes": {}}],
        "violations": list(violations), "exit_code": 1 if violations else 0,
        "requests": [{"outcome": "completed", "arrival_s": 0.0, "end_s": 0.5}, {"outcome": "429", "arrival_s": 0.2, "end_s": None},
                     {"outcome": "completed", "arrival_s": 1.0, "end_s": 2.5}],
    }


def test_report_text_and_plot(tmp_path: Path):
    text = soak_report.format_text(make_report())
    assert "capacity estimate used: 0.750 req/s" in text and "= 2 x capacity" in text
    assert "outcomes: completed 2, 429 1, 503 0, failed 0; migrated 1" in text
    assert "kills prefill 1" in text and "peak RSS: prefill 300.0 MiB" in text
    assert "slab blocks used/capacity: before node-p0 0/100; after node-p0 ?" in text
    assert "request files 0 -> 0 (0 new, 0.0 MiB)" in text and "achieved: 0.800 completed req/s" in text
    assert text.endswith("nothing leaked, and the completed ones met the SLOs")
    unjudged = make_report()
    unjudged["slo"] = (unjudged.get("slo") or {}) | {"min_attainment": 0}
    assert soak_report.format_text(unjudged).endswith("(SLO attainment printed above, not judged: --min-attainment 0)")
    failed = soak_report.format_text(make_report(["request cmpl-1: never ended: no terminal event"]))
    assert failed.splitlines()[-2:] == ["FAIL: 1 violation(s)", "  request cmpl-1: never ended: no terminal event"]
    assert soak_report.outcomes_per_second(make_report()["requests"], 3) == {
        "completed": [1, 0, 1], "429": [1, 0, 0], "503": [0, 0, 0], "failed": [0, 0, 0]}
    png = soak_report.plot(make_report(), tmp_path / "soak.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_served_late_fails_the_soak():
    assert sv.slo_violations(0.95, 0.9, 40) == []
    [v] = sv.slo_violations(0.72, 0.9, 40)
    assert v.what == "slo" and "72.0% of the 40 completed requests" in v.detail
    assert sv.slo_violations(0.5, 0.0, 40) == [] and sv.slo_violations(None, 0.9, 0) == []


def test_a_probe_with_pools_is_written_as_json():
    report = sv.Probe(0, {"node-p0": make_pool(files=2), "node-d0": None}).to_json()
    assert report["pools"]["node-d0"] is None
    assert report["pools"]["node-p0"]["request_files"] == 2
    json.dumps(report)
