"""Run a compose project with `docker compose` (v2) or `docker-compose` (v1), whichever exists.

Compose v1 (1.29, what Debian ships) has no `up --wait`. We emulate it: `up -d`, then poll the
project's containers (by the label compose puts on them) until every one runs and every one with a
health check reports healthy, failing at once on a container that exited or turned unhealthy.
Both ways also fail on a container that restarted: with `restart: unless-stopped` a service
that crashes at start would otherwise only turn unhealthy minutes later (its start period).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

PROJECT_LABEL = "com.docker.compose.project"
SERVICE_LABEL = "com.docker.compose.service"
ONE_SHOT = {"model-init"}  # services that run once and exit 0 (compose.yaml)


class ComposeError(RuntimeError):
    """Raised when a compose command fails, or the services do not all become healthy in time."""


@dataclass(frozen=True)
class Container:
    id: str
    name: str
    service: str
    status: str  # created, running, restarting, exited, dead, ...
    health: str | None  # starting, healthy, unhealthy; None without a health check
    restarts: int
    hostname: str
    exit_code: int = 0

    @property
    def done(self) -> bool:
        """A one-shot service (model-init) that finished its work."""
        return self.service in ONE_SHOT and self.status == "exited" and self.exit_code == 0

    @property
    def ready(self) -> bool:
        return self.done or (self.status == "running" and self.health in (None, "healthy"))


@dataclass
class Compose:
    argv: list[str]  # the tool: ["docker", "compose"] or ["docker-compose"]
    files: list[Path]
    project: str
    cwd: Path
    env: dict[str, str] = field(default_factory=dict)

    @property
    def has_wait(self) -> bool:
        return self.argv[:2] == ["docker", "compose"]

    @classmethod
    def find(cls, files: list[Path], project: str, cwd: Path, env: dict[str, str]) -> "Compose | None":
        """v2 if the docker CLI has the compose plugin, else v1; None if neither is installed."""
        docker = shutil.which("docker")
        if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
            return cls(["docker", "compose"], files, project, cwd, env)
        if shutil.which("docker-compose"):
            return cls(["docker-compose"], files, project, cwd, env)
        return None

    def run(self, *args: str, timeout_s: float = 300) -> str:
        argv = [*self.argv, "-p", self.project, *(a for f in self.files for a in ("-f", str(f))), *args]
        try:
            result = subprocess.run(argv, cwd=self.cwd, env=os.environ | self.env, capture_output=True,
                                    text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            raise ComposeError(f"`{' '.join(args)}` took over {timeout_s:.0f} s") from exc
        if result.returncode != 0:
            raise ComposeError(f"`{' '.join(args)}` failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
        return result.stdout

    def up_wait(self, scale: dict[str, int] | None = None, timeout_s: float = 300) -> list[Container]:
        """`up -d` (no build: the images exist) and wait until every container is healthy."""
        scale_args = [a for name, n in (scale or {}).items() for a in ("--scale", f"{name}={n}")]
        if self.has_wait:
            self.run("up", "-d", "--no-build", "--wait", *scale_args, timeout_s=timeout_s)
            containers = self.containers()
            self._fail_if_bad(containers)
            return containers
        self.run("up", "-d", "--no-build", *scale_args, timeout_s=timeout_s)
        return self.wait_healthy(timeout_s)

    def wait_healthy(self, timeout_s: float) -> list[Container]:
        """Emulates v2's `up --wait` for v1: poll until all run and are healthy; fail fast otherwise."""
        deadline = time.monotonic() + timeout_s
        while True:
            containers = self.containers()
            self._fail_if_bad(containers)
            if containers and all(c.ready for c in containers):
                return containers
            if time.monotonic() > deadline:
                waiting = [c for c in containers if not c.ready]
                raise ComposeError(f"not healthy after {timeout_s:.0f} s: {_summary(waiting)}\n"
                                   f"{self.logs(*{c.service for c in waiting})}")
            time.sleep(0.5)

    def _fail_if_bad(self, containers: list[Container]) -> None:
        bad = [c for c in containers
               if (c.status in ("exited", "dead") and not c.done) or c.health == "unhealthy" or c.restarts]
        if bad:
            raise ComposeError(f"not healthy: {_summary(bad)}\n{self.logs(*{c.service for c in bad})}")

    def containers(self) -> list[Container]:
        ids = subprocess.run(["docker", "ps", "-aq", "--filter", f"label={PROJECT_LABEL}={self.project}"],
                             capture_output=True, text=True, check=True).stdout.split()
        if not ids:
            return []
        raw = json.loads(subprocess.run(["docker", "inspect", *ids], capture_output=True, text=True, check=True).stdout)
        return sorted((_container(c) for c in raw), key=lambda c: c.name)

    def logs(self, *services: str, tail: int = 40) -> str:
        try:
            return self.run("logs", "--no-color", f"--tail={tail}", *services, timeout_s=60)
        except ComposeError as exc:
            return str(exc)

    def down(self, timeout_s: float = 180) -> None:
        """Stop and remove the containers, the network and the volumes (the images stay cached)."""
        self.run("down", "--volumes", "--remove-orphans", "--timeout", "20", timeout_s=timeout_s)


def _container(raw: dict) -> Container:
    state = raw["State"]
    return Container(
        id=raw["Id"][:12],
        name=raw["Name"].lstrip("/"),
        service=raw["Config"]["Labels"].get(SERVICE_LABEL, ""),
        status=state["Status"],
        health=(state.get("Health") or {}).get("Status"),
        restarts=raw.get("RestartCount", 0),
        hostname=raw["Config"]["Hostname"],
        exit_code=state.get("ExitCode", 0),
    )


def _summary(containers: list[Container]) -> str:
    return ", ".join(f"{c.name} {c.status}/{c.health} restarts={c.restarts}" for c in containers)
