"""`moonbus bench transfer`, run small: real receiving processes over loopback, tiny-random's KV
geometry (bfloat16), every pattern (single writes, two streamed handoffs, two pulls), two short
prompts for the handoff tail, our tcp with one connection per peer and with two. Checks the
report's rows and fields, that every case of a pattern says what integrity work it does, and that
every run's bytes were checked at the destination and right; speed is printed by the benchmark,
never asserted here."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.required import missing
from tools.moonbus.bench.transfer_patterns import Case, digest, make_buffer, measure, pull_pattern, size_pattern
from tools.moonbus.bench.transfer_peers import OursPeer, mooncake_missing
from tools.moonbus.bench.transfer_socket import SocketPeer

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
BPT = 4 * 2 * 2 * 16 * 2  # tiny-random: 4 layers, K and V, 2 kv heads, head_dim 16, 2 bytes
BLOCK = 16 * BPT
PATTERNS = {"size:block": (BLOCK, 1), "size:1MiB": (1 << 20, 1), "size:8MiB": (8 << 20, 1),  # 8 MiB: striped by x2
            "handoff:64": (64 * BPT, 4), "handoff:256": (256 * BPT, 4), "pull:4": (4 * BLOCK, 4),
            "pull:16": (16 * BLOCK, 16)}  # name -> (bytes, messages)
PUSH_CASES = ["ours_tcp", "ours_tcp_x2", "ours_tcp_tls", "socket_verified", "socket", "mooncake_te_verified",
              "mooncake_te"]
PULL_CASES = ["ours_tcp", "ours_tcp_unverified", "ours_tcp_tls", "ours_tcp_tls_unverified", "socket_verified", "socket",
              "mooncake_te_verified", "mooncake_te"]
TAIL_TOKENS = [32, 96]
FIELDS = {"pattern", "kind", "case", "integrity", "bytes", "messages", "seconds", "gib_s", "runs", "runs_checked",
          "runs_verified", "intact", "vs_socket_verified", "vs_socket", "vs_mooncake_te_verified", "vs_mooncake_te"}


def bench(*extra: str, env: dict | None = None, home: Path) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "tools.moonbus.cli", "bench", "transfer", "--json", "--model", "tiny-random",
            "--home", str(home), *extra]
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    if why := mooncake_missing():
        missing("mooncake", f"the baseline engine cannot be used ({why}); `make setup` installs it")
    done = bench("--sizes", "block,1MiB,8MiB", "--handoff-tokens", "64,256", "--pull-blocks", "4,16",
                 "--repeats", "2", "--case-seconds", "0.05", "--tail-tokens", ",".join(map(str, TAIL_TOKENS)),
                 home=tmp_path_factory.mktemp("home"))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def rows_of(report: dict) -> list[dict]:
    return [r for r in report["rows"] if r["case"] != "handoff_tail"]


def test_every_pattern_has_a_row_per_case_with_the_promised_fields(report):
    rows = rows_of(report)
    expected = [(p, c) for p in PATTERNS for c in (PULL_CASES if p.startswith("pull") else PUSH_CASES)]
    assert [(r["pattern"], r["case"]) for r in rows] == expected
    assert report["layout"] == "4x2x2x16 bfloat16" and report["bytes_per_token"] == BPT
    for r in rows:
        assert (r["bytes"], r["messages"]) == PATTERNS[r["pattern"]]
        if r["case"].startswith("mooncake") and report["mooncake"] != "installed":
            assert r["seconds"] is None and r["note"].startswith("not installed")
            continue
        assert FIELDS <= set(r), FIELDS - set(r)
        assert r["seconds"] > 0 and r["runs"] >= 2
        assert r["gib_s"] == pytest.approx(r["bytes"] / r["seconds"] / (1 << 30))
    speed = {(r["pattern"], r["case"]): r["gib_s"] for r in rows}
    for r in rows:
        if r["gib_s"] is not None:
            assert r["vs_socket_verified"] == pytest.approx(r["gib_s"] / speed[r["pattern"], "socket_verified"])
            assert r["vs_socket"] == pytest.approx(r["gib_s"] / speed[r["pattern"], "socket"])


def test_tls_rows_state_their_cost_against_ours_without_it(report):
    speed = {(r["pattern"], r["case"]): r["gib_s"] for r in rows_of(report)}
    tls = [r for r in rows_of(report) if r["case"] == "ours_tcp_tls"]
    assert {r["pattern"] for r in tls} == set(PATTERNS)
    for r in tls:
        assert r["vs_ours_tcp"] == pytest.approx(r["gib_s"] / speed[r["pattern"], "ours_tcp"])


def test_each_row_says_what_integrity_work_it_does_and_the_fair_baseline_does_the_same(report):
    by = {(r["pattern"], r["case"]): r["integrity"] for r in rows_of(report)}
    for p in PATTERNS:
        ours = "xxh3 on arrival" if p.startswith("pull") else "xxh3 both ends"
        assert by[p, "ours_tcp"] == by[p, "socket_verified"] == ours
        assert by[p, "socket"] == "none"
        if report["mooncake"] == "installed":
            assert (by[p, "mooncake_te_verified"], by[p, "mooncake_te"]) == (ours, "none")
    assert all(by[p, "ours_tcp_unverified"] == "none" for p in PATTERNS if p.startswith("pull"))


def test_every_run_of_every_case_was_checked_and_right(report):
    measured = [r for r in rows_of(report) if r["seconds"] is not None]
    assert measured
    for r in measured:
        assert r["runs_checked"] == r["runs"] + 1  # the warm-up too
        assert r["runs_verified"] == r["runs_checked"] and r["intact"] is True and r["errors"] == [], r


def test_goals_are_judged_against_the_socket_doing_the_same_work(report):
    goals = report["goals"]
    assert goals["ours"] == "ours_tcp" and goals["against"] == "socket_verified"
    assert [g["pattern"] for g in goals["rows"]] == ["size:block", "handoff:64", "handoff:256", "pull:4", "pull:16"]
    by = {(r["pattern"], r["case"]): r for r in rows_of(report)}
    for g in goals["rows"]:
        ours, socket = by[g["pattern"], "ours_tcp"], by[g["pattern"], "socket_verified"]
        if g["measure"] == "round trip":
            assert g["ratio"] == pytest.approx(ours["seconds"] / socket["seconds"]) and g["met"] == (g["ratio"] <= 2.0)
        else:
            assert g["ratio"] == pytest.approx(ours["vs_socket_verified"]) and g["met"] == (g["ratio"] >= 0.8)
    assert goals["all_met"] == all(g["met"] for g in goals["rows"])


def test_handoff_tail_rows_stand_next_to_a_layers_compute(report):
    tail = [r for r in report["rows"] if r["case"] == "handoff_tail"]
    assert [r["prompt_tokens"] for r in tail] == TAIL_TOKENS
    for r in tail:
        assert r["bytes"] == r["prompt_tokens"] * 2 * 2 * 16 * 2  # one layer's slice of tiny-random, bfloat16
        assert 0 < r["write_s"] <= r["seconds"] and r["layer_compute_s"] > 0 and r["intact"] is True
        assert r["vs_layer_compute"] == pytest.approx(r["seconds"] / r["layer_compute_s"])
    assert len(report["goals"]["tail_minus_slice_s"]) == len(TAIL_TOKENS)


def test_without_mooncake_a_required_run_fails_saying_why(tmp_path):
    shadow = tmp_path / "shadow" / "mooncake"  # a package that will not import stands in for a missing one
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(shadow.parent), str(ROOT)])}
    done = bench("--require-mooncake", env=env, home=tmp_path / "home")
    assert done.returncode == 2 and done.stdout == ""
    assert "Mooncake Transfer Engine is required" in done.stderr and "hidden by the test" in done.stderr


@pytest.mark.parametrize("peer_class", [OursPeer, SocketPeer])
def test_a_receivers_digest_is_of_the_bytes_it_holds(peer_class):
    """The per-run check is worth something only if the digest comes from the receiver's memory."""
    n = 1 << 16
    source, theirs = make_buffer(n, 1), make_buffer(n, 2)  # the receiver starts with other bytes
    peer = peer_class(n, 2, os.urandom(32)) if peer_class is OursPeer else peer_class(n, 2)
    try:
        assert peer.digest([(0, n)]) == digest(theirs, [(0, n)])
        half = size_pattern("half", n // 2)
        peer.cases(half, source, np.zeros(8, np.uint8))[0].run([])
        assert peer.digest([(0, n)]) == digest(np.concatenate([source[: n // 2], theirs[n // 2:]]), [(0, n)])
    finally:
        peer.close()


@pytest.mark.parametrize("kind", ["push", "pull"])
def test_a_case_that_moves_nothing_fails_every_run(kind):
    """Every run's bytes differ from the last run's, so stale bytes at the destination are caught."""
    pattern = size_pattern("block", 4096) if kind == "push" else pull_pattern(4, 4096, 0)
    source, local = make_buffer(1 << 16, 0), np.zeros(1 << 16, np.uint8)
    real, stale = SocketPeer(1 << 16, 0), SocketPeer(1 << 16, 0)
    try:
        # the stale receiver holds earlier runs' bytes of this very pattern
        measure(pattern, stale.cases(pattern, source, local)[:1], source, local, 2, itertools.count(1), 0.0)
        idle = Case("idle", "none", lambda _expected: None, stale)
        good, bad = measure(pattern, [real.cases(pattern, source, local)[0], idle], source, local, 3,
                            itertools.count(10), 0.0)
    finally:
        real.close()
        stale.close()
    assert (good["runs_verified"], good["intact"]) == (4, True)
    assert (bad["runs_verified"], bad["intact"]) == (0, False) and "does not hold" in bad["errors"][0]
