"""A moonbus cluster spread over hosts: each host a network namespace (tools/netns/net.py).

`HostsCluster` is tools.moonbus.cluster.processes.Cluster with three changes, nothing else copied:
  - the broker is a NATS cluster: one nats-server per host in `nats_hosts`, routes between them
    (authenticated by their own secret), JetStream on each; the events stream is created with
    `events_replicas` copies (the conductor's --events-replicas);
  - every process runs inside its host's namespace (`ip netns exec`), and every service is given
    every NATS server (comma-separated --nats-url) and binds its listeners to its host's address
    (gateway --host, messenger --transfer-host, prefill --stream-host, --metrics-host);
  - nodes are laid out by `nodes`: node -> the workers it holds (one messenger per node).
The control plane (gateway, conductor, cache_index) runs on `control_host`. What each process is
given here is what the README's Production section tells an operator to give it.

Shared memory: namespaces share /dev/shm, but each node has its own directory in it and only that
node's processes are told about it; KV between nodes goes over TCP between host addresses.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass

from common.security import new_secret_file
from tools.moonbus.cluster.processes import Cluster, ClusterError, ClusterSpec, Planned, nats_server_binary
from tools.moonbus.cluster.security import NatsRoutes, nats_config
from tools.netns.net import Network

NATS_PORT = 4222
ROUTE_PORT = 6222
NATS_CLUSTER = "moonbus"

# node -> the workers it holds: cross-host handoffs on a and b, a local one possible on c
DEFAULT_NODES = (("node-a", ("prefill",)), ("node-b", ("decode",)), ("node-c", ("prefill", "decode")))


@dataclass
class HostsSpec(ClusterSpec):
    network: Network | None = None  # created (addresses known) before the cluster starts
    control_host: str = "ctl"
    nats_hosts: tuple[str, ...] = ("node-a", "node-b", "node-c")
    nodes: tuple[tuple[str, tuple[str, ...]], ...] = DEFAULT_NODES  # a node's host has the node's name
    events_replicas: int = 3

    def __post_init__(self) -> None:
        if self.network is None or not self.network.address:
            raise ValueError("give a created Network")
        if not 1 <= self.events_replicas <= len(self.nats_hosts):
            raise ValueError("events replicas must be between 1 and the number of NATS servers")
        self.prefill = sum(kinds.count("prefill") for _, kinds in self.nodes)
        self.decode = sum(kinds.count("decode") for _, kinds in self.nodes)
        self.host = self.network.address[self.control_host]  # the gateway's address
        self.nats_port = NATS_PORT  # each server on its own host: the same port everywhere
        args = self.service_args.setdefault("conductor", [])
        args += ["--events-replicas", str(self.events_replicas)]

    @property
    def num_messengers(self) -> int:
        return len(self.nodes)

    def nats_server_url(self, host: str) -> str:
        return f"nats://{self.network.address[host]}:{NATS_PORT}"

    @property
    def nats_addr(self) -> str:
        """Every server of the NATS cluster: a client connects to any and fails over to the others."""
        return ",".join(self.nats_server_url(h) for h in self.nats_hosts)

    @property
    def nats_url(self) -> str:
        if not self.auth:
            return self.nats_addr
        from tools.moonbus.cluster.security import ClusterSecrets

        secrets = ClusterSecrets.create(self.home / "secrets")
        return ",".join(secrets.url(self.nats_server_url(h), "admin") for h in self.nats_hosts)


class HostsCluster(Cluster):
    spec: HostsSpec

    def __init__(self, spec: HostsSpec) -> None:
        super().__init__(spec)
        self.shm_root = self.shm_root.with_name(f"moonbus-{spec.network.tag}")

    @property
    def net(self) -> Network:
        return self.spec.network

    def host_of(self, node: str) -> str:
        return node or self.spec.control_host

    # --- the NATS cluster -----------------------------------------------------------------
    def start_nats(self) -> None:
        for host in self.spec.nats_hosts:
            self.start_nats_server(host)
        for host in self.spec.nats_hosts:
            self.wait_listening(host, NATS_PORT, f"nats-{host}")

    def start_nats_server(self, host: str) -> None:
        spec, address = self.spec, self.net.address[host]
        store = spec.home / f"nats-{host}"
        store.mkdir(parents=True, exist_ok=True)
        peers = tuple(f"nats://{self.net.address[h]}:{ROUTE_PORT}" for h in spec.nats_hosts if h != host)
        if self.secrets is not None:
            route_pw = self.secrets.directory / "nats-routes.pw"
            if not route_pw.exists():
                new_secret_file(route_pw, 24)
            routes = NatsRoutes(NATS_CLUSTER, address, ROUTE_PORT, peers, route_pw.read_text().strip())
            conf = spec.home / f"nats-{host}.conf"
            conf.write_text(nats_config(self.secrets, address, NATS_PORT, store, f"nats-{host}", routes=routes))
            conf.chmod(0o600)
            args = [nats_server_binary(), "-c", str(conf)]
        else:
            args = [nats_server_binary(), "-js", "-a", address, "-p", str(NATS_PORT), "-sd", str(store),
                    "-n", f"nats-{host}", "--cluster_name", NATS_CLUSTER, "--cluster", f"nats://{address}:{ROUTE_PORT}",
                    "--routes", ",".join(peers)]
        self.spawn(f"nats-{host}", "nats", args, host)

    def wait_listening(self, host: str, port: int, name: str, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_alive()
            with socket.socket() as s:
                s.settimeout(0.5)
                if s.connect_ex((self.net.address[host], port)) == 0:
                    return
            time.sleep(0.05)
        raise ClusterError(f"{name} did not listen on {self.net.address[host]}:{port}; see {self.log_dir}")

    # --- services -------------------------------------------------------------------------
    def plan_workers(self, most: bool = False) -> list[Planned]:
        """Each host's messenger, then the workers the spec puts on it (a fixed layout: `most`, the
        workers an autoscaled cluster may add, are none here)."""
        counts, planned = {"prefill": 0, "decode": 0}, []
        for node, kinds in self.spec.nodes:
            planned.append(Planned(f"messenger-{node.removeprefix('node-')}", "messenger", node))
            for kind in kinds:
                planned.append(Planned(f"{kind}-{counts[kind]}", kind, node, counts[kind]))
                counts[kind] += 1
        return planned

    def service(self, name: str, kind: str, *args: str, node: str = "") -> None:
        """Cluster.service, bound to the host's address instead of the loopback."""
        address = self.net.address[self.host_of(node)]
        bind = {"messenger": ["--transfer-host", address], "prefill": ["--stream-host", address],
                "coupled": ["--stream-host", address]}.get(kind, [])
        if self.spec.metrics:
            bind += ["--metrics-host", address]
        super().service(name, kind, *args, *bind, node=node)
        proc = self.procs[name]
        if proc.metrics and kind != "gateway":
            proc.metrics = proc.metrics.replace("127.0.0.1", address)

    def spawn(self, name: str, kind: str, argv: list[str], node: str = "", restarts=None) -> None:
        host = node if kind == "nats" else self.host_of(node)
        prefix = self.net.exec_prefix(host)
        if list(argv[:len(prefix)]) != prefix:  # a restart passes the argv it had, prefix included
            argv = [*prefix, *argv]
        super().spawn(name, kind, argv, node, restarts)

    # --- faults ---------------------------------------------------------------------------
    def cut(self, host: str) -> None:
        self.net.cut(host)

    def restore(self, host: str) -> None:
        self.net.restore(host)
