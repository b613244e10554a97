"""A Docker engine to run compose on: the one that already answers, or a dockerd we start and stop.

acquire() returns an Engine. If `docker version` already reaches a daemon, that daemon is used
and left running. Otherwise we start `dockerd` with its own data-root (kept between runs: the
images, the base image included, stay cached) and with the switches that keep it off the host's
network configuration:

    --iptables=false    no DOCKER chains, no FORWARD policy DROP (network namespaces that other
                        work builds on this host keep their bridged traffic)
    --ip-forward=false  net.ipv4.ip_forward stays as it is
    --bridge=none       no docker0; compose makes its own network, builds use the host's

Containers then talk over the compose network's bridge (layer 2, no forwarding), and ports
published on the host go through docker-proxy; builds use --network host, so they reach package
indexes the way the host does. Whatever dockerd still changes (its runtime dir, netns mounts, a
bridge left behind) is undone by HostState.restore() after the daemon exits.

Release: Engine.release() stops the daemon we started by its pid (SIGTERM, SIGKILL after a grace),
waits for its children (containerd), restores the host and raises HostNotRestored if it still
differs. The snapshot is also written to RUN_DIR while the daemon runs, so that a run killed
before its release is cleaned up by the next acquire().
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from tools.compose_e2e.host import HostState

log = logging.getLogger(__name__)

DATA_ROOT = Path(os.environ.get("MOONBUS_DOCKER_DATA_ROOT", "/var/lib/moonbus-docker"))
RUN_DIR = Path(os.environ.get("MOONBUS_DOCKER_RUN_DIR", "/run/moonbus-docker"))  # host snapshot, pid
LOG_DIR = Path(os.environ.get("MOONBUS_DOCKER_LOG_DIR", "/var/cache/moonbus-docker"))  # dockerd.log
DOCKERD_ARGS = ("--iptables=false", "--ip-forward=false", "--bridge=none")
PID_FILE = Path("/run/docker.pid")  # dockerd's own
INSTALL_HINT = ("apt-get install -y --no-install-recommends docker.io docker-compose debootstrap "
                "(`make compose-test` runs it where apt works)")
PR_SET_PDEATHSIG = 1


class EngineUnavailable(RuntimeError):
    """Raised when no Docker engine answers and none can be started here; the message says why."""


@dataclass
class Engine:
    pid: int | None  # the dockerd we started; None: an engine that already ran (left running)
    data_root: Path | None  # ours; None for an engine we did not start
    before: HostState | None  # the host before our dockerd started
    opened: tuple[str, ...] = ()  # what was in the way on the host, let through for the run (undone by release)

    @property
    def ours(self) -> bool:
        return self.pid is not None

    def describe(self) -> str:
        if not self.ours:
            return "the Docker engine that already ran (left running)"
        opened = "".join(f"; in the way on this host, let through for the run: {why}" for why in self.opened)
        return f"dockerd pid {self.pid}, data-root {self.data_root}, {' '.join(DOCKERD_ARGS)}{opened}"

    def release(self, grace_s: float = 60) -> None:
        """Stop the daemon we started and put the host back as it was. No-op for one we found."""
        if not self.ours:
            return
        _stop(self.pid, grace_s)
        self.before.restore()
        (RUN_DIR / "host-before.json").unlink(missing_ok=True)
        (RUN_DIR / "dockerd.pid").unlink(missing_ok=True)
        (RUN_DIR / "daemon.json").unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            RUN_DIR.rmdir()  # ours, and empty now: /run as it was


def docker_answers(timeout_s: float = 10) -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        result = subprocess.run(["docker", "version", "--format", "{{.Server.Version}}"],
                                capture_output=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return False
    return result.returncode == 0


def acquire(data_root: Path = DATA_ROOT, ready_timeout_s: float = 60) -> Engine:
    """The engine that answers, or a dockerd started here. Raises EngineUnavailable saying why not."""
    if shutil.which("docker") is None:
        raise EngineUnavailable(f"no docker CLI on PATH; {INSTALL_HINT}")
    adopted = _adopt_leftover(data_root)
    if adopted is not None:
        return adopted
    if docker_answers():
        return Engine(pid=None, data_root=None, before=None)
    _check_can_start()
    _recover_crashed_run()
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    data_root.mkdir(parents=True, exist_ok=True)
    before = HostState.capture(data_root)
    (RUN_DIR / "host-before.json").write_text(before.to_json())
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    config = RUN_DIR / "daemon.json"  # not /etc/docker/daemon.json: its settings could clash with ours
    config.write_text("{}\n")
    with open(LOG_DIR / "dockerd.log", "wb") as out:
        proc = subprocess.Popen(["dockerd", "--config-file", str(config), "--data-root", str(data_root), *DOCKERD_ARGS],
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                preexec_fn=_die_with_parent)
    (RUN_DIR / "dockerd.pid").write_text(str(proc.pid))
    engine = Engine(pid=proc.pid, data_root=data_root, before=before)
    deadline = time.monotonic() + ready_timeout_s
    while not docker_answers():
        if proc.poll() is not None or time.monotonic() > deadline:
            why = "exited" if proc.poll() is not None else f"did not answer within {ready_timeout_s:.0f} s"
            engine.release()
            raise EngineUnavailable(f"dockerd {why}; its log ends:\n{_log_tail()}")
        time.sleep(0.3)
    driver = subprocess.run(["docker", "info", "--format", "{{.Driver}}"], capture_output=True, text=True).stdout.strip()
    if driver != "overlay2":
        engine.release()
        raise EngineUnavailable(f"dockerd chose the {driver!r} storage driver, not overlay2 (every layer would be copied)")
    engine.opened = _let_bridged_traffic_through(engine, before)
    log.info("started %s", engine.describe())
    return engine


# what the test's containers need from the FORWARD chain where it drops by default: frames between
# ports of a Docker bridge (its name br-<id>: compose makes one per project network)
BRIDGE_ACCEPT = ["FORWARD", "-i", "br-+", "-o", "br-+", "-j", "ACCEPT"]


def _let_bridged_traffic_through(engine: Engine, before: HostState) -> tuple[str, ...]:
    """Where the host would drop the containers' traffic (HostState.obstacles), accept it on Docker
    bridges for the run: the rule goes with the rest of iptables back to the snapshot at release.
    Where it cannot be let through, the engine is released and the reason raised."""
    obstacles = before.obstacles()
    if not obstacles:
        return ()
    if shutil.which("iptables") is None:
        engine.release()
        raise EngineUnavailable("; ".join(obstacles) + ", and there is no iptables here to let the test's traffic through")
    done = subprocess.run(["iptables", "-I", *BRIDGE_ACCEPT], capture_output=True, text=True)
    if done.returncode != 0:
        engine.release()
        raise EngineUnavailable("; ".join(obstacles) + f", and `iptables -I {' '.join(BRIDGE_ACCEPT)}` failed: "
                                f"{done.stderr.strip()}")
    log.warning("in the way on this host: %s; accepted on Docker bridges for the run", "; ".join(obstacles))
    return tuple(obstacles)


def _check_can_start() -> None:
    if shutil.which("dockerd") is None:
        raise EngineUnavailable(f"no Docker engine answers and there is no dockerd on PATH; {INSTALL_HINT}")
    if os.geteuid() != 0:
        raise EngineUnavailable(f"no Docker engine answers, and starting dockerd needs root (this is uid {os.geteuid()})")
    if "overlay" not in Path("/proc/filesystems").read_text():
        subprocess.run(["modprobe", "overlay"], capture_output=True)
        if "overlay" not in Path("/proc/filesystems").read_text():
            raise EngineUnavailable("the kernel has no overlay filesystem (dockerd's overlay2 storage driver needs it)")
    if PID_FILE.exists():
        pid = int(PID_FILE.read_text().strip() or 0)
        if pid and psutil.pid_exists(pid):
            raise EngineUnavailable(f"a dockerd (pid {pid}, {PID_FILE}) runs but does not answer")
        PID_FILE.unlink()  # left by a daemon that was killed; dockerd refuses to start over it


def _adopt_leftover(data_root: Path) -> Engine | None:
    """Our dockerd from a run that died before releasing it: take it over, so it gets stopped."""
    pid_file, snapshot = RUN_DIR / "dockerd.pid", RUN_DIR / "host-before.json"
    if not (pid_file.exists() and snapshot.exists()):
        return None
    pid = int(pid_file.read_text())
    try:
        cmdline = psutil.Process(pid).cmdline()
    except psutil.Error:
        return None
    if cmdline[:1] != ["dockerd"] or str(data_root) not in cmdline:
        return None
    log.warning("taking over dockerd pid %d left by an earlier run", pid)
    return Engine(pid=pid, data_root=data_root, before=HostState.from_json(snapshot.read_text()))


def _recover_crashed_run() -> None:
    """A run whose dockerd died without a release left its snapshot: put that host state back."""
    snapshot = RUN_DIR / "host-before.json"
    if snapshot.exists():
        log.warning("an earlier run did not restore the host; restoring its snapshot %s", snapshot)
        HostState.from_json(snapshot.read_text()).restore()
        snapshot.unlink()


def _stop(pid: int, grace_s: float) -> None:
    """SIGTERM our dockerd by pid, SIGKILL after `grace_s`; then wait for its children by pid."""
    try:
        proc = psutil.Process(pid)
        children = proc.children(recursive=True)  # its managed containerd (and shims)
        proc.send_signal(signal.SIGTERM)
        proc.wait(grace_s)
    except psutil.NoSuchProcess:
        children = []
    except psutil.TimeoutExpired:
        log.warning("dockerd pid %d did not stop within %.0f s; killing it", pid, grace_s)
        proc.kill()
        proc.wait(10)
    _, alive = psutil.wait_procs(children, timeout=15)
    for child in alive:
        log.warning("killing dockerd's child pid %d (%s)", child.pid, child.name())
        child.kill()
    psutil.wait_procs(alive, timeout=10)


def _die_with_parent() -> None:
    # If the test process dies, so does the daemon; the next acquire() restores the host.
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    os.setpgrp()  # Ctrl-C reaches the test, which stops the daemon in order


def _log_tail(lines: int = 15) -> str:
    try:
        return "\n".join((LOG_DIR / "dockerd.log").read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
