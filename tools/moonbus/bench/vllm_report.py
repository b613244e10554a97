"""The numbers of `moonbus bench vllm`, from the client's per-request results: pure, no clock, no I/O.

serve rows    completed, rejected (HTTP 429, at arrival or late), failed; SLO attainment = within
              both SLOs / completed; TTFT p50/p90; ITL p50 over every inter-token interval of the
              completed requests (a chunk of k tokens: one interval, then k-1 of zero, as the
              replay client counts); goodput = within both SLOs per second of the run
              (common.measures.summarize); CPU use = CPU-seconds / wall-seconds / cores.
engine rows   prefill tokens/s = prompt tokens / TTFT of a max_tokens 1 request (best of the
              repeats); decode tokens/s of a batch = the tokens every request of it received
              while all were decoding (from the last first token to the first last token) per
              second of that window, so the prefills around it do not count.
ratios        moonbus over each vLLM run (higher is better for all of them).
"""

from __future__ import annotations

from typing import Sequence

from common.measures import OK, RequestResult, percentile

GOODPUT_GOAL = 1.0  # issue 19: goodput >= 1.0x vLLM CPU's (its defaults), at about 2x the trace's load


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
    intervals = [s for r in results if r.status == OK for s, c in r.intervals for _ in range(int(c))]
    return percentile(intervals, 50)


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
    """One server's trace row, from common.measures.summarize's summary of the same results."""
    completed = summary["ok"]
    return {
        "requests": summary["requests"], "completed": completed,
        "rejected": summary["rejected_arrival"] + summary["rejected_late"],
        "rejected_arrival": summary["rejected_arrival"], "rejected_late": summary["rejected_late"],
        "failed": summary["failed"], "within_slo": summary["meets_slo"],
        "slo_attainment": summary["meets_slo"] / completed if completed else 0.0,
        "ttft_p50_s": summary["ttft_p50_s"], "ttft_p90_s": summary["ttft_p90_s"], "itl_p50_s": itl_p50(results),
        "tbt_p50_s": summary["tbt_p50_s"], "goodput_rps": summary["goodput_rps"], "span_s": summary["span_s"],
        "cpu_seconds": cpu_seconds, "wall_seconds": wall_seconds, "cores": cores,
        "cpu_use": cpu_use(cpu_seconds, wall_seconds, cores),
    }


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    if ours is None or theirs is None:
        return None
    return ours / theirs if theirs > 0 else None


def ratios(servers: dict) -> dict:
    """moonbus over every vLLM run that measured, per number: {vllm run: {number: ratio}}."""
    ours = servers.get("moonbus", {})
    if "serve" not in ours:
        return {}
    out = {}
    for name, theirs in servers.items():
        if name == "moonbus" or "serve" not in theirs:
            continue
        out[name] = {"goodput": _ratio(ours["serve"]["goodput_rps"], theirs["serve"]["goodput_rps"]),
                     "prefill": _ratio(ours["engine"]["prefill_tps"], theirs["engine"]["prefill_tps"])}
        for batch, tps in ours["engine"]["decode_tps"].items():
            out[name][f"decode_b{batch}"] = _ratio(tps, theirs["engine"]["decode_tps"].get(batch))
    return out


def goodput_goal_met(ours: float, theirs: float) -> bool:
    """Ours at least GOODPUT_GOAL times theirs; also where theirs is 0 (no ratio), as long as ours is not."""
    return ours > 0 and ours >= GOODPUT_GOAL * theirs


