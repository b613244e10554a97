"""`moonbus up`: start a local cluster (embedded NATS, every service) and keep it running until Ctrl-C.

A process that exits is restarted (tools/moonbus/cluster/supervisor.py); only Ctrl-C/SIGTERM stops all.
With --autoscale the first conductor runs the planner and the supervisor starts and drains prefill
and decode workers to its targets (tools/moonbus/cluster/autoscale.py).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from common import cores, models, profiles, signing
from common.config import NatsAuth, default_home
from common.security import read_secret
from tools.moonbus.cluster.autoscale import LocalScaler
from tools.moonbus.cluster.processes import Cluster, ClusterError, ClusterSpec
from tools.moonbus.cluster.supervisor import Action, RestartPolicy, SupervisorEvents

ROOT = Path(__file__).resolve().parents[3]
ENGINE_SOURCES = ("common/engine", "services/prefill", "services/decode", "tools/moonbus/cluster/profile.py")  # what a profile times


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=models.SMOLLM2, help="SmolLM2-135M-Instruct (default), tiny-random, or a local checkpoint dir")
    parser.add_argument("--prefill", type=int, default=1, help="prefill instances, each on its own node with a messenger")
    parser.add_argument("--decode", type=int, default=1, help="decode instances, each on its own node with a messenger")
    parser.add_argument("--coupled", type=int, default=0, metavar="N",
                        help="run N coupled instances (prefill and decode in one process, vLLM-like) "
                             "instead of --prefill/--decode, each on its own node with a messenger")
    parser.add_argument("--autoscale", action="store_true",
                        help="the first conductor's planner decides how many prefill and decode instances run "
                             "(--prefill/--decode are where it starts), and the supervisor starts and drains workers "
                             "to its targets")
    parser.add_argument("--autoscale-prefill", default="1:4", metavar="MIN:MAX",
                        help="autoscaled prefill instances (NATS users are made for MAX at the start)")
    parser.add_argument("--autoscale-decode", default="1:4", metavar="MIN:MAX", help="autoscaled decode instances")
    parser.add_argument("--planner-interval", type=float, default=30.0, help="autoscaled: seconds between decisions")
    parser.add_argument("--planner-settings", default="", metavar="NAME=VALUE,...",
                        help="autoscaled: more of the planner's settings (common/decide/planner.py PlannerSettings: "
                             "watermarks, streaks, cooldowns), as the conductor's --planner-settings")
    parser.add_argument("--conductors", type=int, default=1, help="conductor replicas (they share one view of load)")
    parser.add_argument("--cache-indexes", type=int, default=1, help="cache index replicas")
    parser.add_argument("--gateways", type=int, default=1, help="gateway replicas, on --port, --port + 1, ...")
    parser.add_argument("--host", default="127.0.0.1", help="gateway bind address")
    parser.add_argument("--api-keys", default="", metavar="FILE",
                        help="require API keys from this file (moonbus keys add); default: open, for a local start")
    parser.add_argument("--port", type=int, default=8000, help="gateway port")
    parser.add_argument("--nats-port", type=int, default=4333, help="port of the embedded nats-server")
    parser.add_argument("--home", type=Path, default=default_home(), help="state directory (logs, NATS store, model cache)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads per worker (0 = by role: the prefill instances together get every core, "
                             "each decode instance its share of the cores among all workers)")
    parser.add_argument("--prefill-threads", type=int, default=0, help="torch threads per prefill instance (0 = as above)")
    parser.add_argument("--decode-threads", type=int, default=0, help="torch threads per decode instance (0 = as above)")
    parser.add_argument("--policy", default="kvcache-centric", help="random, load-balancing, cache-aware, kvcache-centric")
    parser.add_argument("--admission", default="predictive", help="none, baseline, early, predictive")
    parser.add_argument("--ttft-slo", type=float, default=30.0, help="seconds")
    parser.add_argument("--tbt-slo", type=float, default=1.0, help="seconds")
    parser.add_argument("--block-tokens", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                        help="compute and KV dtype (auto: bfloat16 where the CPU has AVX-512 BF16 or AMX)")
    parser.add_argument("--dram-bytes", type=int, default=512 << 20, help="DRAM KV pool per node")
    parser.add_argument("--ssd-bytes", type=int, default=2 << 30, help="SSD (LMDB) KV pool per node")
    parser.add_argument("--eviction", default="lru", help="lru, lfu, length-aware")
    parser.add_argument("--pipeline-group", type=int, default=1,
                        help="prefill instances that share one long prompt, chunk by chunk (1 = off)")
    parser.add_argument("--prefill-chunk", type=int, default=2048, help="tokens per prefill chunk")
    parser.add_argument("--transport", default="auto", choices=("auto", "tcp", "rdma"),
                        help="point-to-point KV transport: auto = rdma where both ends have an RDMA device, else tcp")
    parser.add_argument("--tcp-streams", type=int, default=1,
                        help="tcp connections per peer a write of 4 MiB or more is striped over (default 1)")
    parser.add_argument("--link-tls", action="store_true",
                        help="TLS on the KV links: every process that opens one gets a certificate of the cluster's "
                             "link CA (under <home>/secrets). Off by default: then every frame still carries a keyed "
                             "MAC of its connection (integrity, not secrecy), at less cost than TLS")
    parser.add_argument("--link-peers", default="auto",
                        help="addresses/networks (CIDR) the KV links take connections from; 'auto' (default): the "
                             "networks this host is on, loopback included; '' = anyone who reaches the port")
    parser.add_argument("--profile", default="", help="performance profile (default: measured on first start)")
    parser.add_argument("--log-level", default="INFO")


def run(args: argparse.Namespace) -> int:
    if args.coupled < 0 or (not args.coupled and (args.prefill < 1 or args.decode < 1)):
        print("moonbus up: --prefill and --decode (or --coupled) must be at least 1", file=sys.stderr)
        return 2
    home = args.home.resolve()
    print(f"preparing model {args.model} (converted once, cached under {home / 'models'}) ...", flush=True)
    try:
        ref = models.prepare(args.model, home)
    except models.ModelNotFound as exc:
        print(f"moonbus up: {exc}", file=sys.stderr)
        return 2
    dtype = models.resolve_dtype(args.dtype)
    try:
        bounds = autoscale_bounds(args)
    except ValueError as exc:
        print(f"moonbus up: {exc}", file=sys.stderr)
        return 2
    if min(args.conductors, args.cache_indexes, args.gateways) < 1:
        print("moonbus up: --conductors, --cache-indexes and --gateways must be at least 1", file=sys.stderr)
        return 2
    spec = ClusterSpec(home=home, model=args.model, prefill=args.prefill, decode=args.decode, coupled=args.coupled,
                       conductors=args.conductors, cache_indexes=args.cache_indexes, gateways=args.gateways,
                       api_keys=str(Path(args.api_keys).resolve()) if args.api_keys else "",
                       host=args.host, port=args.port, nats_port=args.nats_port, threads=args.threads,
                       prefill_threads=args.prefill_threads, decode_threads=args.decode_threads, log_level=args.log_level,
                       policy=args.policy, admission=args.admission, ttft_slo_s=args.ttft_slo, tbt_slo_s=args.tbt_slo,
                       block_tokens=args.block_tokens, dtype=dtype, dram_bytes=args.dram_bytes, ssd_bytes=args.ssd_bytes,
                       eviction=args.eviction, profile=args.profile, pipeline_group=args.pipeline_group,
                       prefill_chunk=args.prefill_chunk, transport=args.transport, tcp_streams=args.tcp_streams,
                       link_tls=args.link_tls, link_peers=args.link_peers)
    if bounds:
        spec.max_prefill, spec.max_decode = bounds["prefill"][1], bounds["decode"][1]
        spec.planner = ["--planner", "--planner-interval", str(args.planner_interval),
                        "--planner-prefill", args.autoscale_prefill, "--planner-decode", args.autoscale_decode,
                        *(["--planner-settings", args.planner_settings] if args.planner_settings else [])]
    threads = {role: spec.profile_threads("coupled" if args.coupled else role) for role in ("prefill", "decode")}
    if not args.profile:
        done = ensure_profile(profiles.profile_path(home, ref.name, dtype), home, args.model, dtype, threads,
                              env=spec.model_env)
        if done is not None and done.returncode != 0:
            print("moonbus up: profiling failed; the conductor will use an analytic guess", file=sys.stderr)
    cluster = Cluster(spec)
    stopping = False

    def on_signal(signum, frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    workers = f"{args.coupled} coupled" if args.coupled else f"{args.prefill} prefill + {args.decode} decode"
    print(f"starting NATS on {spec.nats_addr} and {workers} instances ...", flush=True)
    try:
        cluster.start()
    except ClusterError as exc:
        print(f"moonbus up: {exc}", file=sys.stderr)
        return 1
    print_ready(spec, ref.name, cluster)
    supervise(cluster, lambda: stopping, autoscale=bool(bounds))
    say("stopping the cluster (workers first finish what they hold; Ctrl-C again is not needed) ...")
    cluster.stop()
    say("stopped.")
    return 0


def autoscale_bounds(args: argparse.Namespace) -> dict[str, tuple[int, int]]:
    """--autoscale's (min, max) per role ({} without it). Raises ValueError saying what is wrong."""
    if not args.autoscale:
        return {}
    if args.coupled:
        raise ValueError("--autoscale runs prefill and decode instances, not --coupled ones")
    bounds = {}
    for role, text, start in (("prefill", args.autoscale_prefill, args.prefill), ("decode", args.autoscale_decode, args.decode)):
        try:
            low, high = (int(n) for n in text.split(":"))
        except ValueError:
            raise ValueError(f"--autoscale-{role} takes MIN:MAX; got {text!r}") from None
        if not 1 <= low <= start <= high:
            raise ValueError(f"--autoscale-{role} {text}: needs 1 <= MIN <= --{role} ({start}) <= MAX")
        bounds[role] = (low, high)
    return bounds


