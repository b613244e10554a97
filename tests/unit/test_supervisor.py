"""Supervision: the restart policy, and `Cluster.supervise` on real short-lived processes."""

import json
import sys
import time

from tools.moonbus.cluster.processes import Cluster, ClusterSpec
from tools.moonbus.cluster.supervisor import RestartPolicy


def test_backoff_doubles_with_recent_exits_and_forgets_old_ones():
    policy = RestartPolicy(base_backoff_s=0.5, max_backoff_s=4.0, window_s=60.0, crash_limit=5)
    assert policy.delay([100.0], now=100.0) == 0.5
    assert policy.delay([99.0, 100.0], now=100.0) == 1.0
    assert policy.delay([97.0, 98.0, 99.0, 100.0], now=100.0) == 4.0
    assert policy.delay([97.0, 98.0, 99.0, 100.0, 100.5], now=100.5) == 4.0  # capped
    assert policy.delay([10.0, 20.0, 100.0], now=100.0) == 0.5  # exits outside the window do not count


def test_more_exits_than_the_limit_within_the_window_is_a_crash_loop():
    policy = RestartPolicy(crash_limit=3, window_s=10.0)
    assert policy.delay([1.0, 2.0, 3.0], now=3.0) is not None
    assert policy.delay([1.0, 2.0, 3.0, 4.0], now=4.0) is None


def test_a_process_that_exits_is_restarted_and_a_crash_loop_is_left_down(tmp_path):
    cluster = Cluster(ClusterSpec(home=tmp_path, nats_port=1))
    cluster.log_dir.mkdir(parents=True)
    marker = tmp_path / "runs"
    # exits at once, every time, after noting that it ran
    script = f"open({str(marker)!r}, 'a').write('x'); raise SystemExit(3)"
    cluster.spawn("flaky", "decode", [sys.executable, "-c", script], node="node-d0")
    cluster.spawn("steady", "gateway", [sys.executable, "-c", "import time; time.sleep(60)"])
    policy = RestartPolicy(base_backoff_s=0.05, max_backoff_s=0.05, window_s=60.0, crash_limit=2)
    seen = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not any(a.kind == "gave_up" for a in seen):
        seen += cluster.supervise(time.monotonic(), policy)
        time.sleep(0.02)
    try:
        assert [a.kind for a in seen] == ["exited", "restarted", "exited", "restarted", "gave_up"]
        assert seen[1].detail["exit_code"] == 3 and seen[3].detail["restarts"] == 2
        assert marker.read_text() == "xxx"  # ran 3 times: first start + 2 restarts
        assert cluster.procs["steady"].popen.poll() is None  # the others keep running
        state = json.loads((tmp_path / "cluster.json").read_text())
        assert state["processes"]["flaky"] | {"pid": 0} == {
            "kind": "decode", "node": "node-d0", "pid": 0, "restarts": 2, "state": "gave_up",
            "log": str(tmp_path / "logs" / "flaky.log"), "metrics": ""}
        assert state["processes"]["steady"]["state"] == "running"
    finally:
        cluster.procs["steady"].popen.kill()
        cluster.procs["steady"].popen.wait()