def summary_rows(result: dict) -> list[dict]:
    """`make bench`'s rows (tools/moonbus/bench/suite.py): moonbus against each vLLM run."""
    servers, rows = result["servers"], []
    ours = servers.get("moonbus", {})
    for name, theirs in servers.items():
        if name == "moonbus":
            continue
        if "serve" not in theirs or "serve" not in ours:
            failed = theirs if "serve" not in theirs else ours
            rows.append({"row": f"moonbus vs {name}", "ours": None, "baseline": None, "ratio": None,
                         "goal": None, "met": None, "error": failed.get("error", "not run")[:300]})
            continue
        r = result["ratios"][name]
        default = not theirs.get("bind")
        goal_met = goodput_goal_met(ours["serve"]["goodput_rps"], theirs["serve"]["goodput_rps"]) if default else None
        rows.append({"row": f"goodput, conversation trace: moonbus vs {name}",
                     "ours": f"{ours['serve']['goodput_rps']:.3f} req/s",
                     "baseline": f"{theirs['serve']['goodput_rps']:.3f} req/s", "ratio": r["goodput"],
                     "goal": f">= {GOODPUT_GOAL}x" if default else None, "met": goal_met})
        rows.append({"row": f"prefill {result['prefill_tokens']} tokens: moonbus vs {name}",
                     "ours": _tps(ours["engine"]["prefill_tps"]), "baseline": _tps(theirs["engine"]["prefill_tps"]),
                     "ratio": r["prefill"], "goal": None, "met": None})
        for batch, tps in ours["engine"]["decode_tps"].items():
            rows.append({"row": f"decode batch {batch}: moonbus vs {name}", "ours": _tps(tps),
                         "baseline": _tps(theirs["engine"]["decode_tps"].get(batch)),
                         "ratio": r[f"decode_b{batch}"], "goal": None, "met": None})
    return rows


def _tps(value: float | None) -> str | None:
    return None if value is None else f"{value:.1f} tok/s"


def format_report(result: dict) -> str:
    """The human-readable report."""
    def s(v):
        return "-" if v is None else f"{v:.2f}s"

    def ms(v):
        return "-" if v is None else f"{v * 1000:.0f}ms"

    lines = [f"moonbus bench vllm: {result['trace_rows']} rows of {result['trace']} ({'; '.join(result['scalings'])}), "
             f"SLOs TTFT {result['ttft_slo_s']:g}s TBT {result['tbt_slo_s']:g}s; dtype {result['dtype']} on "
             f"{result['machine']['cpu']} ({result['machine']['cores']} cores, bf16 units: "
             f"{'yes' if result['machine']['bf16'] else 'no'}); {result['vllm']}", ""]
    head = (f"  {'server':<16} {'done':>4} {'429':>4} {'fail':>4} {'SLO':>5} {'TTFT p50':>9} {'p90':>8} "
            f"{'ITL p50':>8} {'goodput':>9} {'CPU':>5}   {'prefill':>9} " + " ".join(
                f"{'dec b' + str(b):>9}" for b in result["decode_batches"]))
    lines += [head, "  " + "-" * (len(head) - 2)]
    for name, srv in result["servers"].items():
        if "serve" not in srv:
            lines.append(f"  {name:<16} FAILED: {srv.get('error', 'not run').strip().splitlines()[-1][:200]}")
            continue
        v, e = srv["serve"], srv["engine"]
        lines.append(f"  {name:<16} {v['completed']:>4} {v['rejected']:>4} {v['failed']:>4} {v['slo_attainment']:>5.2f} "
                     f"{s(v['ttft_p50_s']):>9} {s(v['ttft_p90_s']):>8} {ms(v['itl_p50_s']):>8} "
                     f"{v['goodput_rps']:>5.3f}r/s {v['cpu_use']:>5.2f}   {_tps(e['prefill_tps']) or '-':>9} "
                     + " ".join(f"{(_tps(e['decode_tps'].get(b)) or '-'):>9}" for b in map(str, result['decode_batches'])))
    for name, srv in result["servers"].items():
        if "serve" in srv:  # colleagues' work on a shared machine weighs on a pinned server most
            load = f"{srv['load_before'][0]:.1f} -> {srv['load_after'][0]:.1f}"
            lines.append(f"  {name}: {srv['binding']}; started in {srv['start_s']:.0f} s; load average {load}")
    lines.append("")
    for name, r in result["ratios"].items():
        parts = [f"{k} {v:.2f}x" if v is not None else f"{k} - (vLLM's is 0 or missing)" for k, v in r.items()]
        lines.append(f"  moonbus / {name}: " + ", ".join(parts))
    lines += ["", "  SLO = completed within both SLOs / completed; goodput = within both SLOs per second of the run; "
                  "CPU = the server's process tree, CPU-seconds / wall-seconds / cores"]
    return "\n".join(lines)