def supervise(cluster: Cluster, stopping, policy: RestartPolicy = RestartPolicy(), autoscale: bool = False) -> None:
    """Restart what exits until Ctrl-C/SIGTERM, and with `autoscale` run the planner's targets
    (tools/moonbus/cluster/autoscale.py); say what happened, as text and as events."""
    auth, secret, signer = None, None, None
    if cluster.secrets is not None:
        auth = NatsAuth("supervisor", str(cluster.secrets.password_file("supervisor")))
        secret = read_secret(cluster.secrets.cluster_key)
        signer = signing.load(cluster.signing_key("supervisor", ["supervisor/supervisor"]))
    events = SupervisorEvents(cluster.spec.nats_addr, auth, secret, signer)
    scaler = LocalScaler(cluster, events, say) if autoscale else None
    try:
        while not stopping():
            for action in cluster.supervise(time.monotonic(), policy):
                report(cluster, action, events)
            if scaler is not None:
                scaler.act()
            time.sleep(0.2)
    finally:
        events.close()


def report(cluster: Cluster, action: Action, events: SupervisorEvents) -> None:
    d = action.detail
    if action.kind == "retired":  # drained for good (autoscale): gone from the cluster
        say(f"moonbus up: autoscale: {action.name} retired (exit code {d['exit_code']})")
        events.instance("retired", action.name, **d)
        if d["exit_code"] != 0:  # it did not leave cleanly: what it held is handed back now
            for instance in instance_ids(action.name, d["kind"]):
                events.exited(instance, d["exit_code"])
        return
    proc = cluster.procs[action.name]
    if action.kind == "exited":
        say(f"moonbus up: {action.name} exited with code {d['exit_code']}; restarting it in {d['restart_in_s']:g} s "
            f"(log: {proc.log_path})")
        for instance in instance_ids(proc.name, proc.kind):
            events.exited(instance, d["exit_code"])
    elif action.kind == "restarted":
        say(f"moonbus up: {action.name} restarted (pid {d['pid']}, restart {d['restarts']})")
        events.instance("restarted", action.name, **d)
    else:
        say(f"moonbus up: {action.name} exited {d['exits']} times within {d['window_s']:g} s; it is crash-looping, "
            f"so it stays down (the rest keeps serving). Last exit code {d['exit_code']}; see {proc.log_path}")
        events.instance("crash_loop", action.name, **d)
        for instance in instance_ids(proc.name, proc.kind):
            events.exited(instance, d["exit_code"])


