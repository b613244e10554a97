"""The stack file `docker stack deploy` takes, derived from compose.yaml: one description of the cluster.

    python -m tools.swarm.stack [-f compose.yaml [-f override.yaml ...]] [-o stack.yaml]
    docker stack deploy -c stack.yaml moonbus

compose.yaml says everything about a service once; what only a swarm needs sits in the service's
`x-swarm:` (Compose ignores x- keys): its `deploy:` section (replicas, limits, restart policy,
update_config, placement) and whatever else differs on a swarm, merged over the service here.
What a swarm cannot use is left out or rewritten, the same way for every service:

    build            a stack runs images built beforehand (`make images`)
    depends_on       a swarm starts every service at once; one whose dependency is not up yet exits
                     and is started again (deploy.restart_policy); health gates the updates
    restart          deploy.restart_policy says it on a swarm
    expose           every port of a service is open to the others on the stack's network
    container_name   a swarm names each task itself
    ports            the long syntax in host mode: the node's own port goes to the task on that
                     node (through docker-proxy), not through the ingress routing mesh; a host IP
                     (`127.0.0.1:8000:8000`) has no place in a stack and is dropped, saying so
    relative paths   (secret files, bind mounts) made absolute, from the first file's directory,
                     as Compose reads them

${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?message} and $$ are filled in from the
environment here, as Compose does, so the stack file names what it deploys (the model, the
secret files, the limits). A service without a deploy section, or with what a stack cannot run
(ipc or network namespaces shared with another service), is an error.

Override files merge as mappings, key by key; anything else in a later file replaces what an
earlier one said (where Compose would append to a few lists: the overrides used here set none of
those that the first file sets).
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import sys
from pathlib import Path

import yaml

STACK_VERSION = "3.9"  # the last 3.x schema: the one dockerd 20.10's stack deploy and the docker CLI both read
SWARM_KEY = "x-swarm"
DROPPED = ("build", "depends_on", "restart", "expose", "container_name")
UNRUNNABLE = ("ipc", "network_mode", "pid", "volumes_from")  # sharing another container's namespace
_VARIABLE = re.compile(r"\$(?:(\$)|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")


class StackError(ValueError):
    """Raised when the compose files cannot become a stack; the message says which service and why."""


def interpolate(value, env: dict[str, str]):
    """Fill in ${...} in every string of `value` (a parsed YAML document), as Compose does."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def fill(match: re.Match) -> str:
        dollar, name, op, arg, bare = match.groups()
        if dollar:
            return "$"
        name = name or bare
        current = env.get(name)
        if op in (":-", "-"):
            return arg if (current is None or (op == ":-" and current == "")) else current
        if op in (":?", "?"):
            if current is None or (op == ":?" and current == ""):
                raise StackError(f"${{{name}}} is required: {arg or 'unset'}")
            return current
        return current or ""

    return _VARIABLE.sub(fill, value)


