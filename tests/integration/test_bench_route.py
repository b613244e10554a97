"""`moonbus bench conductor`, run small: the pure-decision rows (a few hundred decisions), then the
live route: real nats-server, cache index and conductors, 2P+2D fake instances, a few thousand
blocks, a few hundred routes, 1 then 2 conductors. Checks what a user reads in the report: the
promised rows and stages, that the route counts add up to the routes sent, that the real
conductors answered every route from the real index (no index timeouts: the conductors are given
a timeout that no load on this machine reaches), and that each goal's verdict is the one its
numbers give; speed is printed by the benchmark, never asserted here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from common.decide import route as routing
from tests.integration.conftest import conversation_trace
from tools.moonbus.traces.rows import load_trace, prompt_token_ids
from tools.moonbus.bench import conductor as bench
from tools.moonbus.bench.fleet import PromptBuilder

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
LATENCY_ROUTES, THROUGHPUT_ROUTES, BLOCKS = 150, 300, 3_000


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    argv = [sys.executable, "-m", "tools.moonbus.cli", "bench", "conductor", "--json",
            "--fill-rows", "300", "--decisions", "200", "--states", "16",
            "--live-prefill", "2", "--live-decode", "2", "--live-blocks", str(BLOCKS), "--live-queries", "200",
            "--live-warmup", "20", "--live-latency-routes", str(LATENCY_ROUTES),
            "--live-throughput-routes", str(THROUGHPUT_ROUTES), "--live-concurrency", "8",
            "--live-conductors", "1,2", "--live-index-timeout", "30", "--live-model-home", str(tmp_path_factory.mktemp("model-home")),
            "--trace", conversation_trace(tmp_path_factory.mktemp("trace"))]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_pure_rows_price_every_stage_of_the_live_route(report):
    results = report["results"]
    assert set(results) == {"kvcache-centric", "random"} and report["decisions"] == 200
    for policy, x in results.items():
        assert 0 < x["p50_us"] <= x["p99_us"] <= x["max_us"]
        assert set(x["stage_p50_us"]) == set(x["stage_p99_us"]) == set(routing.STAGES)  # the route's own stages
        assert all(x["stage_p50_us"][s] <= x["stage_p99_us"][s] for s in x["stage_p50_us"])
        assert 0 <= x["pull_share"] <= 1 and 0 <= x["reject_share"] < 1
        # the instance reports between routes are timed apart, and shared out over the routes
        assert 0 < x["report_p50_us"] <= x["report_p99_us"] and x["report_us_per_route"] > 0
    reports_row = [r for r in bench.summary(report) if "instance reports" in r["row"]]  # make bench's table says so
    assert [r["ours"] for r in reports_row] == [f"{results[report['ours']]['report_us_per_route']:.0f} us"]
    assert results["random"]["pull_share"] == 0 and results["random"]["mean_prefix_blocks"] == 0  # it never matches
    assert results["kvcache-centric"]["mean_prefix_blocks"] > 0
    ours = results[report["ours"]]
    assert report["ratio_p99"] == pytest.approx(ours["p99_us"] / results["random"]["p99_us"])
    assert report["goal_met"] == (ours["p99_us"] < report["goal_p99_us"])


def test_live_rows_have_the_promised_fields(report):
    live = report["live"]
    assert [r["conductors"] for r in live["rows"]] == [1, 2]
    for row in live["rows"]:
        assert row["case"] == "live_route"
        assert row["blocks_indexed"] >= BLOCKS
        assert 0 < row["p50_us"] <= row["p99_us"] <= row["max_us"]
        assert row["routes_per_s"] > 0 and 0.0 <= row["admitted_share"] <= 1.0
        assert row["cpu_us_per_route"]["conductor"] > 0 and row["cpu_us_per_route"]["total"] > 0
    first, second = live["rows"]
    assert live["ratio_routes_per_s"] == pytest.approx(second["routes_per_s"] / first["routes_per_s"])
    assert live["ratio_of"] == "2 vs 1 conductors"
    assert live["goal_p99_met"] == all(r["p99_us"] <= live["goal_p99_us"] for r in live["rows"])
    assert live["goal_ratio_met"] == (live["ratio_routes_per_s"] >= live["goal_ratio"])
    assert live["setup"]["prefill_instances"] == 2 and live["setup"]["decode_instances"] == 2
    assert "nats-server" in live["shares_cores_with"]


def test_every_route_was_answered_by_the_real_conductors_from_the_real_index(report):
    first, second = report["live"]["rows"]
    for row in (first, second):
        assert row["unanswered"] == 0
        assert (row["latency_routes"], row["throughput_routes"]) == (LATENCY_ROUTES, THROUGHPUT_ROUTES)
        # every route sent got exactly one answer, and the admitted share is the 200s among them
        assert sum(row["statuses"].values()) == LATENCY_ROUTES + THROUGHPUT_ROUTES
        assert set(row["statuses"]) <= {"200", "429"} and row["admitted_share"] > 0
        assert row["admitted_share"] == pytest.approx(row["statuses"].get("200", 0) / (LATENCY_ROUTES + THROUGHPUT_ROUTES))
        # each timed route left the conductor's `routed` event, found prefixes in the index
        assert row["routed_events"] == LATENCY_ROUTES + THROUGHPUT_ROUTES
        assert row["index_hit_share"] > 0 and row["mean_best_prefix_blocks"] > 0
        assert row["index_timeouts"] == 0  # the index answered every route (a 30 s timeout: load cannot explain one)
    assert first["answered_by"] == {"conductor-0": LATENCY_ROUTES + THROUGHPUT_ROUTES}
    # the queue group spreads routes over both conductors (all on one: odds 2^-449)
    assert set(second["answered_by"]) == {"conductor-0", "conductor-1"}
    assert sum(second["answered_by"].values()) == LATENCY_ROUTES + THROUGHPUT_ROUTES


def test_the_floor_row_is_the_same_routes_answered_by_a_process_that_only_answers(report):
    live = report["live"]
    echo = live["echo"]
    assert echo["prefix_index"] == "echo" and echo["conductors"] == 0
    assert (echo["latency_routes"], echo["throughput_routes"], echo["unanswered"]) == (LATENCY_ROUTES, THROUGHPUT_ROUTES, 0)
    assert echo["statuses"] == {"200": LATENCY_ROUTES + THROUGHPUT_ROUTES}  # the reply bytes of an admitted route
    assert 0 < echo["p50_us"] <= echo["p99_us"] <= echo["max_us"]
    assert echo["cpu_us_per_route"]["echo"] > 0 and "conductor" not in echo["cpu_us_per_route"]
    # what each of our rows adds to it is that row less the floor
    for row, added in zip(live["rows"], live["above_echo"]):
        assert added["conductors"] == row["conductors"]
        assert added["p50_us"] == pytest.approx(row["p50_us"] - echo["p50_us"])
        assert added["p99_us"] == pytest.approx(row["p99_us"] - echo["p99_us"])


def test_prompt_builder_gives_replays_prompts(tmp_path):
    rows = load_trace(conversation_trace(tmp_path), limit=200)
    build = PromptBuilder()
    assert all(build(r) == prompt_token_ids(r, 16, vocab_size=259) for r in rows)