def instance_ids(name: str, kind: str) -> list[str]:
    """The instance ids a process announced (a coupled one is a prefill and a decode instance)."""
    if kind == "coupled":
        return [f"{name}-prefill", f"{name}-decode"]
    return [name] if kind in ("prefill", "decode", "messenger") else []


def say(line: str) -> None:
    """Print, even when stdout is a pipe whose reader was also interrupted (e.g. `make run | tee`)."""
    try:
        print(line, flush=True)
    except BrokenPipeError:
        pass


def print_ready(spec: ClusterSpec, model: str, cluster: Cluster) -> None:
    if spec.api_keys:
        doors = f"API keys required (from {spec.api_keys}; add one with `moonbus keys add --tenant NAME --file ...`)"
        auth = " -H 'Authorization: Bearer <your key>'"
    else:
        doors = ("NO API KEYS: anyone who can reach the port can use it, and all callers share one prefix cache "
                 "(start with --api-keys FILE to require keys)")
        auth = ""
    links = ("TLS, each process with its own certificate of the cluster's link CA" if spec.link_tls else
             "the cluster secret's handshake and a keyed MAC on every frame: none can be rewritten, but they "
             "travel unencrypted (--link-tls to encrypt them)")
    autoscale = ""
    if spec.planner:
        autoscale = (f"\n  autoscale: the planner on conductor decides, the supervisor starts and drains workers "
                     f"(at most {spec.max_prefill} prefill, {spec.max_decode} decode; their NATS users made now); "
                     f"its decisions: moonbus tap --home {spec.home} --kind planned")
    print(f"""
moonbus is ready: {spec.url}   (model {model})
  processes: {', '.join(cluster.procs)}
  logs:      {cluster.log_dir}
  events:    moonbus tap --home {spec.home}   (as the read-only auditor)
  doors:     {doors}
             the bus is closed: its own NATS user for every worker, messenger, cache index and gateway, every process signing its own events, secrets in {spec.home / "secrets"}
             KV links: {links}{autoscale}

try:
  curl {spec.url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "What is the capital of France?"}}], "max_tokens": 32, "temperature": 0}}'

Ctrl-C stops every process.""", flush=True)


