"""The live-route rows of `moonbus bench conductor` (tools/moonbus/bench/route.py runs them): what
one phase measured, a row per conductor count, the `live` section of the report, and its table."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

GOAL_P99_US = 1000.0
GOAL_RATIO = 2.5  # routes/s with the most conductors over one conductor's


@dataclass
class Phase:
    """What one batch of routes measured (tools/moonbus/bench/route.py RouteClient.phase)."""

    tag: str  # the request ids' prefix
    ns: list[int]  # round trip of every answered route
    statuses: Counter  # RouteReply.status -> routes
    admitted: int
    unanswered: int  # timed out or no conductor
    seconds: float


def phase_row(conductors: int, indexed: int, latency: Phase, throughput: Phase, load: float) -> dict:
    """One `live_route` row: latency from the one-in-flight phase, routes/s from the other."""
    lat = np.array(latency.ns or [0], dtype=np.float64) / 1e3
    loaded = np.array(throughput.ns or [0], dtype=np.float64) / 1e3
    answered = len(latency.ns) + len(throughput.ns)
    return {
        "case": "live_route", "conductors": conductors, "blocks_indexed": indexed,
        "p50_us": float(np.percentile(lat, 50)), "p99_us": float(np.percentile(lat, 99)), "max_us": float(lat.max()),
        "routes_per_s": len(throughput.ns) / throughput.seconds,
        "admitted_share": (latency.admitted + throughput.admitted) / answered if answered else 0.0,
        "loaded_p50_us": float(np.percentile(loaded, 50)), "loaded_p99_us": float(np.percentile(loaded, 99)),
        "latency_routes": len(latency.ns), "throughput_routes": len(throughput.ns),
        "unanswered": latency.unanswered + throughput.unanswered,
        "statuses": {str(k): v for k, v in sorted((latency.statuses + throughput.statuses).items())},
        "load_average_1m": load,
    }


def cpu_per_route(before: dict[str, float], after: dict[str, float], routes: int) -> dict[str, float]:
    """Microseconds of CPU per routed request, by kind, over a phase (background work included:
    heartbeats, the stream's disk writes); `total` bounds routes/s at cores * 1e6 / total."""
    out = {kind: round((after[kind] - before.get(kind, 0.0)) * 1e6 / max(1, routes), 1) for kind in after}
    out["total"] = round(sum(out.values()), 1)
    return out


def events_summary(routed: dict[str, dict], conductors: int) -> dict:
    """What the timed routes' events say: which conductor answered how many, and index hits."""
    prefixes = (f"c{conductors}-lat-", f"c{conductors}-tput-")
    mine = [e for rid, e in routed.items() if rid.startswith(prefixes)]
    n = max(1, len(mine))
    return {"routed_events": len(mine), "answered_by": dict(sorted(Counter(e["by"] for e in mine).items())),
            "index_hit_share": sum(e["best_len"] > 0 for e in mine) / n,
            "mean_best_prefix_blocks": sum(e["best_len"] for e in mine) / n,
            "mean_reused_blocks": sum(e["prefix_blocks"] for e in mine) / n}


def summary(rows: list[dict], setup: dict, conductors: int) -> dict:
    """The `live` section: the rows, the ratio of the last conductor count's routes/s to the first's,
    the goals, the setup, and what else shares the cores."""
    first, last = rows[0], rows[-1]
    cores, beats = setup["cpu_cores"], setup["heartbeats_per_s"]
    return {
        "rows": rows,
        "ratio_routes_per_s": last["routes_per_s"] / first["routes_per_s"],
        "ratio_of": f"{last['conductors']} vs {first['conductors']} conductors",
        "goal_p99_us": GOAL_P99_US, "goal_p99_met": all(r["p99_us"] <= GOAL_P99_US for r in rows),
        "goal_ratio": GOAL_RATIO, "goal_ratio_met": last["routes_per_s"] / first["routes_per_s"] >= GOAL_RATIO,
        "setup": setup,
        "shares_cores_with": (f"all on this machine's {cores} cores: nats-server (JetStream writes every routed "
                              f"event to disk), the cache index, up to {conductors} conductors, and this Python "
                              f"process (the timing client and the fake fleet's "
                              f"{beats:.0f} heartbeats/s, which every conductor and the cache "
                              f"index decode), besides whatever else runs here (load_average_1m per row)"),
    }


def print_rows(live: dict) -> None:
    """The live rows under the pure-decision table of `moonbus bench conductor`."""
    if "error" in live:
        print(f"\n  live route: FAILED: {live['error']}")
        return
    s = live["setup"]
    print(f"\n  live route, end to end: RouteRequest -> nats-server -> conductor -> cache index -> conductor "
          f"-> RouteReply, then a Cancel")
    print(f"  {s['prefill_instances']} prefill + {s['decode_instances']} decode fake instances on {s['nodes']} "
          f"nodes; the cache index holds {s['blocks_indexed']:,} blocks ({s['trace_rows_stored']:,} trace rows, "
          f"{s['block_tokens']}-token blocks); {s['query_prompts']:,} query prompts of "
          f"{s['mean_query_tokens']:.0f} tokens on average")
    print(f"  latency with 1 route in flight; routes/s and loaded latency with {s['concurrency']} in flight; "
          f"best pfx = mean longest prefix (blocks) the index found\n")
    head = (f"  {'conductors':>10}{'routes/s':>10}{'p50 us':>9}{'p99 us':>9}{'loaded p50/p99 us':>20}"
            f"{'admitted':>10}{'idx hits':>10}{'best pfx':>10}{'load 1m':>9}   answered by")
    print(head)
    print("  " + "-" * (len(head) - 2))
    for r in live["rows"]:
        loaded = f"{r['loaded_p50_us']:.0f}/{r['loaded_p99_us']:.0f}"
        by = ", ".join(f"{k} {v}" for k, v in r["answered_by"].items()) or "(no routed events)"
        print(f"  {r['conductors']:>10}{r['routes_per_s']:>10,.0f}{r['p50_us']:>9.0f}{r['p99_us']:>9.0f}{loaded:>20}"
              f"{r['admitted_share']:>10.1%}{r['index_hit_share']:>10.1%}{r['mean_best_prefix_blocks']:>10.1f}"
              f"{r['load_average_1m']:>9.2f}   {by}")
    kinds = ("conductor", "cache_index", "nats", "bench")
    print(f"\n  CPU us per route while {s['concurrency']} in flight (heartbeats and stream writes included)")
    print(f"  {'conductors':>10}" + "".join(f"{k:>13}" for k in kinds) + f"{'total':>9}   ceiling on {s['cpu_cores']} cores")
    for r in live["rows"]:
        cpu = r["cpu_us_per_route"]
        ceiling = s["cpu_cores"] * 1e6 / cpu["total"] if cpu["total"] else float("nan")
        print(f"  {r['conductors']:>10}" + "".join(f"{cpu.get(k, 0.0):>13.0f}" for k in kinds)
              + f"{cpu['total']:>9.0f}   {ceiling:,.0f} routes/s")
    met = "MET" if live["goal_ratio_met"] else "NOT MET"
    print(f"\n  routes/s, {live['ratio_of']}: x{live['ratio_routes_per_s']:.2f} (goal >= x{live['goal_ratio']:.1f}: {met})")
    p99 = ", ".join(f"{r['conductors']}: {r['p99_us']:.0f} us" for r in live["rows"])
    print(f"  goal live p99 <= {live['goal_p99_us']:.0f} us: {'MET' if live['goal_p99_met'] else 'NOT MET'} ({p99})")
    print(f"  {live['shares_cores_with']}")
    timeouts = sum(r["index_timeouts"] for r in live["rows"])
    if timeouts:
        print(f"  {timeouts} routes were sent on as if nothing were cached: the cache index did not answer in time")
    unanswered = sum(r["unanswered"] for r in live["rows"])
    if unanswered:
        print(f"  {unanswered} routes got no answer in time")
