"""The live-route rows of `moonbus bench conductor`: one route, end to end, through real processes.

Setup, all on loopback, in a temporary home:
  - an embedded nats-server (JetStream on) on a free port, one cache index process, and 1, then 3
    (--live-conductors) conductor processes: `python -m services.conductor --model tiny-random
    --block-tokens 16 --profile <fixed profile>`, policy kvcache-centric, predictive admission with
    the default SLOs. The profile has fixed coefficients of the order of tiny-random on a CPU (the
    timing does not depend on them), so nothing is profiled.
  - side by side (--live-prefix-index, the first is ours): for each conductor count, conductors
    that keep their own copy of the prefix index (`--prefix-index local`, fed by the KV events:
    no bus round trip per route), then conductors that ask the cache index per route (`remote`),
    each started fresh for its phase and stopped after it, so that only one kind answers at a
    time and both meet the machine at about the same moment.
  - this process plays the fleet (tools/moonbus/bench/fleet.py): 16 prefill + 16 decode instances
    on 32 nodes, heartbeats with load reports every 150 ms, and one messenger per node whose
    snapshot gives the real cache index the blocks: the first rows of the conversation trace,
    prompts and keys as `moonbus replay` and the conductor make them, stored on the prefill nodes
    round robin until --live-blocks (node, key) entries. The later rows are the queries.
  - timing starts once the cache index holds every block (INDEX_DUMP per node), every conductor
    sees every instance (CONDUCTOR_STATUS, one reply per conductor) and, with a local index, every
    conductor's copy holds every block (its moonbus_conductor_index_holdings metric).

First, the floor (tools/moonbus/bench/echo.py): the same routes from the same client through the same
broker to a process that only answers, with an admitted route's reply bytes; what the bus costs
before a conductor does anything. Each conductor row is then shown above it.

Timed here (time.perf_counter_ns): a RouteRequest on CONDUCTOR_ROUTE until its RouteReply is
decoded; that is, this client's send, the broker, the conductor's decode and key hashing, its
prefix lookup (local: in memory; remote: a cache index query, another round trip), policy,
admission, the `routed` event and the dispatch, and the reply back. After each reply a Cancel ends
the request's load at its conductor (the fake instances never report it). Latency: one route in
flight; routes/s: --live-concurrency in flight.
Afterwards the `routed` events in the stream tell which conductor answered each timed route and
how long a prefix the index found. Every process shares this machine's cores (those this process
may run on: os.sched_getaffinity); the report says how many.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson
from nats.errors import NoRespondersError, TimeoutError as NatsTimeout
from nats.js.api import ConsumerConfig, DeliverPolicy

from common import bus, models, profiles
from common.config import default_home
from common.decide.perf import DecodeModel, PrefillModel, Profile
from tools.moonbus.traces.rows import TraceRow
from schemas import subjects
from schemas.index import IndexDumpReply, IndexDumpRequest
from schemas.route import RouteReply, RouteRequest, SamplingParams
from schemas.tokens import Cancel
from schemas.workers import Layout, StatusReply
from services.conductor.config import PREFIX_INDEXES
from tools.moonbus.bench.fleet import BLOCK_TOKENS, FakeFleet, PromptBuilder, store_blocks
from tools.moonbus.bench.route_report import Phase, cpu_per_route, events_summary, phase_row, summary
from tools.moonbus.cluster.processes import Cluster, ClusterError, ClusterSpec, free_port

MODEL = models.TINY_RANDOM
PREFILL_CHUNK = 2048
ROUTE_TIMEOUT_S = 5.0
READY_TIMEOUT_S = 90.0
SAMPLING = SamplingParams(temperature=0.0, max_tokens=16)
REPLY_SUBJECT = subjects.gateway_tokens("bench")  # nobody reads it: no token is ever produced
ECHO_SUBJECT = "moonbus.bench.echo"  # the floor row's responder (tools/moonbus/bench/echo.py)
# NOTE: fixed, of the order of tiny-random on a 2-core CPU: ~35 ms to prefill 400 tokens, ~25 ms a
# decode step for a batch of 32; SLOs stay far away, so admission runs in full and admits
PREFILL_COEF = (0.01, 5e-5, 2e-8, 1e-6)  # 1, n-p, n^2-p^2, p
DECODE_COEF = (0.004, 5e-4, 2e-7)  # 1, batch, context tokens


class LiveBenchError(RuntimeError):
    """Raised when the live setup does not come up: a process exited, the cache index did not load
    the blocks, or the conductors did not see the fleet, in time."""


@dataclass(frozen=True)
class LiveConfig:
    conductors: tuple[int, ...] = (1, 3)
    prefill: int = 16
    decode: int = 16
    blocks: int = 200_000  # (node, key) entries the cache index must hold
    queries: int = 2_000  # distinct query prompts, cycled
    warmup: int = 200  # routes before timing, per conductor count
    latency_routes: int = 2_000  # one in flight
    throughput_routes: int = 4_000  # `concurrency` in flight
    concurrency: int = 32
    model_home: Path = default_home()  # where tiny-random is built once and reused
    index_timeout_s: float = 0.5  # the conductors' --index-timeout (their default)
    prefix_indexes: tuple[str, ...] = ("local", "remote")  # the conductors' --prefix-index, ours first

    def __post_init__(self) -> None:
        if not self.conductors or min(self.conductors) < 1 or list(self.conductors) != sorted(set(self.conductors)):
            raise ValueError(f"conductor counts must be >= 1 and increasing, got {self.conductors}")
        if not self.prefix_indexes or len(set(self.prefix_indexes)) != len(self.prefix_indexes) \
                or not set(self.prefix_indexes) <= set(PREFIX_INDEXES):
            raise ValueError(f"prefix indexes must be distinct, from {', '.join(PREFIX_INDEXES)}; "
                             f"got {self.prefix_indexes}")
        if min(self.prefill, self.decode, self.blocks, self.queries, self.latency_routes,
               self.throughput_routes, self.concurrency) < 1 or self.warmup < 0 or self.index_timeout_s <= 0:
            raise ValueError("instance, block, query and route counts must be >= 1 (warmup >= 0, index timeout > 0)")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LiveConfig:
        return cls(tuple(int(n) for n in args.live_conductors.split(",")), args.live_prefill, args.live_decode,
                   args.live_blocks, args.live_queries, args.live_warmup, args.live_latency_routes,
                   args.live_throughput_routes, args.live_concurrency, args.live_model_home, args.live_index_timeout,
                   tuple(m.strip() for m in args.live_prefix_index.split(",") if m.strip()))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = LiveConfig()
    parser.add_argument("--live", action=argparse.BooleanOptionalAction, default=True,
                        help="also time the live route end to end (real nats-server, cache index, conductors)")
    parser.add_argument("--live-conductors", default=",".join(map(str, d.conductors)), help="conductor counts, in order")
    parser.add_argument("--live-prefill", type=int, default=d.prefill, help="fake prefill instances")
    parser.add_argument("--live-decode", type=int, default=d.decode, help="fake decode instances")
    parser.add_argument("--live-blocks", type=int, default=d.blocks, help="(node, key) entries in the cache index")
    parser.add_argument("--live-queries", type=int, default=d.queries, help="distinct query prompts")
    parser.add_argument("--live-warmup", type=int, default=d.warmup, help="untimed routes per conductor count")
    parser.add_argument("--live-latency-routes", type=int, default=d.latency_routes, help="timed, one in flight")
    parser.add_argument("--live-throughput-routes", type=int, default=d.throughput_routes,
                        help="timed, --live-concurrency in flight")
    parser.add_argument("--live-concurrency", type=int, default=d.concurrency)
    parser.add_argument("--live-model-home", type=Path, default=d.model_home,
                        help="where tiny-random is built once (its config gives the conductors the KV layout)")
    parser.add_argument("--live-index-timeout", type=float, default=d.index_timeout_s,
                        help="the conductors' --index-timeout, seconds: a route whose index query takes longer goes "
                             "on as if nothing were cached (counted in index_timeouts)")
    parser.add_argument("--live-prefix-index", default=",".join(d.prefix_indexes),
                        help="the conductors' --prefix-index, side by side; the first is ours (its rows are judged "
                             "against the goals), the others are compared with it")


def run_live(cfg: LiveConfig, rows: list[TraceRow]) -> dict:
    """Set up, time every conductor count, stop every process; returns the `live` report."""
    prompts = PromptBuilder()
    prefill_nodes = tuple(f"node-{i:02d}" for i in range(cfg.prefill))
    blocks, fill_rows = store_blocks(rows, prefill_nodes, cfg.blocks, prompts)
    queries = [ids for ids in (prompts(r) for r in rows[fill_rows:fill_rows + cfg.queries]) if ids]
    if not queries:
        raise LiveBenchError(f"no trace rows left to query with after the {fill_rows:,} stored ones")
    ref = models.prepare(MODEL, cfg.model_home.resolve())
    with tempfile.TemporaryDirectory(prefix="moonbus-bench-route-") as tmp:
        home = Path(tmp)
        layout, perf, profile_file = _prepare_home(home, ref)
        cluster = Cluster(ClusterSpec(home=home, model=MODEL, nats_port=free_port(), log_level="WARNING",
                                      profile=str(profile_file)))
        gc.collect()
        gc.freeze()  # as in the pure rows: the setup (prompts, blocks) out of the collector's walks
        try:
            cluster.log_dir.mkdir(parents=True, exist_ok=True)
            cluster.start_nats()
            cluster.service("cache_index", "cache_index")
            report = asyncio.run(_drive(cfg, cluster, layout, perf, blocks, queries))
        except ClusterError as exc:
            raise LiveBenchError(str(exc)) from exc
        finally:
            gc.unfreeze()
            cluster.stop(grace_s=10)
    report["setup"] |= {"trace_rows_stored": fill_rows, "query_prompts": len(queries),
                        "mean_query_tokens": float(np.mean([len(q) for q in queries]))}
    return report


def _prepare_home(home: Path, ref: models.ModelRef) -> tuple[Layout, Profile, Path]:
    """The model linked in from where it was built; a fixed profile written."""
    (home / "models").mkdir(parents=True)
    (home / "models" / ref.path.name).symlink_to(ref.path, target_is_directory=True)
    shape = models.read_shape(ref)
    dtype = models.resolve_dtype("auto")  # what the cluster's services resolve it to
    layout = Layout(ref.name, BLOCK_TOKENS, PREFILL_CHUNK, shape.kv_layout(BLOCK_TOKENS, dtype).signature)
    perf = Profile(PrefillModel(PREFILL_COEF), DecodeModel(DECODE_COEF), ref.name, "fixed (bench)",
                   shape.kv_bytes_per_token(dtype), {"source": "moonbus bench conductor: fixed coefficients, not measured"})
    path = profiles.profile_path(home, ref.name, dtype)
    path.parent.mkdir(parents=True)
    profiles.save(perf, path)
    return layout, perf, path


async def _drive(cfg: LiveConfig, cluster: Cluster, layout: Layout, perf: Profile,
                 blocks: dict[str, list[int]], queries: list[list[int]]) -> dict:
    nc = await bus.connect(cluster.spec.nats_url, "bench-route", first_connect_timeout_s=20)
    fleet = FakeFleet(nc, layout, perf, cfg.prefill, cfg.decode, blocks)
    rows: dict[str, list[dict]] = {mode: [] for mode in cfg.prefix_indexes}  # --prefix-index -> a row per count
    try:
        await fleet.start()
        indexed = await _wait_indexed(nc, cluster, blocks)
        client = RouteClient(nc, queries)
        echo = await _measure_echo(cfg, cluster, client, indexed)
        for n in cfg.conductors:
            for mode in cfg.prefix_indexes:  # side by side: the same count, one kind after the other
                names = _start_conductors(cluster, cfg, n, mode)
                try:
                    await _wait_conductors(nc, cluster, n, fleet.num_instances)
                    if mode == "local":
                        await _wait_local_index(cluster, names, indexed)
                    row = await _measure(cfg, cluster, client, f"{mode}-c{n}", n, indexed)
                finally:
                    _stop_phase(cluster, names)
                rows[mode].append(row | {"prefix_index": mode})
        routed = await _routed_events(nc, client.sent)
    finally:
        await fleet.stop()
        await bus.shutdown(nc)
    for mode, mode_rows in rows.items():
        for row in mode_rows:
            row |= events_summary(routed, f"{mode}-c{row['conductors']}")
    setup = {"prefill_instances": cfg.prefill, "decode_instances": cfg.decode, "nodes": cfg.prefill + cfg.decode,
             "blocks_indexed": indexed, "block_tokens": BLOCK_TOKENS, "model": MODEL, "policy": "kvcache-centric",
             "admission": "predictive", "concurrency": cfg.concurrency, "warmup_routes": cfg.warmup,
             "index_timeout_s": cfg.index_timeout_s, "prefix_indexes": list(cfg.prefix_indexes),
             "heartbeats_per_s": round(fleet.heartbeats_per_s, 1), "cpu_cores": len(os.sched_getaffinity(0))}
    return summary(rows, setup, cfg.conductors[-1], echo)


def _start_conductors(cluster: Cluster, cfg: LiveConfig, n: int, mode: str) -> list[str]:
    """n fresh conductors with `--prefix-index mode`; their names (conductor-0, ...)."""
    names = [f"conductor-{i}" for i in range(n)]
    for name in names:
        cluster.service(name, "conductor", "--model", MODEL, "--block-tokens", str(BLOCK_TOKENS),
                        "--profile", cluster.spec.profile, "--policy", "kvcache-centric",
                        "--admission", "predictive", "--prefill-chunk", str(PREFILL_CHUNK),
                        "--index-timeout", str(cfg.index_timeout_s), "--prefix-index", mode)
    return names


def _stop_phase(cluster: Cluster, names: list[str]) -> None:
    """Stop a phase's processes (conductors drain and leave the route queue group) before the next starts."""
    procs = [cluster.procs.pop(name) for name in names if name in cluster.procs]
    for proc in procs:
        proc.popen.terminate()
    for proc in procs:
        try:
            proc.popen.wait(20)
        except subprocess.TimeoutExpired:
            proc.popen.kill()
            proc.popen.wait()


