"""The numbers of `moonbus bench vllm`, from the client's per-request results: pure, no clock, no I/O.

serve rows    completed, rejected (HTTP 429, at arrival or late), failed; output tokens/s = the
              tokens every request received per second of the run; SLO attainment = within both
              SLOs / completed; share within SLO = within both SLOs / ALL requests (rejections
              count as misses); TTFT p50/p90/p99; ITL p50/p90 over every inter-token interval of the
              completed requests (a chunk of k tokens: one interval, then k-1 of zero, as the
              replay client counts); goodput = within both SLOs per second of the run
              (tools.moonbus.traces.measures.summarize); CPU use = CPU-seconds / wall-seconds / cores.
capacity      the highest arrival rate (requests/s) at which the share within SLO is at least
              CAPACITY_SHARE, from runs at several speeds of the same trace slice (`next_speed`
              picks each next one: double while it holds, halve while it does not, then bisect
              until the bracket is within CAPACITY_BRACKET).
engine rows   prefill tokens/s = prompt tokens / TTFT of a max_tokens 1 request (best of the
              repeats); decode tokens/s of a batch = the tokens every request of it received
              while all were decoding (from the last first token to the first last token) per
              second of that window, so the prefills around it do not count.
ratios        moonbus over each vLLM run (higher is better for all of them).
"""

from __future__ import annotations

import math
from typing import Sequence

from tools.moonbus.traces.measures import OK, RequestResult, percentile, rejection_reasons

GOODPUT_GOAL = 1.0  # the prefill-heavy load keeps today's goodput: >= 1.0x vLLM CPU's at its defaults
CHAT_TOKENS_GOAL = {"vllm": 1.5, "vllm-all-cores": 1.0}  # issue 36: chat output tokens/s over each vLLM run
CAPACITY_GOAL = 1.5  # issue 36: SLO capacity >= 1.5x vLLM's best configuration, on both workloads
CAPACITY_SHARE = 0.9  # a rate is served when at least this share of all requests meets both SLOs
CAPACITY_BRACKET = 1.25  # the search stops once the highest rate served and the lowest not are this close


def token_times(r: RequestResult) -> list[float]:
    """When each received token arrived (seconds from the run's start), from the first token and
    the intervals after it."""
    if r.first_token_s is None:
        return []
    times, t = [r.first_token_s], r.first_token_s
    for seconds, count in r.intervals:
        for _ in range(int(count)):
            t += seconds
            times.append(t)
    return times


def itl_p50(results: Sequence[RequestResult]) -> float | None:
    return itl_percentile(results, 50)


def itl_percentile(results: Sequence[RequestResult], p: float) -> float | None:
    intervals = [s for r in results if r.status == OK for s, c in r.intervals for _ in range(int(c))]
    return percentile(intervals, p)


def decode_rate(results: Sequence[RequestResult]) -> float | None:
    """Tokens per second while every request of the batch decodes; None without such a window."""
    times = [token_times(r) for r in results]
    if not results or any(r.status != OK or len(t) < 2 for r, t in zip(results, times)):
        return None
    start, end = max(t[0] for t in times), min(t[-1] for t in times)
    if end <= start:
        return None
    tokens = sum(1 for t in times for x in t if start < x <= end)
    return tokens / (end - start)


def prefill_rate(results: Sequence[RequestResult]) -> float | None:
    """Prompt tokens per second of the fastest completed single-token request."""
    done = [r for r in results if r.status == OK and r.ttft_s]
    return max((r.input_tokens / r.ttft_s for r in done), default=None)


def cpu_use(cpu_seconds: float, wall_seconds: float, cores: int) -> float:
    """Share of the machine's cores busy on average (1.0 = every core all the time)."""
    if wall_seconds <= 0 or cores < 1:
        raise ValueError(f"wall_seconds and cores must be positive, got {wall_seconds} and {cores}")
    return cpu_seconds / wall_seconds / cores


