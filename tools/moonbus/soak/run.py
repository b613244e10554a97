"""The soak run itself (`moonbus soak`, tools/moonbus/soak.py, parses the flags): plan, send, sample,
kill, drain, judge. Returns the soak.json dict; soak_report prints and draws it.

One asyncio task sends (open loop: each request is its own task, started at its time), one samples
every second, one kills (with --chaos); two JetStream ordered consumers record the events.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path

import aiohttp
from nats.js.api import ConsumerConfig, DeliverPolicy

from common import bus
from common.config import NatsAuth
from tools.moonbus.traces.measures import FAILED, RequestResult, summarize
from tools.moonbus.observe.cpu import MachineCpu
from tools.moonbus.traces.rows import load_trace, prompt_token_ids, resolve_trace
from schemas import subjects
from schemas.codec import WireError
from schemas.events import Event
from tools.moonbus.traces import replay
from tools.moonbus.soak import cluster as sc
from tools.moonbus.soak import load as sl
from tools.moonbus.soak import verdict as sv
from tools.moonbus.soak.cluster import ClusterState
from tools.moonbus.soak.verdict import EventLog, Outcome, Probe


class SoakError(RuntimeError):
    """Raised when the run cannot start: no cluster to reach, no profile for --load, no pids for --chaos."""


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.say = sys.stderr if args.json else sys.stdout  # --json keeps stdout for the JSON alone
        self.state_path = args.home.resolve() / "cluster.json"
        self.state = sc.read_state(self.state_path) or ClusterState(missing=("the whole file",))
        self.url = (args.url or self.state.url).rstrip("/")
        self.nats_url = args.nats_url or self.state.nats_url
        admin = self.state.nats_credentials.get("admin", "")  # a closed bus: the operator's own user
        self.nats_auth = NatsAuth("admin", admin) if admin and not args.nats_url else None
        if not self.url or not self.nats_url:
            raise SoakError(f"no cluster: {self.state_path} is missing or lacks url/nats_url; start `moonbus up` "
                            "or give --url and --nats-url")
        self.notes: list[str] = []
        if self.state.missing:
            self.notes.append(f"{self.state_path} lacks {', '.join(self.state.missing)} (an older `moonbus up`?)")
        self.kinds = [k for k in args.chaos.split(",") if k]
        if bad := [k for k in self.kinds if k not in sc.CHAOS_KINDS]:
            raise SoakError(f"--chaos: unknown kinds {bad}; choose from {','.join(sc.CHAOS_KINDS)}")
        if self.kinds and not any(p.pid for p in self.state.processes.values()):
            raise SoakError(f"--chaos needs the process ids that `moonbus up` writes to {self.state_path}; "
                            "this state file has none, so chaos is unavailable")
        if not self.state.processes:
            self.notes.append("no process list: RSS not sampled, messenger pins not checked, chaos unavailable")
        self.shm_root = self.state.shm_root or sc.guess_shm_root(self.nats_url)
        if not self.state.shm_root:
            self.notes.append(f"shm directory guessed from the NATS port: {self.shm_root}")
        self.trace = resolve_trace(args.trace)
        if not self.trace.exists():
            raise SoakError(f"no trace at {self.trace} (give --trace PATH; the released traces are looked for "
                            f"in $MOONBUS_TRACES, then the repository's data/traces)")
        self.rows = load_trace(self.trace, args.limit)
        self.events = EventLog()
        self.rng = random.Random(args.seed)
        self.samples: list[dict] = []
        self.kills: list[sc.Kill] = []
        self.outcomes: dict[int, Outcome] = {}  # seq -> outcome, filled as requests end
        self.t0 = 0.0  # perf_counter at the first request: every time in the report is relative to it
        self.t0_wall = 0.0  # the wall clock then (events carry wall-clock times)
        self.load_end_s = 0.0  # every request answered: the drain starts
        self.cpu: MachineCpu | None = None  # the machine's use while the load runs
        self.cpu_during_load: dict | None = None

    # --- the plan ---------------------------------------------------------------------------
    def capacity(self, model: str) -> dict:
        """The profile's capacity estimate (soak_load), or {"rps": None, "error": why}."""
        from common import models, profiles

        workload = sl.workload_rows(self.rows, self.args.count)
        lengths = [sl.prompt_length(r, self.args.tokens_per_block, self.args.max_input) for r in workload]
        num_prefill = self.state.num_prefill or 1
        home = Path(self.state.home) if self.state.home else self.args.home.resolve()
        try:
            # the profile of the dtype the workers run (a bfloat16 cluster's, not float32's analytic guess)
            profile, source = profiles.load(home, self.state.model or model, self.state.profile,
                                            models.resolve_dtype(self.state.dtype or "auto"))
            rps = sl.capacity_rps(profile.prefill, lengths, num_prefill)
        except Exception as exc:  # no model files, an unreadable profile: only --load needs it
            return {"rps": None, "error": f"{type(exc).__name__}: {exc}", "num_prefill": num_prefill}
        if not self.state.num_prefill:
            self.notes.append("the state file does not say how many prefill instances run: assumed 1")
        return {"rps": rps, "num_prefill": num_prefill, "profile": source, "requests": len(lengths),
                "mean_prefill_s": num_prefill / rps}

    def plan(self, model: str) -> tuple[list[sl.Arrival], dict, dict]:
        args = self.args
        cap = self.capacity(model)
        load = None if args.speed is not None else (args.load if args.load is not None else 1.0)
        if load is not None:
            if cap["rps"] is None:
                raise SoakError(f"--load needs the cluster's profile ({cap['error']}); use --speed instead")
            scale = sl.time_scale_for(self.rows, target_rps=load * cap["rps"])
        else:
            scale = sl.time_scale_for(self.rows, speed=args.speed)
        duration = args.duration if args.duration is not None else (None if args.count is not None else 60.0)
        arrivals = sl.schedule(self.rows, scale, count=args.count, duration_s=duration)
        target = sl.trace_rate(self.rows) / scale
        info = {"load": load, "speed": 1 / scale, "time_scale": scale, "target_rps": target, "duration_s": duration,
                "count": args.count}
        return arrivals, info, cap

    # --- the run ----------------------------------------------------------------------------
    async def run(self) -> dict:
        args = self.args
        timeout = aiohttp.ClientTimeout(total=args.timeout)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
            try:
                async with session.get(self.url + "/v1/models") as resp:
                    model = (await resp.json())["data"][0]["id"]
            except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, IndexError, ValueError) as exc:
                raise SoakError(f"cannot reach the gateway at {self.url}: {exc!r}") from exc
            arrivals, load, cap = self.plan(model)
            scalings = sl.scaling_lines(self.trace, len(self.rows), args.tokens_per_block, args.output_scale,
                                        args.max_output, args.max_input, load["time_scale"], load["target_rps"])
            print("moonbus soak: " + "; ".join(scalings), file=self.say, flush=True)
            nc = await bus.connect(self.nats_url, "moonbus-soak", self.nats_auth, first_connect_timeout_s=10)
            sampler = None
            try:
                subs = await self.subscribe(nc)
                before = await self.look(nc)
                restarts0 = self.state.restarts_by_kind()
                self.t0, self.t0_wall = time.perf_counter(), time.time()
                sampler = asyncio.create_task(self.sample_every_second())
                self.cpu = MachineCpu()
                results = await self.send_all(session, model, arrivals)
                self.load_end_s = time.perf_counter() - self.t0
                self.cpu_during_load = self.cpu.result()
                drain = await self.drain(nc, results, before)
                sampler.cancel()
                after = await self.look(nc)
                final = sc.read_state(self.state_path) or self.state
                for sub in subs:
                    with contextlib.suppress(Exception):
                        await sub.unsubscribe()
            finally:
                if sampler is not None:
                    sampler.cancel()
                # our own close reports itself as a lost connection: not worth a warning
                logging.getLogger(bus.__name__).setLevel(logging.ERROR)
                with contextlib.suppress(OSError):  # the broker is gone (chaos, or the cluster died): nothing to drain
                    await bus.shutdown(nc)
        return self.report(results, arrivals, load, cap, scalings, before, after, drain,
                           _diff(final.restarts_by_kind(), restarts0))

    async def subscribe(self, nc) -> list:
        js = nc.jetstream()
        try:
            # NOTE: one ConsumerConfig per subscription: nats-py fills in the one it is given
            # (deliver subject, filter), and two consumers sharing it receive each other's messages.
            return [await js.subscribe(subject, cb=self.on_event, ordered_consumer=True,
                                       config=ConsumerConfig(deliver_policy=DeliverPolicy.NEW))
                    for subject in (subjects.request_event("*", "*"), subjects.instance_event("restarted", "*"))]
        except Exception as exc:
            raise SoakError(f"cannot follow the event stream {subjects.EVENTS_STREAM} ({exc!r}); is the conductor up?") from exc

    async def on_event(self, msg) -> None:
        try:
            event = Event.from_bytes(msg.data)
        except WireError:
            return
        self.events.add(event, msg.metadata.sequence.stream if msg.metadata else None)

    async def look(self, nc) -> dict:
        """Pools, shm directory and /dev/shm now (before the run and after the drain)."""
        state = sc.read_state(self.state_path) or self.state
        pools = {n: (await sc.pool_status(nc, n))[0] for n in state.messenger_nodes()}
        shm = sc.scan_shm(self.shm_root)
        return {"slabs": {n: ({"used": p.dram_used_blocks, "capacity": p.dram_capacity_blocks} if p else None)
                          for n, p in pools.items()},
                "pool_files": {n: p.request_files for n, p in pools.items() if p is not None},
                "shm": shm, "dev_shm_used": sc.dev_shm_used(), "dev_shm_others": sc.others_shm_bytes(self.shm_root),
                "deleted_maps": sc.deleted_shm_maps(state, self.shm_root)}

    async def send_all(self, session, model: str, arrivals: list[sl.Arrival]) -> list[RequestResult]:
        args = self.args
        prompts: dict[int, list[int]] = {}  # row index -> prompt (rows repeat when the trace wraps)
        bar = None
        if not (args.no_progress or args.json):
            from tqdm import tqdm

            bar = tqdm(total=len(arrivals), unit="req", desc="soak")
        chaos = asyncio.create_task(self.chaos()) if self.kinds else None
        tasks = []
        try:
            for a in arrivals:
                delay = a.at_s - (time.perf_counter() - self.t0)
                if delay > 0:
                    await asyncio.sleep(delay)
                if a.row_index not in prompts:
                    prompts[a.row_index] = prompt_token_ids(a.row, args.tokens_per_block, args.vocab_size,
                                                            seed=args.seed, max_tokens=args.max_input)
                task = asyncio.create_task(self.send(session, model, a, prompts[a.row_index]))
                task.add_done_callback(lambda t, seq=a.seq: self.ended(seq, t, bar))
                tasks.append(task)
            if chaos is not None:
                chaos.cancel()  # no kill once the load has stopped: the drain must see a settled cluster
            return list(await asyncio.gather(*tasks))
        finally:
            if chaos is not None:
                chaos.cancel()
            if bar is not None:
                bar.close()

    async def send(self, session, model: str, a: sl.Arrival, prompt: list[int]) -> RequestResult:
        """replay.send_one; an error it does not expect (a raw OSError) is still one failed request, never a lost one."""
        try:
            return await replay.send_one(session, self.url, model, a.seq, prompt, replay.output_tokens(a.row, self.args),
                                         a.at_s, self.t0)
        except Exception as exc:
            return RequestResult(a.seq, FAILED, a.at_s, len(prompt), end_s=time.perf_counter() - self.t0,
                                 error=f"{type(exc).__name__}: {exc}"[:200])

    def ended(self, seq: int, task: asyncio.Task, bar) -> None:
        if task.cancelled() or task.exception() is not None:
            return
        self.outcomes[seq] = sv.classify(task.result())
        if bar is not None:
            bar.update(1)
            bar.set_postfix(sv.count_outcomes(self.outcomes.values()), refresh=False)

    async def sample_every_second(self) -> None:
        while True:
            self.state = sc.read_state(self.state_path) or self.state
            shm = sc.scan_shm(self.shm_root)
            self.samples.append({"t": round(time.perf_counter() - self.t0, 3), "rss": sc.rss_by_kind(self.state),
                                 "dev_shm_used": sc.dev_shm_used(), "dev_shm_others": sc.others_shm_bytes(self.shm_root),
                                 "shm_request_files": len(shm.request_files) if shm else None,
                                 "shm_request_bytes": shm.request_bytes if shm else None,
                                 "shm_slab_bytes": shm.slab_bytes if shm else None,
                                 "outcomes": sv.count_outcomes(self.outcomes.values())})
            await asyncio.sleep(1.0)

    async def chaos(self) -> None:
        while True:
            await asyncio.sleep(self.args.every)
            state = sc.read_state(self.state_path) or self.state  # pids change on every restart
            # cycle: the listed kinds in turn, so a short run kills every one of them
            kinds = self.kinds if self.args.chaos_order == "random" else [self.kinds[len(self.kills) % len(self.kinds)]]
            victim = sc.choose_victim(state, kinds, self.rng)
            killed = sc.kill(victim, time.perf_counter() - self.t0) if victim else None
            if killed:
                self.kills.append(killed)
            else:
                self.notes.append(f"chaos at {time.perf_counter() - self.t0:.0f} s: no running process of "
                                  f"{','.join(self.kinds)} to kill")

    async def probe(self, nc, before: dict) -> Probe:
        """The cluster now; request files count only if they were not there at the start."""
        state = sc.read_state(self.state_path) or self.state
        pools, errors = {}, {}
        for node in state.messenger_nodes():
            pools[node], why = await sc.pool_status(nc, node)
            if why:
                errors[node] = why
        shm, old = sc.scan_shm(self.shm_root), before["shm"]
        new_files = None if shm is None else {
            f: n for f, n in shm.request_files.items() if old is None or f not in old.request_files}
        return Probe(await sc.conductor_in_flight(nc), pools, errors, new_files, before["pool_files"])

    async def drain(self, nc, results: list[RequestResult], before: dict) -> dict:
        """Wait (up to --drain-timeout) until the cluster is idle and every request's end event came."""
        start = time.monotonic()
        ids = {r.request_id for r in results if r.request_id}
        unknown_seen: set[str] = set()
        while True:
            probe = await self.probe(nc, before)
            unknown_seen.update(probe.unknown())
            settled = ids <= self.events.terminal.keys()
            if (probe.idle() and settled) or time.monotonic() - start >= self.args.drain_timeout:
                break
            await asyncio.sleep(1.0)
        await asyncio.sleep(1.0)  # a second end event, if any, arrives right after the first
        return {"seconds": time.monotonic() - start, "idle": probe.idle(), "events_settled": settled,
                "probe": probe, "unknown_seen": sorted(unknown_seen)}

    # --- the verdict ------------------------------------------------------------------------
    def report(self, results, arrivals, load, cap, scalings, before, after, drain, restarts) -> dict:
        outcomes = [sv.classify(r) for r in results]
        twice, never = sv.exactly_once(results, outcomes, self.events.terminal)
        probe: Probe = drain["probe"]
        if not self.state.messenger_nodes():
            self.notes.append("pinned blocks and slab occupancy not checked: no messenger listed in the state file")
        if probe.new_files is None:
            self.notes.append(f"shm directory {self.shm_root or '?'} not found: request files not counted")
        shm0, shm1 = before["shm"], after["shm"]
        if shm0 is not None and shm0.request_files:
            self.notes.append(f"{len(shm0.request_files)} request KV files were in the shm directory before the run "
                              "(left by earlier ones): not counted as this run's leaks")
        slab_growth = (shm1.slab_bytes - shm0.slab_bytes) if shm0 and shm1 else 0
        dev_growth = after["dev_shm_used"] - before["dev_shm_used"]
        others_growth = after["dev_shm_others"] - before["dev_shm_others"]
        violations = (sv.request_violations(results, outcomes, twice, never)
                      + sv.leak_violations(probe, dev_growth, slab_growth, others_growth, after["deleted_maps"]))
        peak: dict[str, int] = {}
        for s in self.samples:
            for kind, rss in s["rss"].items():
                peak[kind] = max(peak.get(kind, 0), rss)
        slo = summarize(results, self.args.ttft_slo, self.args.tbt_slo) if results else {}
        violations += sv.slo_violations(slo.get("slo_attainment"), self.args.min_attainment, slo.get("ok", 0))
        latency = slo
        ours = {r.request_id for r in results if r.request_id}
        kills_by_kind: dict[str, int] = {}
        for k in self.kills:
            kills_by_kind[k.kind] = kills_by_kind.get(k.kind, 0) + 1
        return {
            "cluster": {"url": self.url, "nats_url": self.nats_url, "state_file": str(self.state_path),
                        "missing": list(self.state.missing), "model": self.state.model},
            "trace": str(self.trace), "load": load, "capacity": cap, "scalings": scalings,
            "sent": len(results), "span_s": max((r.end_s or r.arrival_s for r in results), default=0.0),
            "load_end_s": self.load_end_s,
            "outcomes": sv.count_outcomes(outcomes),
            "migrated": sum(1 for r in results if r.request_id in self.events.migrated),
            "exactly_once": {"ended_twice": twice, "never_ended": never,
                             "terminal_events": sum(len(v) for k, v in self.events.terminal.items() if k in ours)},
            "chaos": {"kinds": self.kinds, "every_s": self.args.every, "seed": self.args.seed,
                      "kills": [asdict(k) for k in self.kills], "kills_by_kind": kills_by_kind,
                      "touched": sv.touched_by_kills(self.kills, self.t0_wall, self.events, results, outcomes),
                      "restarts_by_kind": restarts, "restarted_events_by_kind": dict(self.events.restarted)},
            "rss_peak_by_kind": peak,
            "shm": {"root": self.shm_root, "before": shm0.summary() if shm0 else None,
                    "after": shm1.summary() if shm1 else None, "dev_shm_before": before["dev_shm_used"],
                    "dev_shm_after": after["dev_shm_used"], "dev_shm_growth": dev_growth, "slab_growth": slab_growth,
                    "others_growth": others_growth, "deleted_maps_after": after["deleted_maps"]},
            "slabs": {"before": before["slabs"], "after": after["slabs"]},
            "drain": drain | {"probe": probe.to_json()},
            "latency": {k: latency.get(k) for k in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "tbt_p50_s", "tbt_p90_s")},
            "slo": {k: slo.get(k) for k in ("ttft_slo_s", "tbt_slo_s", "meets_slo", "slo_attainment", "goodput_rps",
                                            "goodput_per_min", "rejections")} | {"min_attainment": self.args.min_attainment},
            "machine_cpu": self.cpu_during_load,
            "timeline": self.samples, "notes": self.notes,
            "violations": [str(v) for v in violations], "exit_code": sv.exit_code(violations),
            "requests": [{"seq": a.seq, "row": a.row_index, "request_id": r.request_id, "outcome": o.kind,
                          "reason": o.reason, "migrated": r.request_id in self.events.migrated,
                          "http_status": r.http_status, "output_tokens": r.output_tokens, "arrival_s": r.arrival_s,
                          "end_s": r.end_s, "ttft_s": r.ttft_s}
                         for a, r, o in zip(arrivals, results, outcomes)],
        }


def _diff(end: dict[str, int], start: dict[str, int]) -> dict[str, int]:
    return {k: end.get(k, 0) - start.get(k, 0) for k in sorted(set(end) | set(start)) if end.get(k, 0) != start.get(k, 0)}