async def _measure(cfg: LiveConfig, cluster: Cluster, client: RouteClient, tag: str, n: int, indexed: int,
                   subject: str = subjects.CONDUCTOR_ROUTE) -> dict:
    """Warm up, time one route in flight, then --live-concurrency in flight: one `live_route` row."""
    load = os.getloadavg()[0]
    timeouts = _index_timeouts(cluster)  # the logs of reused names hold earlier phases' lines
    await client.phase(f"{tag}-warm", cfg.warmup, 1, subject)
    latency = await client.phase(f"{tag}-lat", cfg.latency_routes, 1, subject)
    cpu_before = _cpu_seconds(cluster)
    throughput = await client.phase(f"{tag}-tput", cfg.throughput_routes, cfg.concurrency, subject)
    cpu = cpu_per_route(cpu_before, _cpu_seconds(cluster), len(throughput.ns))
    row = phase_row(n, indexed, latency, throughput, load)
    return row | {"cpu_us_per_route": cpu, "index_timeouts": _index_timeouts(cluster) - timeouts}  # warmup included


async def _measure_echo(cfg: LiveConfig, cluster: Cluster, client: RouteClient, indexed: int) -> dict:
    """The floor row: the same routes, through the same broker and client, to a process that only
    answers (tools/moonbus/bench/echo.py) with the bytes of an admitted route's reply."""
    reply = RouteReply(True, 200, prefill_id="prefill-00", decode_id="decode-00", predicted_ttft_s=0.123456)
    reply_file = cluster.spec.home / "echo-reply.bin"
    reply_file.write_bytes(reply.to_bytes())
    cluster.spawn("echo", "echo", [sys.executable, "-m", "tools.moonbus.bench.echo", cluster.spec.nats_url,
                                   ECHO_SUBJECT, str(reply_file)])
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:  # until it subscribed
            cluster.check_alive()
            try:
                await client.nc.request(ECHO_SUBJECT, b"", timeout=1.0)
                break
            except (NoRespondersError, NatsTimeout):
                if time.monotonic() > deadline:
                    raise LiveBenchError(f"the echo responder did not answer in {READY_TIMEOUT_S:.0f} s; "
                                         f"logs in {cluster.log_dir}") from None
                await asyncio.sleep(0.1)
        return await _measure(cfg, cluster, client, "echo", 0, indexed, ECHO_SUBJECT) | {"prefix_index": "echo"}
    finally:
        _stop_phase(cluster, ["echo"])