def serve_row(summary: dict, results: Sequence[RequestResult], cpu_seconds: float, wall_seconds: float,
              cores: int) -> dict:
    """One server's trace row, from tools.moonbus.traces.measures.summarize's summary of the same results."""
    completed = summary["ok"]
    return {
        "requests": summary["requests"], "completed": completed,
        "rejected": summary["rejected_arrival"] + summary["rejected_late"],
        "rejected_arrival": summary["rejected_arrival"], "rejected_late": summary["rejected_late"],
        "rejections": rejection_reasons(results),  # "arrival: ttft" -> how many, and so on
        "failed": summary["failed"], "within_slo": summary["meets_slo"],
        "slo_attainment": summary["meets_slo"] / completed if completed else 0.0,
        "share_within_slo": summary["effective_capacity"],
        "output_tokens_per_s": sum(r.output_tokens for r in results) / wall_seconds if wall_seconds > 0 else 0.0,
        "ttft_p50_s": summary["ttft_p50_s"], "ttft_p90_s": summary["ttft_p90_s"], "ttft_p99_s": summary["ttft_p99_s"],
        "itl_p50_s": itl_p50(results), "itl_p90_s": itl_percentile(results, 90),
        "tbt_p50_s": summary["tbt_p50_s"], "goodput_rps": summary["goodput_rps"], "span_s": summary["span_s"],
        "cpu_seconds": cpu_seconds, "wall_seconds": wall_seconds, "cores": cores,
        "cpu_use": cpu_use(cpu_seconds, wall_seconds, cores),
        # of the completed requests, how many missed each SLO (one may miss both)
        "past_ttft_slo": sum(1 for r in results if r.status == OK and r.ttft_s is not None
                             and r.ttft_s > summary["ttft_slo_s"]),
        "past_tbt_slo": sum(1 for r in results if r.status == OK and r.tbt_s is not None
                            and r.tbt_s > summary["tbt_slo_s"]),
    }


# ---------------------------------------------------------------------------- capacity


def capacity_run(serve: dict, speed: float, rate_rps: float) -> dict:
    """One run of the capacity search: its speed, arrival rate and share within both SLOs."""
    return {"speed": speed, "rate_rps": rate_rps, "share_within_slo": serve["share_within_slo"],
            "requests": serve["requests"], "within_slo": serve["within_slo"], "rejected": serve["rejected"],
            "rejections": serve.get("rejections", {}),
            "output_tokens_per_s": serve["output_tokens_per_s"], "ttft_p90_s": serve["ttft_p90_s"],
            "past_ttft_slo": serve.get("past_ttft_slo", 0), "past_tbt_slo": serve.get("past_tbt_slo", 0)}


def describe_run(run: dict) -> str:
    missed = f", {run.get('past_ttft_slo', 0)} past the TTFT SLO, {run.get('past_tbt_slo', 0)} past the TBT SLO"
    why = ", ".join(f"{reason} {n}" for reason, n in run.get("rejections", {}).items())
    p90 = run.get("ttft_p90_s")
    return (f"{run['rate_rps']:.3f} req/s, {run['share_within_slo']:.0%} of {run['requests']} within both SLOs "
            f"({run['rejected']} rejected{f' ({why})' if why else ''}{missed}), "
            f"{run['output_tokens_per_s']:.1f} output tok/s"
            + (f", TTFT p90 {p90:.2f}s" if p90 is not None else ""))


def served(run: dict) -> bool:
    return run["share_within_slo"] >= CAPACITY_SHARE


def next_speed(runs: dict[float, dict]) -> float | None:
    """The next speed to try, from the runs so far (speed -> capacity_run); None when the highest
    speed served and the lowest not are within CAPACITY_BRACKET of each other."""
    good = [s for s, r in runs.items() if served(r)]
    bad = [s for s, r in runs.items() if not served(r)]
    if not good:
        return min(bad) / 2
    if not bad or max(bad) < max(good):  # never failed above the best it served
        return max(good) * 2
    low, high = max(good), min(s for s in bad if s > max(good))
    return None if high / low <= CAPACITY_BRACKET else math.sqrt(low * high)


def capacity(runs: dict[float, dict]) -> dict:
    """The SLO capacity: the highest rate served (0 when none was), with every run."""
    good = [r for r in runs.values() if served(r)]
    best = max(good, key=lambda r: r["rate_rps"]) if good else None
    unserved = [r["rate_rps"] for r in runs.values() if not served(r) and (best is None or r["rate_rps"] > best["rate_rps"])]
    return {"capacity_rps": best["rate_rps"] if best else 0.0, "speed": best["speed"] if best else None,
            "bounded": bool(unserved), "runs": sorted(runs.values(), key=lambda r: r["speed"])}


# ---------------------------------------------------------------------------- ratios and rows


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    if ours is None or theirs is None:
        return None
    return ours / theirs if theirs > 0 else None


