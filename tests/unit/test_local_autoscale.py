"""`moonbus up --autoscale`'s driver (tools/moonbus/cluster/autoscale.py) on real short-lived
processes standing in for the workers: it starts a worker and its messenger when the planner asks
for more, drains the one holding least when it asks for fewer, and the supervisor lets a drained
worker go (not restarted), its messenger after it."""

from __future__ import annotations

import sys
import time
from types import SimpleNamespace

import pytest

from schemas import subjects
from schemas.events import PLANNED, Event, planned_subject
from schemas.workers import WorkerInfo
from tests.wait import until_sync
from tools.moonbus.cluster.autoscale import LocalScaler
from tools.moonbus.cluster.processes import Cluster, ClusterSpec, Planned
from tools.moonbus.cluster.supervisor import RestartPolicy


class SleepyCluster(Cluster):
    """Every service a process that sleeps (and dies of SIGTERM)."""

    def start_planned(self, p: Planned) -> None:
        self.spawn(p.name, p.kind, [sys.executable, "-c", "import time; time.sleep(60)"], p.node)


class FakeEvents:
    """The supervisor's NATS side: what the driver listens to is handed in by the test."""

    def __init__(self) -> None:
        self.handlers: dict[str, object] = {}
        self.published: list[tuple[str, str]] = []

    def listen(self, subject: str, handler) -> bool:
        self.handlers[subject] = handler
        return True

    def instance(self, kind: str, name: str, /, **data) -> None:
        self.published.append((kind, name))

    def heartbeat(self, name: str, role: str, held: int) -> None:
        subject = subjects.worker_heartbeat(role, name)
        self.handlers[f"moonbus.workers.heartbeat.{role}.*"](subject, WorkerInfo(name, role, "n", num_queued=held).to_bytes())

    def planned(self, prefill: int, decode: int) -> None:
        event = Event(PLANNED, time.time(), "conductor", "conductor", data={"prefill": prefill, "decode": decode})
        self.handlers["moonbus.events.instance.planned.*"](planned_subject("conductor"), event.to_bytes())


@pytest.fixture
def cluster(tmp_path):
    cluster = SleepyCluster(ClusterSpec(home=tmp_path, nats_port=1, auth=False, prefill=1, decode=1, max_prefill=2,
                                        max_decode=2))
    cluster.log_dir.mkdir(parents=True)
    for p in cluster.plan_workers():
        cluster.start_planned(p)
    yield cluster
    for proc in cluster.procs.values():
        proc.popen.kill()
        proc.popen.wait()


def names(cluster: Cluster) -> set[str]:
    return set(cluster.procs)


def test_it_starts_and_drains_workers_to_the_planners_targets(cluster):
    events, said = FakeEvents(), []
    scaler = LocalScaler(cluster, events, said.append)
    assert names(cluster) == {"messenger-p0", "prefill-0", "messenger-d0", "decode-0"}
    scaler.act()  # no decision yet: nothing
    assert events.published == []

    events.heartbeat("prefill-0", "prefill", held=3)
    events.planned(2, 1)
    scaler.act()
    assert names(cluster) == {"messenger-p0", "prefill-0", "messenger-d0", "decode-0", "messenger-p1", "prefill-1"}
    assert events.published == [("scaled_up", "prefill-1")]
    scaler.act()  # prefill-1 is starting: it counts, nothing more is started
    assert events.published == [("scaled_up", "prefill-1")]

    events.heartbeat("prefill-1", "prefill", held=0)  # serving now, holding less than prefill-0
    events.planned(1, 1)
    scaler.act()
    assert cluster.procs["prefill-1"].retiring and not cluster.procs["prefill-0"].retiring
    assert events.published[-1] == ("scaled_down", "prefill-1")

    seen = []

    def gone() -> bool:
        seen.extend(cluster.supervise(time.monotonic(), RestartPolicy()))
        return "messenger-p1" not in cluster.procs

    until_sync(gone, "prefill-1 and then its messenger are gone")
    assert [(a.kind, a.name) for a in seen] == [("retired", "prefill-1"), ("retired", "messenger-p1")]
    assert names(cluster) == {"messenger-p0", "prefill-0", "messenger-d0", "decode-0"}
    assert any("prefill-1 draining (holds 0)" in line for line in said), said


def test_a_worker_not_heard_yet_is_cancelled_first_and_the_maximum_is_kept(cluster):
    events, said = FakeEvents(), []
    scaler = LocalScaler(cluster, events, said.append)
    events.heartbeat("decode-0", "decode", held=0)
    events.planned(1, 5)  # beyond this cluster's users: cut to 2
    scaler.act()
    assert "decode-1" in cluster.procs and "decode-2" not in cluster.procs
    events.planned(1, 1)
    scaler.act()  # decode-1 never sent a heartbeat: it is the one stopped, not decode-0 (serving, holding nothing)
    assert cluster.procs["decode-1"].retiring and not cluster.procs["decode-0"].retiring
    assert [kind for kind, _ in events.published] == ["scaled_up", "scaled_down"]
    assert any("decode 5 is beyond this driver's bounds 1..2" in line for line in said), said


def test_an_autoscaled_cluster_makes_users_for_its_maximum_and_runs_one_planner(tmp_path, monkeypatch):
    spec = ClusterSpec(home=tmp_path, auth=False, prefill=1, decode=1, max_prefill=3, max_decode=2, conductors=2,
                       planner=["--planner", "--planner-interval", "5"])
    cluster = Cluster(spec)
    users = cluster.planned_instances()
    assert {"prefill-2", "messenger-p2", "decode-1", "messenger-d1"} <= set(users) and "prefill-3" not in users
    assert [p.name for p in cluster.plan_workers()] == ["messenger-p0", "prefill-0", "messenger-d0", "decode-0"]
    spawned = {}

    def spawn(self, name, kind, argv, node="", restarts=None):  # none of them run
        spawned[name] = argv
        self.procs[name] = SimpleNamespace()

    monkeypatch.setattr(Cluster, "spawn", spawn)
    cluster.start_services()
    assert "--planner" in spawned["conductor"] and "--planner" not in spawned["conductor-1"]
    with pytest.raises(ValueError, match="NATS users for 2 decode"):
        cluster.start_worker("decode", 2)
