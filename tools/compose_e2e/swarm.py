"""A one-node Docker swarm for the stack's end-to-end test, and the stack on it; both undone after.

    Swarm.join()        the engine's swarm: the one it is in (left as it was), or one made here
                        (`docker swarm init --advertise-addr 127.0.0.1`), which leave() leaves
    Swarm.label(...)    node labels the stack's placement asks for (removed again by leave())
    Stack.deploy(file)  `docker stack deploy`; wait_converged() until each service runs its
                        replicas, every task healthy (its health file), the one-shot ones done
    Stack.remove()      `docker stack rm` (services, their secrets and network), then the stack's
                        volumes once its containers are gone (a stack rm leaves volumes)

The engine itself (a dockerd started for the test, and the host put back after it) is engine.py's.
What swarm mode adds on the host: the docker_gwbridge bridge (its tasks' way out), the ingress
network's namespace; leave() removes the bridge where the swarm was made here, and engine.py's
HostState restore catches whatever else a dockerd of ours left.
"""

from __future__ import annotations

import json
import logging
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

STACK_LABEL = "com.docker.stack.namespace"
GWBRIDGE = "docker_gwbridge"


class SwarmError(RuntimeError):
    """Raised when a docker command fails or a stack does not converge; the message says which and why."""


def docker(*args: str, timeout_s: float = 120, check: bool = True) -> str:
    try:
        result = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise SwarmError(f"`docker {' '.join(args)}` took over {timeout_s:.0f} s") from exc
    if check and result.returncode != 0:
        raise SwarmError(f"`docker {' '.join(args)}` failed (exit {result.returncode}): {result.stderr.strip()[-2000:]}")
    return result.stdout


def inspect_present(*ids: str) -> list[dict]:
    """`docker inspect` of those of `ids` that are still there: a swarm prunes old tasks as a
    service scales or rolls (it keeps a few per slot), so a task listed a moment ago may be gone,
    and one missing id fails the whole command."""
    try:
        return json.loads(docker("inspect", *ids))
    except SwarmError as exc:
        if "No such object" not in str(exc):
            raise
    found = []
    for one in ids:
        try:
            found.extend(json.loads(docker("inspect", one)))
        except SwarmError as exc:
            if "No such object" not in str(exc):
                raise
    return found


@dataclass
class Swarm:
    node_id: str
    made_here: bool  # `swarm init` was ours: leave() leaves it
    had_gwbridge: bool  # docker_gwbridge was there before
    labels_added: list[str] = field(default_factory=list)

    @classmethod
    def join(cls) -> "Swarm":
        state = docker("info", "--format", "{{.Swarm.LocalNodeState}}").strip()
        had_gwbridge = bool(docker("network", "ls", "-q", "--filter", f"name=^{GWBRIDGE}$").strip())
        made_here = state != "active"
        if made_here:
            docker("swarm", "init", "--advertise-addr", "127.0.0.1")
        node_id = docker("info", "--format", "{{.Swarm.NodeID}}").strip()
        return cls(node_id, made_here, had_gwbridge)

    def label(self, labels: dict[str, str]) -> None:
        present = json.loads(docker("node", "inspect", self.node_id, "--format", "{{json .Spec.Labels}}") or "{}") or {}
        args = []
        for key, value in labels.items():
            if key not in present:
                self.labels_added.append(key)
            args += ["--label-add", f"{key}={value}"]
        docker("node", "update", *args, self.node_id)

    def leave(self) -> None:
        """Leave a swarm made here (and its gateway bridge); else take back the labels added."""
        if self.made_here:
            docker("swarm", "leave", "--force", timeout_s=120)
            if not self.had_gwbridge:
                docker("network", "rm", GWBRIDGE, check=False)
        elif self.labels_added:
            docker("node", "update", *(a for key in self.labels_added for a in ("--label-rm", key)), self.node_id)


@dataclass(frozen=True)
class Task:
    id: str
    service: str  # the stack's short name (decode, not moonbus_decode)
    slot: int | None  # None for a global service's task
    state: str  # new, pending, ..., running, complete, shutdown, failed
    desired: str  # running, shutdown, ...
    image: str
    container: str  # its container's id ("" before it has one)
    error: str


