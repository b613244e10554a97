"""`moonbus bench transfer` states the cost of the links' keyed MAC: ours (the MAC on, the
default) and ours without it, measured in turn in one run, each pattern's ratio printed, the
report's own rows unchanged. Speed is printed, never asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--model", "tiny-random", "--sizes", "block,1MiB", "--handoff-tokens", "64", "--pull-blocks", "4",
         "--tail-tokens", "", "--streams", "1", "--no-tls", "--repeats", "2", "--case-seconds", "0.05"]


def bench(home: Path, *extra: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "tools.moonbus.cli", "bench", "transfer", "--home", str(home), *SMALL, *extra]
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_the_macs_cost_is_a_ratio_per_pattern_beside_the_rows(tmp_path):
    done = bench(tmp_path, "--json")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert "ours_tcp_nomac" not in {r["case"] for r in report["rows"]}  # the rows are the report's as before
    ours = {r["pattern"]: r for r in report["rows"] if r["case"] == "ours_tcp"}
    cost = report["link_mac"]
    assert [c["pattern"] for c in cost] == list(ours) == ["size:block", "size:1MiB", "handoff:64", "pull:4"]
    for c in cost:
        assert c["mac_gib_s"] == ours[c["pattern"]]["gib_s"] and c["nomac_gib_s"] > 0 and c["nomac_intact"] is True
        assert c["ratio"] == pytest.approx(c["mac_gib_s"] / c["nomac_gib_s"])


def test_the_printed_report_shows_both_speeds_and_their_ratio(tmp_path):
    done = bench(tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    section = done.stdout.split("the link's keyed MAC")[1].splitlines()
    assert "MAC GiB/s" in section[1] and "none GiB/s" in section[1] and "ratio" in section[1]
    assert [line.split()[0] for line in section[2:6]] == ["size:block", "size:1MiB", "handoff:64", "pull:4"]
    assert all(line.rstrip().endswith("x") for line in section[2:6])


def test_no_mac_cost_skips_it(tmp_path):
    done = bench(tmp_path, "--json", "--no-mac-cost")
    assert done.returncode == 0, done.stderr[-4000:]
    assert "link_mac" not in json.loads(done.stdout.strip().splitlines()[-1])