def ratios(servers: dict) -> dict:
    """moonbus over every vLLM run that measured, per number: {vllm run: {number: ratio}}; a
    workload's numbers are named after it (chat tokens/s, chat capacity, ...)."""
    ours = servers.get("moonbus", {})
    if "workloads" not in ours:
        return {}
    out = {}
    for name, theirs in servers.items():
        if name == "moonbus" or "workloads" not in theirs:
            continue
        r = out[name] = {}
        for workload, mine in ours["workloads"].items():
            other = theirs["workloads"].get(workload)
            if other is None:
                continue
            r[f"{workload} tokens/s"] = _ratio(mine["serve"]["output_tokens_per_s"], other["serve"]["output_tokens_per_s"])
            r[f"{workload} goodput"] = _ratio(mine["serve"]["goodput_rps"], other["serve"]["goodput_rps"])
            r[f"{workload} capacity"] = _ratio(mine["capacity"]["capacity_rps"], other["capacity"]["capacity_rps"])
        r["prefill"] = _ratio(ours["engine"]["prefill_tps"], theirs["engine"]["prefill_tps"])
        for batch, tps in ours["engine"]["decode_tps"].items():
            r[f"decode_b{batch}"] = _ratio(tps, theirs["engine"]["decode_tps"].get(batch))
    return out


def goodput_goal_met(ours: float, theirs: float) -> bool:
    """Ours at least GOODPUT_GOAL times theirs; also where theirs is 0 (no ratio), as long as ours is not."""
    return ours > 0 and ours >= GOODPUT_GOAL * theirs


def best_vllm_capacity(servers: dict, workload: str) -> tuple[str, float] | None:
    """vLLM's best configuration on a workload: (run, capacity req/s), or None when none measured."""
    found = [(s["workloads"][workload]["capacity"]["capacity_rps"], name) for name, s in servers.items()
             if name != "moonbus" and workload in s.get("workloads", {})]
    if not found:
        return None
    capacity_rps, name = max(found)
    return name, capacity_rps


def summary_rows(result: dict) -> list[dict]:
    """`make bench`'s rows (tools/moonbus/bench/suite.py): moonbus against each vLLM run and workload."""
    servers, rows = result["servers"], []
    ours = servers.get("moonbus", {})
    for name, theirs in servers.items():
        if name == "moonbus":
            continue
        if "workloads" not in theirs or "workloads" not in ours:
            failed = theirs if "workloads" not in theirs else ours
            rows.append({"row": f"moonbus vs {name}", "ours": None, "baseline": None, "ratio": None,
                         "goal": None, "met": None, "error": failed.get("error", "not run")[:300]})
            continue
        r = result["ratios"][name]
        for workload, mine in ours["workloads"].items():
            other = theirs["workloads"].get(workload)
            if other is None:
                continue
            goal = CHAT_TOKENS_GOAL.get(name) if workload == "chat" else None
            rows.append({"row": f"{workload}: output tokens/s, moonbus vs {name}",
                         "ours": _tps(mine["serve"]["output_tokens_per_s"]),
                         "baseline": _tps(other["serve"]["output_tokens_per_s"]), "ratio": r[f"{workload} tokens/s"],
                         "goal": f">= {goal}x" if goal else None,
                         "met": None if goal is None else (r[f"{workload} tokens/s"] or 0) >= goal})
            default = workload == "prefill-heavy" and not theirs.get("bind")
            rows.append({"row": f"{workload}: goodput, moonbus vs {name}", "ours": f"{mine['serve']['goodput_rps']:.3f} req/s",
                         "baseline": f"{other['serve']['goodput_rps']:.3f} req/s", "ratio": r[f"{workload} goodput"],
                         "goal": f">= {GOODPUT_GOAL}x" if default else None,
                         "met": goodput_goal_met(mine["serve"]["goodput_rps"], other["serve"]["goodput_rps"]) if default else None})
        rows.append({"row": f"prefill {result['prefill_tokens']} tokens: moonbus vs {name}",
                     "ours": _tps(ours["engine"]["prefill_tps"]), "baseline": _tps(theirs["engine"]["prefill_tps"]),
                     "ratio": r["prefill"], "goal": None, "met": None})
        for batch, tps in ours["engine"]["decode_tps"].items():
            rows.append({"row": f"decode batch {batch}: moonbus vs {name}", "ours": _tps(tps),
                         "baseline": _tps(theirs["engine"]["decode_tps"].get(batch)),
                         "ratio": r[f"decode_b{batch}"], "goal": None, "met": None})
    for workload, mine in ours.get("workloads", {}).items():
        best = best_vllm_capacity(servers, workload)
        if best is None:
            continue
        name, theirs = best
        ours_rps = mine["capacity"]["capacity_rps"]
        rows.append({"row": f"{workload}: SLO capacity, moonbus vs vLLM's best ({name})",
                     "ours": f"{ours_rps:.3f} req/s", "baseline": f"{theirs:.3f} req/s", "ratio": _ratio(ours_rps, theirs),
                     "goal": f">= {CAPACITY_GOAL}x", "met": ours_rps > 0 and ours_rps >= CAPACITY_GOAL * theirs})
    return rows


