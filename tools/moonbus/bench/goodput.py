"""`moonbus bench goodput`: the admission modes side by side on a live cluster, one run each.

Every mode (none, baseline, early, predictive; `--modes`) gets a fresh local cluster as `moonbus
up` starts it (tools/moonbus/bench/vllm_servers.MoonbusServer: SmolLM2, 1 prefill + 1 decode,
the SLOs given) and the same load: the trace's first --rows rows, token lengths scaled by
--tokens-per-block / 512, at --speed, streaming completions of --max-tokens with ignore_eos, sent
open loop by the replay client (tools/moonbus/bench/vllm_load). Per mode: completed, rejected
(by reason), failed, SLO attainment, goodput, TTFT and TBT percentiles, and the cluster's CPU use
(its process trees, psutil). The design's promise: predictive keeps attainment high while it
rejects the least, and its goodput beats admission none's (goal >= 1.5x on a trace at about 2x
capacity); printed, not asserted. Also per mode, from the run's events: the actual TTFT over the
conductor's prediction at routing (median, per prefill instance, share within 20%).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import orjson

from common import models
from common.audit import Stored
from common.decide.admission import MODES
from tools.moonbus.traces.measures import summarize
from tools.moonbus.bench import vllm_report
from tools.moonbus.bench.vllm import add_load_arguments, make_plan, say
from tools.moonbus.bench.vllm_load import run_plan
from tools.moonbus.bench.vllm_servers import (
    CpuMeter, MoonbusServer, ServerError, cache_dir, ensure_profile, moonbus_spec,
)
from tools.moonbus.observe.audit import read_stream

GOODPUT_GOAL = 1.5  # predictive's goodput over admission none's


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_load_arguments(parser)
    parser.add_argument("--modes", default=",".join(MODES), help=f"admission modes, in order (default {','.join(MODES)})")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - set(MODES):
        print(f"moonbus bench goodput: --modes must be among {', '.join(MODES)}", file=sys.stderr)
        return 2
    plan_args = argparse.Namespace(**vars(args), prefill_tokens=1, engine_repeats=0, decode_batches="",
                                   decode_prompt_tokens=1, decode_tokens=2)
    plan, said = make_plan(plan_args)
    dtype = models.resolve_dtype(args.dtype)
    cores = len(os.sched_getaffinity(0))
    work = Path(tempfile.mkdtemp(prefix="moonbus-bench-goodput-"))
    result = {"trace_rows": len(plan.trace_prompts), "scalings": said, "dtype": dtype, "cores": cores,
              "ttft_slo_s": args.ttft_slo, "tbt_slo_s": args.tbt_slo, "modes": {}}
    try:
        home = work / "home"
        ref = models.prepare(models.SMOLLM2, home)
        for mode in modes:
            spec = moonbus_spec(work / mode, args.prefill, args.decode, dtype, args.ttft_slo, args.tbt_slo)
            spec.admission = mode
            spec.profile = str(ensure_profile(home, ref.name, dtype, spec, cache_dir(), say))
            try:
                result["modes"][mode] = measure(MoonbusServer(mode, spec), plan, args, cores)
            except ServerError as exc:
                result["modes"][mode] = {"error": str(exc)}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["ratios"] = ratios(result["modes"])
    if args.json:
        sys.stdout.write(orjson.dumps(result).decode() + "\n")
    else:
        print(format_report(result))
    return 0 if all("serve" in m for m in result["modes"].values()) else 1


def measure(server: MoonbusServer, plan, args: argparse.Namespace, cores: int) -> dict:
    say(f"admission {server.name}: starting the cluster ...")
    started = time.perf_counter()
    server.start(args.start_timeout)
    try:
        raw = run_plan(server.url, plan, CpuMeter(server.pids()))
        stored = asyncio.run(read_stream(server.spec.nats_url, None, None)).records  # the run's events
    finally:
        server.stop()
    summary = summarize(raw["trace"], args.ttft_slo, args.tbt_slo)
    row = vllm_report.serve_row(summary, raw["trace"], raw["cpu_s"], raw["wall_s"], cores)
    events = events_of(stored)
    return {"start_s": time.perf_counter() - started, "serve": row, "rejections": summary["rejections"],
            "tbt_p90_s": summary["tbt_p90_s"], "goodput_per_min": summary["goodput_per_min"],
            "ttft_prediction": ttft_prediction(events), "disturbances": disturbances(events)}


def disturbances(events: list[dict]) -> dict:
    """What should not happen to a cluster whose processes all live: instances declared lost, and
    requests migrated or re-dispatched (their work done twice)."""
    kinds = [e["kind"] for e in events]
    return {"lost": kinds.count("lost"), "migrated": kinds.count("migrated"),
            "redispatched": sum(1 for e in events if e["kind"] == "routed" and e["data"].get("attempt"))}


def events_of(stored: list[Stored]) -> list[dict]:
    """The stream's events as dicts (a sealed event's digest is one more member)."""
    return [orjson.loads(r.payload) for r in stored]


def ttft_prediction(events: list[dict]) -> dict:
    """How the conductor's predicted TTFT compared with the actual, for first attempts: the median
    of actual / predicted, overall and per prefill instance, and the share within 20%."""
    prefill_of = {e["request_id"]: e["data"].get("prefill_id") for e in events
                  if e["kind"] == "routed" and e["data"].get("admitted") and not e["data"].get("attempt")}
    ratios: dict[str, list[float]] = {}
    for e in events:
        d = e["data"]
        if e["kind"] == "first_token" and not d.get("attempt") and d.get("predicted_ttft_s", 0) > 0:
            ratios.setdefault(prefill_of.get(e["request_id"]) or "?", []).append(d["ttft_s"] / d["predicted_ttft_s"])
    every = [r for rs in ratios.values() for r in rs]
    if not every:
        return {"requests": 0, "median": None, "within_20pct": None, "per_instance": {}}
    return {"requests": len(every), "median": statistics.median(every),
            "within_20pct": sum(abs(r - 1.0) <= 0.2 for r in every) / len(every),
            "per_instance": {i: statistics.median(rs) for i, rs in sorted(ratios.items())}}


def ratios(modes: dict) -> dict:
    """Each mode's goodput over admission none's."""
    base = modes.get("none", {}).get("serve")
    if not base or not base["goodput_rps"]:
        return {}
    return {m: r["serve"]["goodput_rps"] / base["goodput_rps"] for m, r in modes.items() if "serve" in r}


def format_report(result: dict) -> str:
    lines = [f"moonbus bench goodput: {result['trace_rows']} rows; " + "; ".join(result["scalings"]),
             f"SLOs ttft {result['ttft_slo_s']:g} s, tbt {result['tbt_slo_s']:g} s; {result['dtype']}; {result['cores']} cores",
             f"{'admission':<11} {'done':>5} {'429':>5} {'fail':>5} {'in SLO':>7} {'attain':>7} {'goodput/min':>11} "
             f"{'TTFT p50':>9} {'p90':>7} {'TBT p90':>8} {'CPU':>5} {'vs none':>8}"]
    for mode, r in result["modes"].items():
        if "serve" not in r:
            lines.append(f"{mode:<11} error: {r.get('error')}")
            continue
        s = r["serve"]
        ratio = result["ratios"].get(mode)
        lines.append(f"{mode:<11} {s['completed']:>5} {s['rejected']:>5} {s['failed']:>5} {s['within_slo']:>7} "
                     f"{s['slo_attainment']:>7.1%} {r['goodput_per_min']:>11.1f} {_s(s['ttft_p50_s']):>9} "
                     f"{_s(s['ttft_p90_s']):>7} {_s(r['tbt_p90_s']):>8} {s['cpu_use']:>5.0%} "
                     f"{'' if ratio is None else f'{ratio:.2f}x':>8}")
    for mode, r in result["modes"].items():
        t = r.get("ttft_prediction") or {}
        if t.get("requests"):
            per = ", ".join(f"{i} {m:.2f}" for i, m in t["per_instance"].items())
            lines.append(f"  {mode} TTFT actual / predicted: median {t['median']:.2f} ({per}), "
                         f"{t['within_20pct']:.0%} within 20%, {t['requests']} first attempts")
    for mode, r in result["modes"].items():
        if r.get("disturbances"):
            d = r["disturbances"]
            lines.append(f"  {mode}: {d['lost']} instances declared lost, {d['migrated']} migrations, "
                         f"{d['redispatched']} routes of a later attempt")
    for mode, r in result["modes"].items():
        if r.get("rejections"):
            lines.append(f"  {mode} rejections: " + ", ".join(f"{k} {v}" for k, v in r["rejections"].items()))
    if "predictive" in result["ratios"]:
        met = result["ratios"]["predictive"] >= GOODPUT_GOAL
        lines.append(f"goal: predictive >= {GOODPUT_GOAL}x none's goodput: {'met' if met else 'NOT met'}")
    return "\n".join(lines)


def summary(result: dict) -> list[dict]:
    """`make bench`'s rows of this target."""
    rows = []
    for mode, r in result["modes"].items():
        if "serve" in r:
            ratio = result["ratios"].get(mode)
            rows.append({"row": f"goodput, admission {mode} (attainment {r['serve']['slo_attainment']:.0%})",
                         "ours": f"{r['goodput_per_min']:.1f}/min", "baseline": "admission none", "ratio": ratio,
                         "goal": f">= {GOODPUT_GOAL}x" if mode == "predictive" else None,
                         "met": None if mode != "predictive" or ratio is None else ratio >= GOODPUT_GOAL})
    return rows


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.2f}s"
