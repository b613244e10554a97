"""The simulated experiments (1-5, 7). Each runs `tools.sim.simulate` and writes a table and a PNG.

Every setting that differs from `moonbus sim`'s defaults is written into the table file, with the
equivalent `moonbus sim` command line, so each number can be reproduced one run at a time.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from tools.moonbus.traces.measures import effective_capacity  # noqa: E402
from tools.moonbus.traces.rows import load_trace  # noqa: E402
from tools.moonbus.traces.plots import plot_load  # noqa: E402
from tools.sim import SimConfig, build_profile, simulate  # noqa: E402

PROFILE, EXTRAS = build_profile("llama3-70b", "8xa800")
BASE = SimConfig(profile=PROFILE, **EXTRAS)  # LLaMA3-70B on 8xA800, 3M DRAM tokens/node, SLOs 30 s / 0.1 s


def _rows(args: argparse.Namespace, name: str):
    return load_trace(args.traces / f"{name}_trace.jsonl", args.limit)


def _write(out: Path, stem: str, title: str, settings: list[str], header: list[str], table: list[list], fig) -> Path:
    fig.tight_layout()
    fig.savefig(out / f"{stem}.png", dpi=110)
    plt.close(fig)
    lines = [f"# {title}", "", *[f"- {s}" for s in settings], "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in table]
    lines += ["", f"![{title}]({stem}.png)", ""]
    path = out / f"{stem}.md"
    path.write_text("\n".join(lines))
    return path


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.3f}"
    return str(v)


def _limit_note(args) -> list[str]:
    return [f"trace cut to its first {args.limit} rows (--limit)"] if args.limit else ["whole trace"]


def policies(args: argparse.Namespace) -> Path:
    """1. Average and p90 TTFT per scheduling policy, conversation trace, 8P+8D."""
    rows = _rows(args, "conversation")
    table = []
    for policy in ("random", "load-balancing", "cache-aware", "kvcache-centric"):
        s = simulate(rows, replace(BASE, policy=policy, admission="none")).summary
        table.append([policy, s["ttft_mean_s"], s["ttft_p90_s"], s["cache_hit_ratio"]])
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = range(len(table))
    ax.bar([x - 0.2 for x in xs], [r[1] for r in table], 0.4, label="average TTFT")
    ax.bar([x + 0.2 for x in xs], [r[2] for r in table], 0.4, label="p90 TTFT")
    ax.set_xticks(list(xs), [r[0] for r in table])
    ax.set_ylabel("seconds")
    ax.set_title("TTFT by scheduling policy (conversation trace, 8P+8D, LLaMA3-70B / 8xA800)")
    ax.legend()
    return _write(args.out, "1_policies", "Scheduling policies", [
        *_limit_note(args), "8 prefill + 8 decode, LLaMA3-70B on 8xA800 (analytic), 3M DRAM tokens per prefill node",
        "admission none (every request is served, so the policies see the same load), speed 1, seed 0",
        "command: moonbus sim --trace conversation_trace.jsonl --prefill 8 --decode 8 --admission none --policy P"],
        ["policy", "avg TTFT (s)", "p90 TTFT (s)", "cache hit ratio"], table, fig)


def cache_scope(args: argparse.Namespace) -> Path:
    """2. Local vs global cache: 10 prefill nodes, 3M tokens of DRAM each, outputs forced to 1."""
    table = []
    for trace in ("conversation", "synthetic"):
        rows = _rows(args, trace)
        for scope, policy in (("local", "cache-aware"), ("global", "kvcache-centric")):
            cfg = replace(BASE, prefill=10, decode=1, policy=policy, admission="none", max_output=1,
                          force_output=True, dram_tokens=3_000_000)
            out = simulate(rows, cfg)
            table.append([trace, scope, out.summary["cache_hit_ratio"], out.stats["prefill_mean_s"],
                          out.summary["ttft_mean_s"], out.stats["pulls"]])
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8))
    for ax, col, label in ((axes[0], 2, "cache hit ratio"), (axes[1], 3, "average prefill time (s)")):
        for k, trace in enumerate(("conversation", "synthetic")):
            vals = [r[col] for r in table if r[0] == trace]
            ax.bar([k - 0.2, k + 0.2], vals, 0.4, color=["tab:orange", "tab:blue"])
        ax.set_xticks([0, 1], ["conversation", "synthetic"])
        ax.set_title(label + "  (orange local, blue global)", fontsize=9)
    return _write(args.out, "2_cache_scope", "Local vs global cache", [
        *_limit_note(args), "10 prefill nodes, 3M tokens (5,859 blocks of 512) of DRAM cache each, LRU, no SSD tier",
        "outputs forced to 1 token (prefill only); admission none; LLaMA3-70B on 8xA800",
        "local = policy cache-aware (a node reuses only its own cache); global = kvcache-centric (pulls from the pool)",
        "command: moonbus sim --trace T --prefill 10 --decode 1 --max-output 1 --force-output --admission none "
        "--dram-tokens 3000000 --policy cache-aware|kvcache-centric"],
        ["trace", "cache", "hit ratio", "avg prefill (s)", "avg TTFT (s)", "pulls"], table, fig)


def overload(args: argparse.Namespace) -> Path:
    """3. Overload: conversation trace at 2x, 8P+8D, every admission mode."""
    rows = _rows(args, "conversation")
    table, runs = [], {}
    for mode in ("baseline", "early", "predictive"):
        cfg = replace(BASE, speed=2.0, admission=mode, tbt_slo_s=0.0125)
        out = simulate(rows, cfg)
        s = out.summary
        table.append([mode, s["rejected_arrival"], s["rejected_late"], s["goodput_rps"], s["effective_capacity"]])
        runs[f"admission {mode}"] = out.results
    plot_load(runs, args.out / "3_overload.png", step_s=5.0)
    settings = [*_limit_note(args), "speed 2 (timestamps / 2), 8 prefill + 8 decode, kvcache-centric, LLaMA3-70B on 8xA800",
                "SLOs: TTFT 30 s, TBT 12.5 ms (the decode step floor is 11.0 ms, reading the weights: this SLO makes "
                "decode the binding stage at 2x; with 100 ms nothing is rejected late)",
                "predictive admission: each request's remaining output from common/decide/outputs.py (the trace's output lengths through the live estimator), times the learned step time",
                "command: moonbus sim --trace conversation_trace.jsonl --speed 2 --tbt-slo 0.0125 --admission MODE --plot"]
    lines = ["# Overload admission", "", *[f"- {s}" for s in settings], "",
             "| admission | rejected at arrival | rejected late | goodput (req/s) | effective capacity |", "|---|---|---|---|---|"]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in table]
    lines += ["", "![Prefill and decode load over time](3_overload.png)", ""]
    md = args.out / "3_overload.md"
    md.write_text("\n".join(lines))
    return md


def pd_ratio(args: argparse.Namespace) -> Path:
    """4. P/D ratio sweep on the synthetic trace, 16 nodes."""
    rows = _rows(args, "synthetic")
    table = []
    for p in range(4, 13):
        s = simulate(rows, replace(BASE, prefill=p, decode=16 - p, speed=SYNTH_SPEED, admission="baseline", tbt_slo_s=SYNTH_TBT)).summary
        table.append([f"{p}P{16 - p}D", s["effective_capacity"], s["ttft_p90_s"], s["tbt_p90_s"],
                      s["rejected_arrival"], s["rejected_late"]])
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r[0] for r in table], [r[1] for r in table], marker="o")
    ax.set_ylabel("effective request capacity")
    ax.set_title(f"P/D ratio, synthetic trace x{SYNTH_SPEED:g}, 16 nodes")
    ax.grid(alpha=0.3)
    return _write(args.out, "4_pd_ratio", "P/D ratio sweep", [
        *_limit_note(args), f"synthetic trace at speed {SYNTH_SPEED:g}, 16 nodes split nP + (16-n)D, kvcache-centric, baseline admission",
        f"SLOs: TTFT 30 s, TBT {SYNTH_TBT:g} s; LLaMA3-70B on 8xA800",
        f"command: moonbus sim --trace synthetic_trace.jsonl --speed {SYNTH_SPEED:g} --prefill n --decode 16-n --tbt-slo {SYNTH_TBT:g}"],
        ["split", "effective capacity", "p90 TTFT (s)", "p90 TBT (s)", "rejected at arrival", "rejected late"], table, fig)


SYNTH_SPEED = 4.0
SYNTH_TBT = 0.03
TBT_THRESHOLDS = [0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5]


def coupled(args: argparse.Namespace) -> Path:
    """5. Disaggregated 8P+8D vs 16 coupled instances: effective capacity against the TBT threshold."""
    rows = _rows(args, "conversation")
    dis = simulate(rows, replace(BASE, admission="none")).results
    cpl = simulate(rows, replace(BASE, coupled=16, admission="none")).results
    table = [[f"{t:g}", effective_capacity(dis, 30.0, t), effective_capacity(cpl, 30.0, t)] for t in TBT_THRESHOLDS]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(TBT_THRESHOLDS, [r[1] for r in table], marker="o", label="disaggregated 8P+8D")
    ax.plot(TBT_THRESHOLDS, [r[2] for r in table], marker="s", label="coupled x16 (vLLM-like)")
    ax.set_xscale("log")
    ax.set_xlabel("TBT threshold (s)")
    ax.set_ylabel("effective request capacity")
    ax.set_title("Disaggregated vs coupled, conversation trace, 16 nodes")
    ax.grid(alpha=0.3)
    ax.legend()
    return _write(args.out, "5_coupled", "Disaggregated vs coupled", [
        *_limit_note(args), "16 nodes: 8 prefill + 8 decode vs 16 coupled instances (a prefill pauses the batch; no chunked prefill)",
        "kvcache-centric routing for both (coupled: decode on the prefill's own instance), admission none, speed 1",
        "effective capacity computed after the run for each TBT threshold, TTFT threshold 30 s",
        "command: moonbus sim --trace conversation_trace.jsonl --admission none [--coupled 16] --out DIR"],
        ["TBT threshold (s)", "disaggregated", "coupled"], table, fig)


DAY_S = 3600.0  # experiment 7: one day, in simulated seconds
DAY_PEAK, DAY_TROUGH = 8.0, 1.0  # the day's rate at 16:00 and 4:00, times the conversation trace's
GOAL = 0.9
TOLD_GOAL = 0.92  # the second planner run's attainment goal: the criterion's, with a margin


def autoscale(args: argparse.Namespace) -> Path:
    """7. The planner against the cheapest fixed splits on a day-shaped conversation trace."""
    from common.decide.planner import PlannerSettings
    from tools.sim.autoscale import compare, day_curve, day_rate, window_attainment

    trace = _rows(args, "conversation")
    rows = day_curve(trace, DAY_S, DAY_PEAK, DAY_TROUGH)
    settings = PlannerSettings(min_prefill=6, max_prefill=56, min_decode=2, max_decode=8, max_total=64)
    hour = DAY_S / 24
    result = compare(rows, BASE, settings, GOAL, hour)
    planner, (overall, hourly) = result.planner, result.searches
    told = simulate(rows, replace(BASE, autoscale=replace(settings, attainment_goal=TOLD_GOAL)))
    told_result = replace(result, planner=told)
    auto = planner.stats["autoscale"]
    timeline = auto["timeline"]
    hours = [row["at"] / hour for row in timeline]
    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    ax = axes[0]
    windows = [row for row in timeline if row["arrivals_per_s"] is not None]
    ax.plot([(row["at"] - settings.interval_s / 2) / hour for row in windows],
            [row["arrivals_per_s"] for row in windows], lw=1, label="arrivals (per planner window)")
    base_rate = len(trace) / max(1e-9, (trace[-1].timestamp_ms - trace[0].timestamp_ms) / 1000)
    curve_h = [h / 10 for h in range(0, 241)]
    ax.plot(curve_h, [base_rate * day_rate(h, DAY_PEAK, DAY_TROUGH) for h in curve_h], "k--", lw=1,
            label="the day's rate")
    ax.set_ylabel("requests / s")
    ax.legend(fontsize=8)
    ax.set_title(f"Planner vs fixed splits, conversation trace x{DAY_TROUGH:g}..x{DAY_PEAK:g} over a day of {DAY_S:g} s")
    ax = axes[1]
    for role, color in (("prefill", "tab:blue"), ("decode", "tab:orange")):
        ax.step(hours, [row[role] for row in timeline], where="post", color=color, label=f"planner: {role} serving")
        ax.step(hours, [row[f"{role}_target"] for row in timeline], where="post", color=color, ls=":", lw=1,
                label=f"planner: {role} target")
    told_timeline = told.stats["autoscale"]["timeline"]
    ax.step([row["at"] / hour for row in told_timeline], [row["prefill"] for row in told_timeline], where="post",
            color="tab:green", lw=1, label=f"planner (goal {TOLD_GOAL:g}): prefill serving")
    for search, style in ((overall, "--"), (hourly, "-.")):
        if search.best is not None:
            ax.axhline(search.best[0], color="tab:blue", ls=style, lw=1,
                       label=f"fixed, {_criterion(search)}: {search.best[0]} prefill")
            ax.axhline(search.best[1], color="tab:orange", ls=style, lw=1,
                       label=f"fixed, {_criterion(search)}: {search.best[1]} decode")
    ax.set_ylabel("instances")
    ax.legend(fontsize=6.5, ncol=2)
    ax = axes[2]
    runs = [("planner", planner.results, "tab:blue"), (f"planner (goal {TOLD_GOAL:g})", told.results, "tab:green")]
    runs += [(f"fixed {s.best[0]}P{s.best[1]}D ({_criterion(s)})", s.outcome.results, color)
             for s, color in ((overall, "tab:gray"), (hourly, "tab:red")) if s.best is not None]
    for label, results, color in runs:
        points = window_attainment(results, BASE.ttft_slo_s, BASE.tbt_slo_s, hour)
        ax.plot([(start + hour / 2) / hour for start, _ in points], [a for _, a in points], marker=".", lw=1,
                color=color, label=label)
    ax.axhline(GOAL, color="gray", ls=":", lw=1)
    ax.set_ylabel("attainment per hour of arrivals")
    ax.set_xlabel("hour of the simulated day")
    ax.set_xticks(range(0, 25, 4))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out / "7_autoscale.png", dpi=110)
    plt.close(fig)
    low_p = min((row["prefill"] for row in timeline), default=0)
    low_d = min((row["decode"] for row in timeline), default=0)
    table = [["planner", result.planner_attainment, result.planner_worst_window, f"{result.planner_hours:.2f}",
              f"{low_p}..{result.peak('prefill')}", f"{low_d}..{result.peak('decode')}",
              f"{len(auto['plans'])} changes"]]
    told_tl = told.stats["autoscale"]["timeline"]
    table.append([f"planner, goal {TOLD_GOAL:g}", told_result.planner_attainment, told_result.planner_worst_window,
                  f"{told_result.planner_hours:.2f}", f"{min(r['prefill'] for r in told_tl)}..{told_result.peak('prefill')}",
                  f"{min(r['decode'] for r in told_tl)}..{told_result.peak('decode')}",
                  f"{len(told.stats['autoscale']['plans'])} changes"])
    seen = {}
    for search in (overall, hourly):
        for split, n in search.runs.items():
            seen[split] = n
    for (p, d), n in seen.items():
        notes = [f"cheapest {_criterion(s)}" for s in (overall, hourly) if s.best == (p, d)]
        if n["stopped"]:  # what it reached before it stopped is neither its attainment nor its hours
            where = "overall" if n["stopped_for"] is None else "in an hour"
            table.append([f"fixed {p}P{d}D", "-", "-", "-", p, d, f"stopped: below {GOAL:g} {where}"])
            continue
        table.append([f"fixed {p}P{d}D", n["attainment"], n["worst_window"], f"{n['instance_hours']:.2f}", p, d,
                      "; ".join(notes) or ("meets both" if n["worst_window"] >= GOAL else
                                           "overall only" if n["attainment"] >= GOAL else "below the goal")])
    planners = [(f"the planner (goal {settings.attainment_goal:g})", result),
                (f"the planner told the goal ({TOLD_GOAL:g})", told_result)]
    verdicts = [_verdict(planners, search) for search in (overall, hourly)]
    settings_lines = [
        *_limit_note(args),
        f"the conversation trace repeated ({len(rows)} requests; each copy's hash ids moved past the last's) with its "
        f"arrival rate scaled by a day of {DAY_S:g} simulated s: x{DAY_TROUGH:g} at 4:00, x{DAY_PEAK:g} at 16:00, "
        "a cosine between (tools/sim/autoscale.py day_curve); an hour of that day is {:g} s".format(hour),
        "kvcache-centric, baseline admission, SLOs TTFT 30 s and TBT 0.1 s, LLaMA3-70B on 8xA800; attainment = requests "
        "within both SLOs / all requests (rejections count as misses); worst hour = the lowest attainment of the "
        "requests arriving in one hour of the day",
        f"the planner (common/decide/planner.py, default settings: attainment goal {settings.attainment_goal:g}; "
        f"the second run {TOLD_GOAL:g}) every {settings.interval_s:g} s, prefill "
        f"{settings.min_prefill}..{settings.max_prefill}, decode {settings.min_decode}..{settings.max_decode} "
        f"(8 to 64 instances), from 8P+8D; a new instance serves {BASE.startup_s:g} s after it is asked for and "
        "counts from then; a removed one takes no new work and leaves once what it holds has ended",
        f"fixed splits in the same bounds, two criteria: attainment >= {GOAL:g} over the day, and >= {GOAL:g} in every "
        f"hour too; for each, the fewest prefill meeting it with {settings.max_decode} decode (binary search), then the "
        "fewest decode with those; a run stops once it can no longer meet it. Assumes more instances of a role never "
        "lower attainment",
        "instance-hours: every instance from its ask to its leave (fixed: all of them for the whole run)",
        "command: moonbus sim --trace conversation_trace.jsonl --rate-curve day --autoscale "
        f"(--day-s {DAY_S:g} --rate-peak {DAY_PEAK:g} --rate-trough {DAY_TROUGH:g} are its defaults); the second "
        f"planner run: the same with --attainment-goal {TOLD_GOAL:g} --no-fixed-search"]
    lines = ["# Autoscaling: the planner against the best fixed splits", "", *[f"- {x}" for x in settings_lines], "",
             "| run | attainment | worst hour | instance-hours | prefill | decode | note |",
             "|---|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in table]
    for verdict in verdicts:
        lines += ["", verdict]
    lines += ["", "![Rate, instances and attainment over the day](7_autoscale.png)", ""]
    md = args.out / "7_autoscale.md"
    md.write_text("\n".join(lines))
    return md


def _criterion(search) -> str:
    return f">= {GOAL:g} overall" if search.window_s is None else f">= {GOAL:g} every hour"


def _verdict(planners, search) -> str:
    """One honest paragraph per criterion: the cheapest fixed split, and whether each planner run beat it."""
    if search.best is None:
        return f"No fixed split within the bounds reaches attainment {_criterion(search)}. " + " ".join(
            f"{name.capitalize()}: {r.planner_attainment:.3f} (worst hour {r.planner_worst_window:.3f}) with "
            f"{r.planner_hours:.2f} instance-hours." for name, r in planners)
    n = search.runs[search.best]
    out = [f"**{_criterion(search).capitalize()}**: the cheapest fixed split is {search.best[0]}P{search.best[1]}D, "
           f"attainment {n['attainment']:.3f} (worst hour {n['worst_window']:.3f}) with {n['instance_hours']:.2f} "
           "instance-hours."]
    for name, r in planners:
        ratio = r.ratio(search)
        kept = r.planner_attainment >= GOAL and (search.window_s is None or r.planner_worst_window >= GOAL)
        if not kept:
            verdict = "it does NOT meet this goal"
        elif ratio < 1:
            verdict = f"{(1 - ratio) * 100:.0f}% fewer, meeting the same goal"
        else:
            verdict = f"{(ratio - 1) * 100:.0f}% more: it does NOT beat this fixed split"
        out.append(f"{name.capitalize()}: {r.planner_attainment:.3f} (worst hour {r.planner_worst_window:.3f}) with "
                   f"{r.planner_hours:.2f}, {ratio:.3f} of them: {verdict}.")
    return " ".join(out)


EXPERIMENTS = {"1": policies, "2": cache_scope, "3": overload, "4": pd_ratio, "5": coupled, "7": autoscale}