async def _wait_indexed(nc, cluster: Cluster, blocks: dict[str, list[int]]) -> int:
    """Until the cache index holds exactly each node's blocks; returns the (node, key) entries."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    missing = dict(blocks)
    while missing:
        cluster.check_alive()
        for node, keys in list(missing.items()):
            try:
                msg = await nc.request(subjects.INDEX_DUMP, IndexDumpRequest(node).to_bytes(), timeout=5)
            except (NoRespondersError, NatsTimeout):
                break
            if set(IndexDumpReply.from_bytes(msg.data).keys) == set(keys):
                del missing[node]
        if missing and time.monotonic() > deadline:
            raise LiveBenchError(f"the cache index did not load the blocks of {sorted(missing)} in "
                                 f"{READY_TIMEOUT_S:.0f} s; logs in {cluster.log_dir}")
        await asyncio.sleep(0.2 if missing else 0)
    return sum(len(keys) for keys in blocks.values())


async def _wait_local_index(cluster: Cluster, names: list[str], indexed: int) -> None:
    """Until each conductor's own copy of the index holds every (node, key) entry (its metric)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    waiting = {name: cluster.procs[name].metrics for name in names}
    held: dict[str, float] = {}
    while waiting:
        cluster.check_alive()
        for name, url in list(waiting.items()):
            held[name] = await asyncio.to_thread(_metric, url, "moonbus_conductor_index_holdings")
            if held[name] == indexed:
                del waiting[name]
        if waiting and time.monotonic() > deadline:
            raise LiveBenchError(f"the local indexes of {sorted(waiting)} did not load the {indexed:,} blocks in "
                                 f"{READY_TIMEOUT_S:.0f} s (held: {held}); logs in {cluster.log_dir}")
        await asyncio.sleep(0.2 if waiting else 0)


