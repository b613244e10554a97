"""The swarm's stack file, derived from compose.yaml (tools/swarm/stack.py).

The structure checks need only pyyaml. The last asks the docker CLI to read the derived stack the
way `docker stack deploy` does (`docker stack config`, which needs no engine), and skips where
there is no docker CLI.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests import required
from tools.swarm import stack as stack_tool

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose.yaml"
E2E = ROOT / "tools" / "compose_e2e" / "compose.e2e.yaml"
NODES = {"node-a": ("messenger-a", "prefill"), "node-b": ("messenger-b", "decode")}


def derive(env: dict[str, str], files=(COMPOSE,)) -> tuple[dict, list[str]]:
    return stack_tool.derive(stack_tool.load(list(files), env), ROOT)


@pytest.fixture(scope="module")
def secrets_dir(tmp_path_factory) -> Path:
    from tools.moonbus.cluster import compose_secrets

    directory = tmp_path_factory.mktemp("compose-secrets")
    compose_secrets.prepare(directory)
    return directory


@pytest.fixture(scope="module")
def stack(secrets_dir: Path) -> dict:
    return derive({"MOONBUS_COMPOSE_SECRETS": str(secrets_dir)})[0]


def test_interpolation_is_composes() -> None:
    env = {"SET": "x", "EMPTY": ""}
    cases = {"${SET}": "x", "${UNSET}": "", "$SET/y": "x/y", "${UNSET:-d}": "d", "${EMPTY:-d}": "d", "${EMPTY-d}": "",
             "${UNSET-d}": "d", "$$SET": "$SET", "a${SET:-d}b": "axb", "${SET:?needed}": "x"}
    for text, want in cases.items():
        assert stack_tool.interpolate(text, env) == want, text
    assert stack_tool.interpolate({"k": ["${SET}", 3]}, env) == {"k": ["x", 3]}
    with pytest.raises(stack_tool.StackError, match="needed"):
        stack_tool.interpolate("${UNSET:?needed}", env)


def test_overrides_merge_mappings_and_replace_the_rest() -> None:
    base = {"a": {"b": 1, "c": [1, 2]}, "d": 1}
    assert stack_tool.merge(base, {"a": {"c": [3], "e": 2}}) == {"a": {"b": 1, "c": [3], "e": 2}, "d": 1}
    assert base == {"a": {"b": 1, "c": [1, 2]}, "d": 1}


def test_every_compose_service_is_in_the_stack_with_a_deploy_section(stack: dict) -> None:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    assert set(stack["services"]) == set(services)
    for name, service in stack["services"].items():
        deploy = service["deploy"]
        assert deploy["endpoint_mode"] == "dnsrr", name  # no virtual IP: it needs the engine's iptables
        assert deploy["restart_policy"]["condition"] in ("any", "on-failure"), name
        if name == "model-init":
            assert deploy["mode"] == "global" and deploy["restart_policy"]["condition"] == "on-failure"
            continue
        assert deploy["replicas"] == 1, name
        limits = deploy["resources"]["limits"]
        assert float(limits["cpus"]) > 0 and limits["memory"], name
        update = deploy["update_config"]
        assert (update["parallelism"], update["order"], update["failure_action"]) == (1, "stop-first", "rollback"), name
        assert deploy["rollback_config"]["parallelism"] == 1


def test_what_a_stack_cannot_use_is_gone_and_nothing_else(stack: dict) -> None:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    for name, service in stack["services"].items():
        assert not set(service) & {"build", "depends_on", "restart", "expose", "container_name", "ipc"}, name
        assert not [k for k in service if k.startswith("x-")], name
        assert service["image"] == services[name]["image"]
        assert service["command"] == services[name]["command"]
        assert service["healthcheck"] == services[name]["healthcheck"], name  # health from the health files
        assert service.get("stop_grace_period") == services[name].get("stop_grace_period"), name


def test_workers_drain_before_a_swarm_kills_them(stack: dict) -> None:
    for name in ("prefill", "decode"):
        service = stack["services"][name]
        grace = float(str(service["stop_grace_period"]).rstrip("s"))
        assert grace > float(service["environment"].get("MOONBUS_DRAIN_GRACE", 30))  # the services' default


def test_a_nodes_messenger_and_workers_run_on_one_host_and_share_its_shm(stack: dict) -> None:
    for node, (messenger, worker) in NODES.items():
        constraints = {name: stack["services"][name]["deploy"]["placement"]["constraints"] for name in (messenger, worker)}
        assert constraints[messenger] == constraints[worker] == [f"node.labels.moonbus.{node} == true"]
        shm = {name: [v for v in stack["services"][name]["volumes"] if v.endswith(":/dev/shm/moonbus")]
               for name in (messenger, worker)}
        assert shm[messenger] == shm[worker] == [f"shm-{node}:/dev/shm/moonbus"]
        assert stack["volumes"][f"shm-{node}"]["driver_opts"]["type"] == "tmpfs"
    assert stack["services"]["nats"]["deploy"]["placement"]["constraints"] == ["node.labels.moonbus.nats == true"]


def test_secrets_are_swarm_secrets_from_the_files_compose_secrets_writes(stack: dict, secrets_dir: Path) -> None:
    declared = stack["secrets"]
    for name, spec in declared.items():
        assert Path(spec["file"]).is_absolute() and Path(spec["file"]).is_file(), name
        assert Path(spec["file"]).is_relative_to(secrets_dir), name
    for name, service in stack["services"].items():
        assert set(service.get("secrets", [])) <= set(declared), name
        for volume in service.get("volumes", []):
            assert not str(volume).startswith("/"), (name, volume)  # no bind mount a node may lack


def test_the_gateway_reads_its_api_keys_from_a_secret(stack: dict) -> None:
    gateway = stack["services"]["gateway"]
    assert gateway["environment"]["MOONBUS_API_KEYS_FILE"] == "/run/secrets/api-keys"
    assert "api-keys" in gateway["secrets"]
    assert gateway["ports"] == [{"target": 8000, "published": 8000, "protocol": "tcp", "mode": "host"}]
    assert gateway["deploy"]["placement"]["max_replicas_per_node"] == 1  # a host's port is one task's


def test_the_environment_fills_in_what_it_sets(secrets_dir: Path) -> None:
    env = {"MOONBUS_COMPOSE_SECRETS": str(secrets_dir), "MOONBUS_MODEL": "tiny-random", "MOONBUS_GATEWAY_PORT": "18000",
           "MOONBUS_SWARM_WORKER_CPUS": "1.5"}
    stack, _ = derive(env)
    assert stack["services"]["decode"]["environment"]["MOONBUS_MODEL"] == "tiny-random"
    assert stack["services"]["gateway"]["ports"][0]["published"] == 18000
    assert stack["services"]["prefill"]["deploy"]["resources"]["limits"]["cpus"] == "1.5"


def test_the_test_override_publishes_nats_on_the_host_and_says_so(secrets_dir: Path) -> None:
    env = {"MOONBUS_COMPOSE_SECRETS": str(secrets_dir), "MOONBUS_E2E_NATS_PORT": "14222"}
    stack, notes = derive(env, (COMPOSE, E2E))
    nats = stack["services"]["nats"]
    assert nats["image"] == "moonbus:latest" and nats["deploy"]["placement"]  # the override kept the deploy section
    assert nats["ports"] == [{"target": 4222, "published": 14222, "protocol": "tcp", "mode": "host"}]
    assert any("127.0.0.1" in note for note in notes)
    assert stack["services"]["decode"]["healthcheck"]["interval"] == "2s"


def test_a_service_without_deploy_or_sharing_a_namespace_is_refused() -> None:
    with pytest.raises(stack_tool.StackError, match="no deploy section"):
        stack_tool.derive({"services": {"a": {"image": "x"}}}, ROOT)
    with pytest.raises(stack_tool.StackError, match="ipc"):
        stack_tool.derive({"services": {"a": {"image": "x", "ipc": "service:b", "x-swarm": {"deploy": {}}}}}, ROOT)


def test_the_command_line_writes_the_stack(tmp_path: Path, secrets_dir: Path, monkeypatch) -> None:
    monkeypatch.setenv("MOONBUS_COMPOSE_SECRETS", str(secrets_dir))
    out = tmp_path / "stack.yaml"
    assert stack_tool.main(["-f", str(COMPOSE), "-o", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("# Derived from") and yaml.safe_load(text)["version"] == stack_tool.STACK_VERSION


def test_the_docker_cli_reads_the_stack_as_stack_deploy_does(tmp_path: Path, secrets_dir: Path) -> None:
    if shutil.which("docker") is None:
        required.missing("compose", "no docker CLI to read the stack (apt-get install docker.io)")
    for files in ((COMPOSE,), (COMPOSE, E2E)):
        path = tmp_path / "stack.yaml"
        path.write_text(stack_tool.render(derive({"MOONBUS_COMPOSE_SECRETS": str(secrets_dir)}, files)[0], list(files)))
        result = subprocess.run(["docker", "stack", "config", "-c", str(path)], capture_output=True, text=True, timeout=60,
                                env=os.environ | {"DOCKER_HOST": "unix:///nonexistent"})  # no engine is asked
        assert result.returncode == 0, result.stderr
        assert "Ignoring" not in result.stderr and "unsupported" not in result.stderr, result.stderr
        assert set(yaml.safe_load(result.stdout)["services"]) == set(yaml.safe_load(COMPOSE.read_text())["services"])