def merge(base, override):
    """`override` over `base`: mappings key by key, anything else replaced."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for key, value in override.items():
            out[key] = merge(base[key], value) if key in base else copy.deepcopy(value)
        return out
    return copy.deepcopy(override)


def load(files: list[Path], env: dict[str, str]) -> dict:
    """The compose files merged in order, anchors resolved and variables filled in."""
    merged: dict = {}
    for path in files:
        merged = merge(merged, yaml.safe_load(Path(path).read_text()) or {})
    return interpolate(merged, env)


def derive(compose: dict, base_dir: Path) -> tuple[dict, list[str]]:
    """(the stack, notes on what was dropped that a reader should know)."""
    notes: list[str] = []
    services = {}
    for name, service in (compose.get("services") or {}).items():
        services[name] = _service(name, service, base_dir, notes)
    stack: dict = {"version": STACK_VERSION, "services": services}
    for key in ("volumes", "networks", "configs"):
        if compose.get(key):
            stack[key] = copy.deepcopy(compose[key])
    if compose.get("secrets"):
        stack["secrets"] = {name: _secret(name, spec, base_dir) for name, spec in compose["secrets"].items()}
    return stack, notes


def _service(name: str, service: dict, base_dir: Path, notes: list[str]) -> dict:
    swarm = service.get(SWARM_KEY) or {}
    out = merge({k: v for k, v in service.items() if not k.startswith("x-")}, swarm)
    for key in UNRUNNABLE:
        if key in out:
            raise StackError(f"service {name}: `{key}: {out[key]}` cannot run on a swarm (a task shares no "
                             "namespace with another service's); give it a volume instead (as the nodes' shm)")
    if not isinstance(out.get("deploy"), dict):
        raise StackError(f"service {name} has no deploy section: give it `{SWARM_KEY}: {{deploy: ...}}` in the compose file")
    for key in DROPPED:
        out.pop(key, None)
    if "ports" in out:
        out["ports"] = [_port(name, p, notes) for p in out["ports"]]
    if "volumes" in out:
        out["volumes"] = [_volume(name, v, base_dir, notes) for v in out["volumes"]]
    return out


def _port(name: str, port, notes: list[str]) -> dict:
    if isinstance(port, dict):
        spec = {k: v for k, v in port.items() if k != "host_ip"}
        if "host_ip" in port:
            notes.append(f"{name}: port {port['target']} published on every address (a stack has no host_ip)")
        return {"mode": "host", **spec}
    text, protocol = (str(port).split("/", 1) + ["tcp"])[:2]
    parts = text.rsplit(":", 2)
    if len(parts) == 3:
        notes.append(f"{name}: port {parts[2]} published on every address, not only {parts[0]} (a stack has no host IP)")
        parts = parts[1:]
    if len(parts) == 1:
        return {"target": int(parts[0]), "protocol": protocol, "mode": "host"}
    return {"target": int(parts[1]), "published": int(parts[0]), "protocol": protocol, "mode": "host"}


def _volume(name: str, volume, base_dir: Path, notes: list[str]):
    if isinstance(volume, dict):
        if volume.get("type") == "bind":
            volume = {**volume, "source": _absolute(volume["source"], base_dir)}
            notes.append(f"{name}: bind mount {volume['source']} must exist on every node it may run on")
        return volume
    source, sep, rest = volume.partition(":")
    if sep and source.startswith((".", "/", "~")):
        source = _absolute(source, base_dir)
        notes.append(f"{name}: bind mount {source} must exist on every node it may run on")
        return f"{source}:{rest}"
    return volume


def _secret(name: str, spec: dict, base_dir: Path) -> dict:
    if "file" in spec:
        return {**spec, "file": _absolute(spec["file"], base_dir)}
    return dict(spec)


def _absolute(path: str, base_dir: Path) -> str:
    expanded = Path(os.path.expanduser(path))
    return str(expanded if expanded.is_absolute() else (base_dir / expanded).resolve())


def render(stack: dict, files: list[Path]) -> str:
    names = ", ".join(str(f) for f in files)
    header = (f"# Derived from {names} by tools/swarm/stack.py: edit those, not this.\n"
              "#   docker stack deploy -c <this file> moonbus\n")
    return header + yaml.safe_dump(stack, sort_keys=False, default_flow_style=False, width=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.swarm.stack", description=__doc__.split("\n\n")[0])
    parser.add_argument("-f", "--file", action="append", type=Path, dest="files",
                        help="a compose file (repeatable, merged in order; default compose.yaml)")
    parser.add_argument("-o", "--output", type=Path, help="where to write the stack file (default stdout)")
    args = parser.parse_args(argv)
    files = args.files or [Path("compose.yaml")]
    try:
        stack, notes = derive(load(files, dict(os.environ)), files[0].resolve().parent)
    except (StackError, OSError, yaml.YAMLError) as exc:
        print(f"stack: {exc}", file=sys.stderr)
        return 1
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    text = render(stack, files)
    if args.output:
        args.output.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