def _metric(url: str, name: str) -> float:
    """One unlabelled metric from a Prometheus endpoint; -1 while it does not answer or lacks it."""
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            text = resp.read().decode()
    except OSError:
        return -1.0
    return next((float(line.split()[1]) for line in text.splitlines() if line.startswith(name + " ")), -1.0)


async def _wait_conductors(nc, cluster: Cluster, conductors: int, instances: int) -> None:
    """Until `conductors` conductors answer a status request, each seeing every fake instance."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    inbox = nc.new_inbox()
    replies: asyncio.Queue = asyncio.Queue()
    sub = await nc.subscribe(inbox, cb=replies.put)
    try:
        while True:
            cluster.check_alive()
            await nc.publish(subjects.CONDUCTOR_STATUS, b"{}", reply=inbox)
            await asyncio.sleep(0.5)
            seen = []
            while not replies.empty():
                msg = await replies.get()
                if msg.data:  # empty: the broker's "no responders" (no conductor subscribed yet)
                    status = StatusReply.from_bytes(msg.data)
                    seen.append(sum(w.role in ("prefill", "decode") for w in status.workers))
            if len(seen) >= conductors and min(seen) >= instances:
                return
            if time.monotonic() > deadline:
                raise LiveBenchError(f"{conductors} conductors seeing {instances} instances not ready in "
                                     f"{READY_TIMEOUT_S:.0f} s (answers: {seen}); logs in {cluster.log_dir}")
    finally:
        await sub.unsubscribe()


class RouteClient:
    """Sends routes as the gateway does (request/reply), then cancels each as its client would."""

    def __init__(self, nc, queries: list[list[int]]) -> None:
        self.nc = nc
        self.queries = queries
        self.sent = 0

    async def phase(self, tag: str, routes: int, concurrency: int, subject: str = subjects.CONDUCTOR_ROUTE) -> Phase:
        out = Phase(tag, [], Counter(), 0, 0, 0.0)
        numbers = iter(range(routes))

        async def sender() -> None:
            for i in numbers:
                await self.route(f"{tag}-{i}", self.queries[(self.sent + i) % len(self.queries)], out, subject)

        started = time.perf_counter()
        await asyncio.gather(*(sender() for _ in range(min(concurrency, routes))))
        out.seconds = time.perf_counter() - started
        self.sent += routes
        return out

    async def route(self, request_id: str, ids: list[int], out: Phase, subject: str = subjects.CONDUCTOR_ROUTE) -> None:
        data = RouteRequest(request_id, ids, SAMPLING, REPLY_SUBJECT, time.time()).to_bytes()
        t0 = time.perf_counter_ns()
        try:
            msg = await self.nc.request(subject, data, timeout=ROUTE_TIMEOUT_S)
        except (NoRespondersError, NatsTimeout):
            out.unanswered += 1
            return
        reply = RouteReply.from_bytes(msg.data)
        out.ns.append(time.perf_counter_ns() - t0)
        await self.nc.publish(subjects.REQUEST_CANCEL, Cancel(request_id, 0).to_bytes())
        out.statuses[reply.status] += 1
        out.admitted += reply.admitted


def _index_timeouts(cluster: Cluster) -> int:
    """Routes the conductors sent on as if nothing were cached: the index did not answer in time."""
    return sum(p.log_path.read_text(errors="replace").count("no answer from the cache index")
               for p in cluster.procs.values() if p.kind == "conductor")


def _cpu_seconds(cluster: Cluster) -> dict[str, float]:
    """CPU seconds (user + system) used so far, by kind: conductor (all), cache_index, nats, bench
    (this process: the timing client and the fleet's heartbeats). Each process's is the sum of its
    threads' run time in /proc/<pid>/task/*/schedstat (nanoseconds: /proc/<pid>/stat counts clock
    ticks of 10 ms, and a fast process answers a phase's routes in fewer), so a thread that ends
    during a phase takes its time with it; the processes here keep theirs."""
    out = {"bench": time.process_time()}
    for proc in cluster.procs.values():
        try:
            ns = sum(int((task / "schedstat").read_text().split()[0])
                     for task in Path(f"/proc/{proc.popen.pid}/task").iterdir())
        except (OSError, ValueError):  # it exited (or a thread did, while listed)
            continue
        out[proc.kind] = out.get(proc.kind, 0.0) + ns / 1e9
    return out


async def _routed_events(nc, expected: int) -> dict[str, dict]:
    """request id -> what its `routed` event says (who answered, the prefix found), from the stream."""
    sub = await nc.jetstream().subscribe(subjects.request_event("routed", "*"), ordered_consumer=True,
                                         config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL))
    out: dict[str, dict] = {}
    try:
        while len(out) < expected:
            try:
                msg = await sub.next_msg(timeout=3.0)
            except (NatsTimeout, asyncio.TimeoutError):
                break  # a route that failed before its event: counted as missing
            event = orjson.loads(msg.data)
            data = event["data"]
            out[event["request_id"]] = {"by": event["instance_id"], "best_len": data.get("best_len", 0),
                                        "prefix_blocks": data.get("prefix_blocks", 0)}
    finally:
        await sub.unsubscribe()
    return out