def engine_key(root: Path = ROOT) -> str:
    """A hash of the sources a profile times (ENGINE_SOURCES): a changed engine is measured again."""
    digest = hashlib.sha256()
    for rel in ENGINE_SOURCES:
        path = root / rel
        for f in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            digest.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes())
    return digest.hexdigest()[:12]


def profile_stale(path: Path, threads: dict[str, int], wait: str = "") -> str:
    """Why the profile at `path` must be measured (again) for instances run with `threads` torch
    threads per role ("prefill", "decode") on this engine, with OpenMP's threads waiting as `wait`
    says (common.cores.wait_setting; "": OpenMP's default); "" when it fits them."""
    if not path.exists():
        return "once"
    meta = profiles.read(path).meta
    if meta.get("engine") != engine_key():
        return "again: the engine changed since it was measured"
    measured = profiles.measured_threads(meta)
    if measured != threads:
        return (f"again, with {threads} torch threads: the profile was measured with "
                + (str(measured) if measured else "a number it does not record"))
    if meta.get("omp_wait", "") != wait:
        return (f"again, with {wait or 'OpenMP threads waiting as by default'}: the profile was measured with "
                f"{meta.get('omp_wait') or 'the default wait'}")
    return ""


def ensure_profile(path: Path, home: Path, model: str, dtype: str, threads: dict[str, int], say=say,
                   capture: bool = False, env: dict[str, str] | None = None) -> subprocess.CompletedProcess | None:
    """Measure the profile at `path` (`moonbus profile --quick`) unless it fits `threads`: the one
    rule for when `moonbus up` and the benches measure. None when it fit; else how the run ended
    (the file is replaced only by a run that succeeded). `env`: what the workers' environment adds
    (ClusterSpec.model_env), so that they are measured as they will run."""
    run_env = os.environ | (env or {})
    why = profile_stale(path, threads, cores.wait_setting(run_env))
    if not why:
        return None
    say(f"measuring the model's prefill and decode times {why} (moonbus profile --quick) into {path} ...")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    done = subprocess.run([sys.executable, "-m", "tools.moonbus.cli", "profile", "--quick", "--model", model,
                           "--home", str(home), "--dtype", dtype, "--prefill-threads", str(threads["prefill"]),
                           "--decode-threads", str(threads["decode"]), "--out", str(tmp)],
                          cwd=ROOT, capture_output=capture, text=True, env=run_env)
    if done.returncode == 0:
        os.replace(tmp, path)
        say(f"the profile is in {path}")
    else:
        tmp.unlink(missing_ok=True)
    return done
