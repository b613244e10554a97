"""`make bench`'s runner (tools/moonbus/bench/suite.py), run small: one real target in its own
process into a temporary folder. Checks what `make bench` promises: one JSON with the date, the
machine and each target's own JSON and rows, one markdown table with each row's ratio, every
target of TARGETS by default, and a failing target failing the run; speed is never asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tools.moonbus.bench import TARGETS
from tools.moonbus.bench.suite import _ratios, _x, main

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def suite(out: Path, *args: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "tools.moonbus.bench.suite", "--out", str(out), *args]
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_one_json_and_one_table_with_the_date_the_machine_and_each_rows_ratio(tmp_path):
    done = suite(tmp_path, "--targets", "store", "--with", "store=--blocks 4 --repeats 1")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["date"][:2] == "20" and report["machine"]["cores"] >= 1 and report["machine"]["cpu"]
    store = report["targets"]["store"]
    assert store["exit"] == 0 and store["argv"] == ["moonbus", "bench", "store", "--json", "--blocks", "4", "--repeats", "1"]
    own = store["result"]["results"]  # the target's own --json output, kept whole
    assert [r["ratio"] for r in store["rows"]] == [r["ratio"] for r in own] and len(own) == 4
    table = (tmp_path / "BENCH.md").read_text()
    assert report["date"] in table and report["machine"]["cpu"] in table and "### store" in table
    for r in store["rows"]:
        # a ratio below 0.1 is written with three decimals (a loaded machine brings the store's there)
        assert f"| {r['row']} | {r['ours']} | {r['baseline']} | {_x(r['ratio'])} |" in table


def test_a_target_that_fails_fails_the_run_and_says_why(tmp_path):
    done = suite(tmp_path, "--targets", "store", "--with", "store=--no-such-flag")
    assert done.returncode == 1
    store = json.loads((tmp_path / "bench.json").read_text())["targets"]["store"]
    assert store["exit"] != 0 and store["result"] is None and "--no-such-flag" in store["stderr_tail"]
    assert "FAILED" in (tmp_path / "BENCH.md").read_text()


def test_every_target_runs_by_default(monkeypatch, tmp_path):
    ran = []
    monkeypatch.setattr("tools.moonbus.bench.suite.run_target",
                        lambda name, extra, out: ran.append(name) or {"exit": 0, "seconds": 0.0, "argv": [name],
                                                                      "load_before": (0, 0, 0), "rows": []})
    assert main(["--out", str(tmp_path)]) == 0
    assert ran == list(TARGETS)


def test_a_target_without_summary_gives_its_ratios_by_path():
    result = {"rows": [{"case": "a", "ratio": 1.5, "seconds": 2.0}, {"name": "b", "vs_json": 0.5}], "ratio_all": 3,
              "goal_met": True}
    assert list(_ratios(result, "")) == [("rows.a.ratio", 1.5), ("rows.b.vs_json", 0.5), ("ratio_all", 3)]