def _tps(value: float | None) -> str | None:
    return None if value is None else f"{value:.1f} tok/s"


def format_report(result: dict) -> str:
    """The human-readable report: per workload, a row per server at --speed and its capacity."""
    def s(v):
        return "-" if v is None else f"{v:.2f}s"

    def ms(v):
        return "-" if v is None else f"{v * 1000:.0f}ms"

    m = result["machine"]
    lines = [f"moonbus bench vllm: {result['trace_rows']} rows of {result['trace']}, SLOs TTFT {result['ttft_slo_s']:g}s "
             f"TBT {result['tbt_slo_s']:g}s; dtype {result['dtype']} (both servers) on {m['cpu']} ({m['cores']} cores, "
             f"flags {', '.join(m.get('cpu_flags', [])) or '-'}; bf16 units: {'yes' if m['bf16'] else 'no'}); "
             f"{result['vllm']}", ""]
    for workload, about in result["workloads"].items():
        lines += [f"{workload} ({'; '.join(about['scalings'])}; mean output {about['output_tokens_mean']:.0f} tokens; "
                  f"{_arrivals(about['rate_rps'])} at speed {result['speed']:g})"]
        head = (f"  {'server':<16} {'done':>4} {'429':>4} {'fail':>4} {'in SLO':>6} {'out tok/s':>9} {'TTFT p50':>9} "
                f"{'p90':>7} {'p99':>7} {'ITL p50':>8} {'p90':>7} {'goodput':>9} {'CPU':>5} {'capacity':>12}")
        lines += [head, "  " + "-" * (len(head) - 2)]
        for name, srv in result["servers"].items():
            if "workloads" not in srv:
                lines.append(f"  {name:<16} FAILED: {srv.get('error', 'not run').strip().splitlines()[-1][:200]}")
                continue
            w = srv["workloads"].get(workload)
            if w is None:
                continue
            v, cap = w["serve"], w["capacity"]
            bound = "" if cap["bounded"] else "+"  # no run above it failed: at least this
            lines.append(f"  {name:<16} {v['completed']:>4} {v['rejected']:>4} {v['failed']:>4} "
                         f"{v['share_within_slo']:>6.0%} {v['output_tokens_per_s']:>9.1f} {s(v['ttft_p50_s']):>9} "
                         f"{s(v['ttft_p90_s']):>7} {s(v['ttft_p99_s']):>7} {ms(v['itl_p50_s']):>8} {ms(v['itl_p90_s']):>7} "
                         f"{v['goodput_rps']:>5.3f}r/s {v['cpu_use']:>5.2f} {cap['capacity_rps']:>7.3f}r/s{bound}")
            for run in cap["runs"]:
                lines.append(f"      speed {run['speed']:<6.3g} {describe_run(run)}")
        lines.append("")
    head = f"  {'engine':<16} {'prefill':>11} " + " ".join(f"{'dec b' + str(b):>11}" for b in result["decode_batches"])
    lines += [head]
    for name, srv in result["servers"].items():
        if "engine" in srv:
            e = srv["engine"]
            lines.append(f"  {name:<16} {_tps(e['prefill_tps']) or '-':>11} "
                         + " ".join(f"{(_tps(e['decode_tps'].get(b)) or '-'):>11}" for b in map(str, result['decode_batches'])))
    for name, srv in result["servers"].items():
        if "workloads" in srv:  # colleagues' work on a shared machine weighs on a pinned server most
            load = f"{srv['load_before'][0]:.1f} -> {srv['load_after'][0]:.1f}"
            lines.append(f"  {name}: {srv['binding']}; started in {srv['start_s']:.0f} s; load average {load}")
    lines.append("")
    for name, r in result["ratios"].items():
        parts = [f"{k} {v:.2f}x" if v is not None else f"{k} - (vLLM's is 0 or missing)" for k, v in r.items()]
        lines.append(f"  moonbus / {name}: " + ", ".join(parts))
    lines += ["", f"  in SLO = within both SLOs / all requests (429s count as misses); capacity = the highest rate "
                  f"with at least {CAPACITY_SHARE:.0%} in SLO ('+': no faster run failed); goodput = within both SLOs "
                  f"per second of the run; CPU = the server's process tree, CPU-seconds / wall-seconds / cores"]
    return "\n".join(lines)


def _arrivals(rate_rps: float) -> str:
    """A workload's arrival rate as the report says it: a slice whose rows share one timestamp
    (the trace's first rows all arrive at 0) arrives all at once, it has no rate."""
    return f"{rate_rps:.3f} req/s" if rate_rps > 0 else "all arriving at once"
