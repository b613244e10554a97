"""`moonbus sim`: simulate a cluster on a trace with the live scheduling, admission and eviction code.

Prints the summary (tools.moonbus.traces.measures), every scaling applied and the simulation speed; --json
prints one JSON object instead; --out DIR writes results.jsonl and summary.json there; --plot
writes the TTFT/TBT CDFs and the load-over-time PNG to --out (default: the current directory).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import orjson

from tools.moonbus.traces.measures import format_summary
from tools.moonbus.traces.rows import TRACE_BLOCK_TOKENS, add_trace_arguments, load_trace
from common.decide.admission import MODES
from common.decide.policy import POLICIES
from tools.sim import SimConfig, build_profile, simulate


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_trace_arguments(parser)
    parser.add_argument("--prefill", type=int, default=8, metavar="N", help="prefill instances (default 8)")
    parser.add_argument("--decode", type=int, default=8, metavar="M", help="decode instances (default 8)")
    parser.add_argument("--coupled", type=int, default=0, metavar="K",
                        help="instead: K coupled instances that each prefill and decode (vLLM-like)")
    parser.add_argument("--policy", choices=POLICIES, default="kvcache-centric")
    parser.add_argument("--admission", choices=MODES, default="baseline")
    parser.add_argument("--speed", type=float, default=1.0, help="divide trace timestamps by this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-profile", type=Path, default=None, metavar="FILE", help="a `moonbus profile` file")
    parser.add_argument("--model", default="llama3-70b", help="analytic preset (default llama3-70b)")
    parser.add_argument("--gpu", default="8xa800", help="hardware preset (default 8xa800)")
    parser.add_argument("--dram-tokens", type=int, default=3_000_000, metavar="T", help="KV cache per prefill node")
    parser.add_argument("--eviction", default="lru", help="lru, lfu or length-aware")
    parser.add_argument("--ttft-slo", type=float, default=30.0, metavar="S")
    parser.add_argument("--tbt-slo", type=float, default=0.1, metavar="S")
    parser.add_argument("--max-output", type=int, default=None, metavar="N", help="cap output lengths at N")
    parser.add_argument("--force-output", action="store_true", help="with --max-output: every output is exactly N")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--out", type=Path, default=None, metavar="DIR")
    parser.add_argument("--plot", action="store_true")


def config_from_args(args: argparse.Namespace) -> SimConfig:
    profile, extras = build_profile(args.model, args.gpu, args.model_profile)
    return SimConfig(prefill=args.prefill, decode=args.decode, coupled=args.coupled, policy=args.policy,
                     admission=args.admission, speed=args.speed, seed=args.seed, ttft_slo_s=args.ttft_slo,
                     tbt_slo_s=args.tbt_slo, dram_tokens=args.dram_tokens, eviction=args.eviction,
                     max_output=args.max_output, force_output=args.force_output, profile=profile, **extras)


def scalings(args: argparse.Namespace, cfg: SimConfig, rows: int) -> list[str]:
    out = [f"{rows} trace rows" + (f" (--limit {args.limit})" if args.limit is not None else " (whole trace)"),
           f"time / {cfg.speed:g}", f"one KV block = one trace hash id = {TRACE_BLOCK_TOKENS} tokens (unscaled)"]
    if cfg.max_output is not None:
        out.append(("outputs forced to " if cfg.force_output else "outputs capped at ") + str(cfg.max_output))
    return out


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    rows = load_trace(args.trace, args.limit)
    outcome = simulate(rows, cfg)
    shape = f"{cfg.coupled} coupled" if cfg.coupled else f"{cfg.prefill}P+{cfg.decode}D"
    setting = (f"{shape}, policy {cfg.policy}, admission {cfg.admission}, "
               f"{cfg.profile.model or 'profile'} on {cfg.profile.device or '?'}, DRAM {cfg.dram_tokens} tokens/node, seed {cfg.seed}")
    st = outcome.stats
    report = {"trace": str(args.trace), "setting": setting, "scalings": scalings(args, cfg, len(rows)),
              "summary": outcome.summary, "stats": st}
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / "results.jsonl", "wb") as f:
            for r in outcome.results:
                f.write(orjson.dumps(r.to_json()) + b"\n")
        (args.out / "summary.json").write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    if args.plot:
        from tools.moonbus.traces.plots import plot_all

        plot_all(outcome.results, args.out or Path("."), shape, (cfg.ttft_slo_s, cfg.tbt_slo_s))
    if args.json:
        sys.stdout.write(orjson.dumps(report).decode() + "\n")
        return 0
    print(f"sim {args.trace}: {setting}")
    print("scalings: " + "; ".join(report["scalings"]))
    print(format_summary(outcome.summary))
    print(f"pulls {st['pulls']} ({st['pulled_blocks']} blocks); simulated {st['simulated_s']:.1f}s in "
          f"{st['wall_s']:.2f}s wall = {st['sim_s_per_wall_s']:.0f} simulated s per wall s")
    return 0
