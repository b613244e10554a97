"""`moonbus bench transfer`, run small: real receiving processes over loopback, a few sizes, two
short prompts for the handoff tail (tiny-random), our tcp with one connection per peer and with two. Checks the report's structure and that every
byte arrived intact (the receivers' checksums of what they hold); speed is printed by the
benchmark, never asserted here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import xxhash

from tools.moonbus.bench.transfer_peers import OursPeer, RawSocketPeer

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
SIZES = [4096, 1 << 20, 8 << 20]  # the last is striped over ours_tcp_x2's two connections
TAIL_TOKENS = [32, 96]
CASES = ["ours_tcp", "ours_tcp_x2", "raw_socket", "mooncake_te"]


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    argv = [sys.executable, "-m", "tools.moonbus.cli", "bench", "transfer", "--json", "--model", "tiny-random",
            "--home", str(tmp_path_factory.mktemp("home")), "--sizes", "4096,1MiB,8MiB", "--repeats", "2",
            "--tail-tokens", ",".join(map(str, TAIL_TOKENS))]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_every_case_has_a_row_per_size_with_the_promised_fields(report):
    rows = [r for r in report["rows"] if r["case"] != "handoff_tail"]
    assert [(r["case"], r["bytes"]) for r in rows] == [(c, n) for n in SIZES for c in CASES]
    for r in rows:
        assert {"case", "bytes", "seconds", "gib_s", "vs_raw_socket", "vs_mooncake", "intact"} <= set(r)
        if r["case"] == "mooncake_te" and report["mooncake"] != "installed":
            assert r["seconds"] is None and r["note"].startswith("not installed")
            continue
        assert r["seconds"] > 0 and r["runs"] >= 2
        assert r["gib_s"] == pytest.approx(r["bytes"] / r["seconds"] / (1 << 30))
    raw = {r["bytes"]: r["gib_s"] for r in rows if r["case"] == "raw_socket"}
    for r in rows:
        if r["gib_s"] is not None:
            assert r["vs_raw_socket"] == pytest.approx(r["gib_s"] / raw[r["bytes"]])
    assert report["layout"] == "4x2x2x16 float32" and report["bytes_per_token"] == 4 * 2 * 2 * 16 * 4


def test_every_byte_arrived_intact(report):
    measured = [r for r in report["rows"] if r["seconds"] is not None]
    assert measured and all(r["intact"] is True for r in measured)


def test_handoff_tail_rows_stand_next_to_a_layers_compute(report):
    tail = [r for r in report["rows"] if r["case"] == "handoff_tail"]
    assert [r["prompt_tokens"] for r in tail] == TAIL_TOKENS
    for r in tail:
        assert r["bytes"] == r["prompt_tokens"] * 2 * 2 * 16 * 4  # one layer's slice of tiny-random
        assert 0 < r["write_s"] <= r["seconds"] and r["layer_compute_s"] > 0
        assert r["vs_layer_compute"] == pytest.approx(r["seconds"] / r["layer_compute_s"])
    assert len(report["goals"]["tail_minus_slice_s"]) == len(TAIL_TOKENS)


@pytest.mark.parametrize("peer_class", [OursPeer, RawSocketPeer])
def test_a_receivers_digest_is_of_the_bytes_it_holds(peer_class):
    """The intact check is worth something only if the digest comes from the receiver's memory."""
    n = 1 << 16
    first, second = np.frombuffer(os.urandom(n), np.uint8), np.frombuffer(os.urandom(n), np.uint8)
    peer = peer_class(n, os.urandom(32)) if peer_class is OursPeer else peer_class(n)
    try:
        peer.send(memoryview(first))
        assert peer.digest(n) == xxhash.xxh3_64_intdigest(first)
        peer.send(memoryview(second)[: n // 2])
        assert peer.digest(n) == xxhash.xxh3_64_intdigest(np.concatenate([second[: n // 2], first[n // 2:]]))
    finally:
        peer.close()
