"""`moonbus sim`: simulate a cluster on a trace with the live scheduling, admission and eviction code.

Prints the summary (tools.moonbus.traces.measures), every scaling applied and the simulation speed; --json
prints one JSON object instead; --out DIR writes results.jsonl and summary.json there; --plot
writes the TTFT/TBT CDFs and the load-over-time PNG to --out (default: the current directory).

--rate-curve day scales the trace's arrival rate by a day (tools/sim/autoscale.py: day_curve;
the trace is repeated as the day needs). --autoscale lets the planner (common/decide/planner.py)
set the instance counts, starting from --prefill/--decode within --min/--max-prefill/decode, then
searches the fixed splits within the same bounds for the cheapest whose attainment (all requests,
rejections count as misses) reaches --goal, and prints both with their instance-hours and ratio.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import orjson

from tools.moonbus.traces.measures import format_summary
from tools.moonbus.traces.rows import TRACE_BLOCK_TOKENS, add_trace_arguments, load_trace
from common.decide.admission import MODES
from common.decide.planner import PlannerSettings
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
    parser.add_argument("--rate-curve", choices=("flat", "day"), default="flat",
                        help="day: the arrival rate follows a day (trough at 4:00, peak at 16:00), the trace repeated")
    parser.add_argument("--day-s", type=float, default=3600.0, metavar="S", help="simulated seconds of the day (default 3600)")
    parser.add_argument("--rate-peak", type=float, default=8.0, metavar="X", help="the day's peak, times the trace's rate")
    parser.add_argument("--rate-trough", type=float, default=1.0, metavar="X", help="the day's trough, times the trace's rate")
    parser.add_argument("--autoscale", action="store_true",
                        help="the planner sets the instance counts; then the cheapest fixed split is searched")
    parser.add_argument("--min-prefill", type=int, default=6, metavar="N")
    parser.add_argument("--max-prefill", type=int, default=56, metavar="N")
    parser.add_argument("--min-decode", type=int, default=2, metavar="N")
    parser.add_argument("--max-decode", type=int, default=8, metavar="N")
    parser.add_argument("--plan-every", type=float, default=30.0, metavar="S", help="the planner's interval")
    parser.add_argument("--startup", type=float, default=60.0, metavar="S", help="seconds before a new instance serves")
    parser.add_argument("--attainment-goal", type=float, default=0.95,
                        help="the planner's SLO attainment goal (PlannerSettings.attainment_goal)")
    parser.add_argument("--goal", type=float, default=0.9, help="the attainment a fixed split must reach")
    parser.add_argument("--goal-window", type=float, default=None, metavar="S",
                        help="and, in the second search, in every S seconds of arrivals (default: --day-s / 24, an hour of the day)")
    parser.add_argument("--no-fixed-search", action="store_true", help="with --autoscale: the planner's run only")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--out", type=Path, default=None, metavar="DIR")
    parser.add_argument("--plot", action="store_true")


def config_from_args(args: argparse.Namespace) -> SimConfig:
    profile, extras = build_profile(args.model, args.gpu, args.model_profile)
    return SimConfig(prefill=args.prefill, decode=args.decode, coupled=args.coupled, policy=args.policy,
                     admission=args.admission, speed=args.speed, seed=args.seed, ttft_slo_s=args.ttft_slo,
                     tbt_slo_s=args.tbt_slo, dram_tokens=args.dram_tokens, eviction=args.eviction,
                     max_output=args.max_output, force_output=args.force_output, startup_s=args.startup,
                     profile=profile, **extras)


def planner_settings(args: argparse.Namespace) -> PlannerSettings:
    return PlannerSettings(min_prefill=args.min_prefill, max_prefill=args.max_prefill, min_decode=args.min_decode,
                           max_decode=args.max_decode, max_total=args.max_prefill + args.max_decode,
                           interval_s=args.plan_every, attainment_goal=args.attainment_goal)


def trace_rows(args: argparse.Namespace) -> list:
    rows = load_trace(args.trace, args.limit)
    if args.rate_curve == "day":
        from tools.sim.autoscale import day_curve

        rows = day_curve(rows, args.day_s, args.rate_peak, args.rate_trough)
    return rows


def scalings(args: argparse.Namespace, cfg: SimConfig, rows: int) -> list[str]:
    out = [f"{rows} trace rows" + (f" (--limit {args.limit})" if args.limit is not None else " (whole trace)"),
           f"time / {cfg.speed:g}", f"one KV block = one trace hash id = {TRACE_BLOCK_TOKENS} tokens (unscaled)"]
    if cfg.max_output is not None:
        out.append(("outputs forced to " if cfg.force_output else "outputs capped at ") + str(cfg.max_output))
    if args.rate_curve == "day":
        out.append(f"rate x{args.rate_trough:g} (4:00) to x{args.rate_peak:g} (16:00) over a day of {args.day_s:g}s, "
                   "the trace repeated (hash ids moved per copy)")
    return out


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    rows = trace_rows(args)
    if args.autoscale:
        return run_autoscale(args, cfg, rows)
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


def run_autoscale(args: argparse.Namespace, cfg: SimConfig, rows: list) -> int:
    """The planner's run, the fixed-split search, and both side by side."""
    from tools.sim.autoscale import compare

    settings = planner_settings(args)
    quiet = args.json

    def told(split, numbers):
        if quiet:
            return
        if numbers["stopped"]:
            where = "overall" if numbers["stopped_for"] is None else f"in some {numbers['stopped_for']:g} s"
            print(f"  fixed {split[0]}P{split[1]}D: stopped, attainment below {args.goal:g} {where}", flush=True)
        else:
            print(f"  fixed {split[0]}P{split[1]}D: attainment {numbers['attainment']:.3f} (worst window "
                  f"{numbers['worst_window']:.3f}), {numbers['instance_hours']:.2f} instance-hours", flush=True)

    if not quiet:
        print(f"sim {args.trace}: autoscaled, policy {cfg.policy}, admission {cfg.admission}, SLOs TTFT "
              f"{cfg.ttft_slo_s:g}s TBT {cfg.tbt_slo_s:g}s; prefill {settings.min_prefill}..{settings.max_prefill}, "
              f"decode {settings.min_decode}..{settings.max_decode}, plan every {settings.interval_s:g}s, "
              f"startup {cfg.startup_s:g}s")
        print("scalings: " + "; ".join(scalings(args, cfg, len(rows))), flush=True)
    window = args.goal_window or args.day_s / 24
    result = compare(rows, cfg, settings, args.goal, window, on_run=told, search=not args.no_fixed_search)
    auto = result.planner.stats["autoscale"]
    if args.json:
        sys.stdout.write(orjson.dumps({
            "trace": str(args.trace), "scalings": scalings(args, cfg, len(rows)), "goal": args.goal,
            "planner": {"summary": result.planner.summary, "instance_hours": result.planner_hours,
                        "by_role": auto["instance_hours_by_role"], "plans": auto["plans"]},
            "planner_worst_window": result.planner_worst_window, "window_s": window,
            "searches": [{"criterion": s.criterion, "best": list(s.best) if s.best else None,
                          "ratio": result.ratio(s),
                          "runs": [{"prefill": p, "decode": d, **n} for (p, d), n in s.runs.items()]}
                         for s in result.searches],
        }).decode() + "\n")
        return 0
    print(format_summary(result.planner.summary, "planner"))
    print(f"planner: {len(auto['plans'])} changes, peak {result.peak('prefill')}P + {result.peak('decode')}D, "
          f"instance-hours prefill {auto['instance_hours_by_role']['prefill']:.2f} + decode "
          f"{auto['instance_hours_by_role']['decode']:.2f}")
    for line in result.lines():
        print(line)
    return 0
