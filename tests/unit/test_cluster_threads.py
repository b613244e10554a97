"""How `moonbus up` divides the cores among roles, when its profile must be measured again, and the
ports a cluster is handed."""

from pathlib import Path

import pytest

from common import cores as common_cores, profiles
from common.decide.perf import A800_X8, LLAMA3_70B, analytic_profile
from tools.moonbus.cluster import processes, up
from tools.moonbus.cluster.processes import ClusterSpec


@pytest.fixture
def cores(monkeypatch):
    def set_cores(n: int) -> None:
        monkeypatch.setattr(processes.os, "cpu_count", lambda: n)
    return set_cores


def threads(spec: ClusterSpec) -> tuple[int, int, int]:
    return spec.role_threads("prefill"), spec.role_threads("decode"), spec.role_threads("coupled")


def test_by_default_every_worker_follows_the_work_and_is_profiled_with_every_core(cores, tmp_path, monkeypatch):
    monkeypatch.setattr(processes.cores, "machine_cores", lambda: 2)
    assert threads(ClusterSpec(home=tmp_path)) == (0, 0, 0)  # 0: each step takes its share (common/cores.py)
    assert threads(ClusterSpec(home=tmp_path, prefill=2, decode=2)) == (0, 0, 0)
    spec = ClusterSpec(home=tmp_path)
    assert (spec.profile_threads("prefill"), spec.profile_threads("decode")) == (2, 2)  # alone: every core
    assert "follows the work" in spec.describe_threads("decode")


def test_explicit_threads_win_per_role_then_for_all(cores, tmp_path):
    cores(16)
    assert threads(ClusterSpec(home=tmp_path, threads=3)) == (3, 3, 3)
    assert threads(ClusterSpec(home=tmp_path, threads=3, prefill_threads=5)) == (5, 3, 3)
    assert threads(ClusterSpec(home=tmp_path, decode_threads=1)) == (0, 1, 0)
    assert ClusterSpec(home=tmp_path, decode_threads=1).profile_threads("decode") == 1


def test_a_profile_says_with_how_many_threads_each_role_was_timed(tmp_path: Path):
    profile = analytic_profile(LLAMA3_70B, A800_X8)
    path = tmp_path / "old.json"
    profiles.save(profile, path)
    assert profiles.measured_threads(profiles.read(path).meta) == {}  # made before it was recorded: measured again
    assert "engine changed" in up.profile_stale(path, {"prefill": 2, "decode": 1})
    profile.meta["engine"] = up.engine_key()
    profiles.save(profile, path)
    assert "does not record" in up.profile_stale(path, {"prefill": 2, "decode": 1})
    profile.meta["threads"] = {"prefill": 2, "decode": 1}
    profiles.save(profile, path)
    assert profiles.measured_threads(profiles.read(path).meta) == {"prefill": 2, "decode": 1}
    assert profiles.read(path).meta["threads"] == {"prefill": 2, "decode": 1}
    assert up.profile_stale(path, {"prefill": 2, "decode": 1}) == ""
    assert "measured with {'prefill': 2, 'decode': 1}" in up.profile_stale(path, {"prefill": 1, "decode": 1})
    assert up.profile_stale(tmp_path / "missing.json", {"prefill": 2, "decode": 1}) == "once"
    # the workers' OpenMP threads wait as they are told where they share cores: timed as they run
    assert "with OMP_WAIT_POLICY=PASSIVE" in up.profile_stale(path, {"prefill": 2, "decode": 1}, "OMP_WAIT_POLICY=PASSIVE")
    profile.meta["omp_wait"] = common_cores.wait_setting({"OMP_WAIT_POLICY": "PASSIVE"})
    profiles.save(profile, path)
    assert up.profile_stale(path, {"prefill": 2, "decode": 1}, "OMP_WAIT_POLICY=PASSIVE") == ""
    assert "waiting as by default" in up.profile_stale(path, {"prefill": 2, "decode": 1})
    assert "with GOMP_SPINCOUNT=10000" in up.profile_stale(path, {"prefill": 2, "decode": 1}, "GOMP_SPINCOUNT=10000")


def test_workers_that_share_cores_spin_briefly_and_fixed_threads_that_outnumber_them_sleep(cores, tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    cores(2)
    spin = {"GOMP_SPINCOUNT": common_cores.SHARED_SPIN_COUNT}
    assert ClusterSpec(home=tmp_path).worker_env == spin  # shares that change step to step, never past the cores
    assert ClusterSpec(home=tmp_path, prefill_threads=2).worker_env == {"OMP_WAIT_POLICY": "PASSIVE"}  # fixed beside shared
    assert ClusterSpec(home=tmp_path, threads=1).worker_env == {}  # one thread each: a core each
    assert ClusterSpec(home=tmp_path, coupled=2, threads=1).worker_env == {}
    cores(16)
    assert ClusterSpec(home=tmp_path, prefill_threads=16, decode_threads=8).worker_env == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert ClusterSpec(home=tmp_path, prefill_threads=8, decode_threads=8).worker_env == {}  # 8 + 8
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the caller's choice stands
    assert ClusterSpec(home=tmp_path).worker_env == {}
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.setenv("GOMP_SPINCOUNT", "0")
    assert ClusterSpec(home=tmp_path).worker_env == {}


def test_the_profile_is_measured_in_the_environment_the_workers_get(cores, tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    cores(2)
    spec = ClusterSpec(home=tmp_path, extra_env={"OMP_WAIT_POLICY": "ACTIVE", "MOONBUS_X": "1"})
    assert spec.model_env == {"OMP_WAIT_POLICY": "ACTIVE", "MOONBUS_X": "1"}  # a spec's own setting wins
    assert ClusterSpec(home=tmp_path).model_env == {"GOMP_SPINCOUNT": common_cores.SHARED_SPIN_COUNT}


def test_a_process_is_never_handed_the_same_free_port_twice():
    # a cluster picks its gateway's port before the other services pick their metrics ports:
    # 500 picks from the 16k ports below the ephemeral range would repeat one by chance
    picks = [processes.free_port() for _ in range(500)]
    assert len(set(picks)) == len(picks)


def test_a_clusters_gateway_replicas_ports_are_never_handed_out_again():
    # gateway i listens on the cluster's port + i: none of those may go to anything else
    firsts = [processes.free_port(3) for _ in range(200)]
    ranges = [p + i for p in firsts for i in range(3)]
    singles = [processes.free_port() for _ in range(300)]
    assert len(set(ranges)) == len(ranges) and not set(ranges) & set(singles)
