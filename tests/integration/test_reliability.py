"""The cluster as users run it: `moonbus up` (its supervisor restarts what dies) under a trace's
load above capacity, with every kind of process SIGKILLed in turn, nats-server included.

`moonbus soak` drives it and judges it: every request ends completed, 429 or 503 (nothing else),
each exactly once in the audit stream, no client waits past the bound, and once the load stops
nothing leaks (no pinned slab slot, no request KV file, no load left at the conductor, /dev/shm
back to its baseline).

Load: the conversation trace at 16 tokens per hash id, outputs capped at 16 tokens, sent 8 times
faster than recorded (about 27 requests/s). A 1-prefill + 2-decode tiny-random cluster on 2
cores serves about 10-15 requests/s, so this is about twice its capacity; the profile's own
estimate is not used here (for tiny-random it sees only the model's compute, a few ms, and
misses the services' per-request cost).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.conftest import conversation_trace
from tools.moonbus.cluster.processes import free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
BOUND_S = 120  # no client may wait longer than this for its whole request
CHAOS = ("prefill", "decode", "messenger", "cache_index", "conductor", "nats")


class Up:
    def __init__(self, home: Path, proc: subprocess.Popen, url: str) -> None:
        self.home, self.proc, self.url = home, proc, url

    def state(self) -> dict:
        return json.loads((self.home / "cluster.json").read_text())

    def log(self) -> str:
        return (self.home / "up.log").read_text(errors="replace")[-3000:]


def moonbus(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.moonbus.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, **kwargs)


def healthy(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
            body = json.loads(resp.read())
        return body["instances"].get("prefill", 0) >= 1 and body["instances"].get("decode", 0) >= 2
    except (OSError, ValueError, KeyError):
        return False


@pytest.fixture(scope="module")
def up(tmp_path_factory, tiny_profile):
    home = tmp_path_factory.mktemp("up")
    port = free_port()
    with open(home / "up.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tools.moonbus.cli", "up", "--model", "tiny-random", "--prefill", "1", "--decode", "2",
             "--home", str(home), "--port", str(port), "--nats-port", str(free_port()), "--profile", tiny_profile],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    cluster = Up(home, proc, f"http://127.0.0.1:{port}")
    deadline = time.monotonic() + 300
    while not (healthy(cluster.url) and (home / "cluster.json").exists()):
        assert proc.poll() is None and time.monotonic() < deadline, cluster.log()
        time.sleep(0.5)
    yield cluster
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_a_soak_above_capacity_with_every_kind_killed_in_turn_fails_and_leaks_nothing(up):
    out = up.home / "soak"
    run = moonbus("soak", "--home", str(up.home), "--trace", conversation_trace(up.home), "--duration", "60", "--speed", "8",
                  "--tokens-per-block", "16", "--max-output", "16", "--vocab-size", "259", "--timeout", str(BOUND_S),
                  "--chaos", ",".join(CHAOS), "--every", "8", "--chaos-order", "cycle", "--seed", "1",
                  "--drain-timeout", "90", "--out", str(out), "--no-progress",
                  # how many meet the SLOs at twice the capacity depends on how busy the machine is: not this test's
                  # question (the soak's SLO verdict has unit tests; goodput is measured by `moonbus bench goodput`)
                  "--min-attainment", "0", timeout=600)
    print(run.stdout[-6000:], run.stderr[-3000:])
    report = json.loads((out / "soak.json").read_text())
    assert run.returncode == 0, report["violations"]
    assert report["violations"] == []
    outcomes = report["outcomes"]
    assert outcomes.get("failed", 0) == 0 and set(outcomes) <= {"completed", "429", "503", "failed"}, outcomes
    assert outcomes["completed"] >= 100 and report["sent"] >= 1000
    assert report["exactly_once"]["ended_twice"] == [] and report["exactly_once"]["never_ended"] == []
    kills = report["chaos"]["kills_by_kind"]
    assert all(kills.get(kind, 0) >= 1 for kind in CHAOS), kills
    restarts = report["chaos"]["restarts_by_kind"]
    assert all(restarts.get(kind, 0) >= kills[kind] for kind in CHAOS), (kills, restarts)
    assert report["migrated"] >= 1  # a killed decode instance's requests were resumed, not failed
    # each kill names what it handed back, and every one of those ended as a complete stream or an early answer
    touched = report["chaos"]["touched"]
    assert [(k["name"], k["at_s"]) for k in touched] == [(k["name"], k["at_s"]) for k in report["chaos"]["kills"]]
    assert any(k["requests"] for k in touched if k["kind"] == "decode"), touched
    assert all(r["ended"] in ("completed", "429", "503") for k in touched for r in k["requests"]), touched
    assert report["drain"]["probe"]["in_flight"] == 0
    # the supervisor said what it did, and every process is up again
    assert "restarted" in up.log()
    assert all(p["state"] == "running" for p in up.state()["processes"].values()), up.state()["processes"]


def test_ctrl_c_stops_every_process_and_cleans_shared_memory(up):
    state = up.state()
    up.proc.send_signal(signal.SIGINT)
    assert up.proc.wait(120) == 0, up.log()
    for name, proc in state["processes"].items():
        with pytest.raises(ProcessLookupError):
            os.kill(proc["pid"], 0)
    assert not Path(state["shm_root"]).exists()