@dataclass
class Stack:
    name: str

    def service(self, short: str) -> str:
        return f"{self.name}_{short}"

    def deploy(self, stack_file: Path, timeout_s: float = 300) -> None:
        docker("stack", "deploy", "--resolve-image", "never", "-c", str(stack_file), self.name, timeout_s=timeout_s)

    def services(self) -> dict[str, dict]:
        """short name -> `docker service inspect` of each of the stack's services."""
        ids = docker("service", "ls", "-q", "--filter", f"label={STACK_LABEL}={self.name}").split()
        if not ids:
            return {}
        raw = json.loads(docker("service", "inspect", *ids))
        return {s["Spec"]["Name"].removeprefix(self.name + "_"): s for s in raw}

    def tasks(self, short: str | None = None) -> list[Task]:
        """The tasks of one service (or all), old ones included (a swarm keeps a few per slot)."""
        ids = docker("stack", "ps", "-q", "--no-trunc", self.name, check=False).split()
        if not ids:
            return []
        raw = inspect_present(*ids)
        names = {s["ID"]: n for n, s in self.services().items()}
        return [Task(t["ID"], names.get(t["ServiceID"], t["ServiceID"]), t.get("Slot"), t["Status"]["State"],
                     t["DesiredState"], t["Spec"]["ContainerSpec"]["Image"].split("@")[0],
                     (t["Status"].get("ContainerStatus") or {}).get("ContainerID", ""), t["Status"].get("Err", ""))
                for t in raw if t["ServiceID"] in names and (short is None or names[t["ServiceID"]] == short)]

    def running(self, short: str) -> list[Task]:
        return [t for t in self.tasks(short) if t.state == "running" and t.desired == "running"]

    def not_converged(self) -> list[str]:
        """Why the stack is not yet what it was told to be, per service; [] once it is."""
        services, tasks = self.services(), self.tasks()
        healthy = _health({t.container for t in tasks if t.container and t.state == "running"})
        waiting = []
        for short, spec in sorted(services.items()):
            mine = [t for t in tasks if t.service == short]
            update = (spec.get("UpdateStatus") or {}).get("State")
            if update in ("updating", "rollback_started", "paused", "rollback_paused"):
                waiting.append(f"{short}: update {update}")
                continue
            mode = spec["Spec"]["Mode"]
            if "Global" in mode:
                if not any(t.state == "complete" or (t.state == "running" and healthy.get(t.container) in (None, "healthy"))
                           for t in mine if t.desired in ("running", "shutdown") and t.state in ("complete", "running")):
                    waiting.append(f"{short}: its global task not done")
                continue
            want = mode["Replicated"]["Replicas"]
            up = [t for t in mine if t.desired == "running" and t.state == "running"
                  and healthy.get(t.container) in (None, "healthy")]
            stopping = [t for t in mine if t.desired != "running" and t.state in ("running", "starting", "preparing")]
            if len(up) != want or stopping:
                waiting.append(f"{short}: {len(up)} of {want} healthy" + (f", {len(stopping)} stopping" if stopping else ""))
        return waiting or ([] if services else ["no services"])

    def wait_converged(self, timeout_s: float) -> None:
        deadline, pause, why = time.monotonic() + timeout_s, 0.5, ["not looked at yet"]
        while why := self.not_converged():
            if time.monotonic() > deadline:
                failed = [f"{t.service}.{t.slot or ''} {t.state}: {t.error}" for t in self.tasks() if t.state == "failed"]
                raise SwarmError(f"stack {self.name} not converged after {timeout_s:.0f} s: {'; '.join(why)}"
                                 f"\nfailed tasks: {failed[-10:]}")
            time.sleep(pause)
            pause = min(2 * pause, 2.0)

    def scale(self, short: str, replicas: int) -> None:
        docker("service", "scale", "--detach", f"{self.service(short)}={replicas}")

    def roll(self, short: str, image: str) -> None:
        """`docker service update --image IMAGE --force`: a rolling update by update_config."""
        docker("service", "update", "--detach", "--force", "--image", image, self.service(short))

    def update_state(self, short: str) -> str | None:
        return (self.services().get(short, {}).get("UpdateStatus") or {}).get("State")

    def logs(self, short: str, tail: int = 60) -> str:
        result = subprocess.run(["docker", "service", "logs", "--raw", "--tail", str(tail), self.service(short)],
                                capture_output=True, text=True, timeout=60)
        return result.stdout + result.stderr

    def remove(self, timeout_s: float = 180) -> None:
        """The stack's services, secrets and network (`docker stack rm`), then its volumes."""
        docker("stack", "rm", self.name, check=False)
        deadline = time.monotonic() + timeout_s
        label = f"label={STACK_LABEL}={self.name}"
        while docker("ps", "-aq", "--filter", label).strip() or \
                docker("network", "ls", "-q", "--filter", label).strip():
            if time.monotonic() > deadline:
                raise SwarmError(f"stack {self.name}'s containers or network still there after {timeout_s:.0f} s")
            time.sleep(0.5)
        volumes = docker("volume", "ls", "-q", "--filter", label).split()
        if volumes:
            docker("volume", "rm", *volumes)
        left = [kind for kind, args in (("secrets", ("secret", "ls", "-q", "--filter", label)),
                                         ("services", ("service", "ls", "-q", "--filter", label)),
                                         ("volumes", ("volume", "ls", "-q", "--filter", label)))
                if docker(*args).strip()]
        if left:
            raise SwarmError(f"stack {self.name} left {', '.join(left)} behind")


def _health(containers: set[str]) -> dict[str, str | None]:
    """container id -> its health status (None: it has no health check)."""
    if not containers:
        return {}
    out = docker("inspect", "--format", "{{.Id}} {{if .State.Health}}{{.State.Health.Status}}{{end}}", *containers,
                 check=False)
    health = {}
    for line in out.splitlines():
        cid, _, status = line.partition(" ")
        health[cid] = status.strip() or None
    return health
