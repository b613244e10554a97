"""The live-route rows of `moonbus bench conductor` (tools/moonbus/bench/route.py runs them): what
one phase measured, a row per conductor count and prefix index (local, remote), the `live`
section of the report with ours against the other, and its table."""

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


def events_summary(routed: dict[str, dict], tag: str) -> dict:
    """What the timed routes of phase `tag` (e.g. "local-c3") say in their events: which conductor
    answered how many, and index hits."""
    prefixes = (f"{tag}-lat-", f"{tag}-tput-")
    mine = [e for rid, e in routed.items() if rid.startswith(prefixes)]
    n = max(1, len(mine))
    return {"routed_events": len(mine), "answered_by": dict(sorted(Counter(e["by"] for e in mine).items())),
            "index_hit_share": sum(e["best_len"] > 0 for e in mine) / n,
            "mean_best_prefix_blocks": sum(e["best_len"] for e in mine) / n,
            "mean_reused_blocks": sum(e["prefix_blocks"] for e in mine) / n}


def versus(ours: dict, theirs: dict) -> dict:
    """Ours over theirs at one conductor count, as every bench ratio (lower is better for times,
    higher for routes/s)."""
    return {"conductors": ours["conductors"], "ratio_p50": ours["p50_us"] / theirs["p50_us"],
            "ratio_p99": ours["p99_us"] / theirs["p99_us"],
            "ratio_routes_per_s": ours["routes_per_s"] / theirs["routes_per_s"]}


def compared(ours: list[dict], theirs: list[dict]) -> dict:
    """Another prefix index's rows, its own ratio of routes/s, and ours over it per conductor count."""
    return {"rows": theirs, "ratio_routes_per_s": theirs[-1]["routes_per_s"] / theirs[0]["routes_per_s"],
            "ours_vs": [versus(o, t) for o, t in zip(ours, theirs)]}


def above(row: dict, echo: dict) -> dict:
    """What a conductor row adds to the floor (the echo row): microseconds at p50 and p99, one
    route in flight, and the floor's share of the row's p99."""
    return {"conductors": row["conductors"], "p50_us": row["p50_us"] - echo["p50_us"],
            "p99_us": row["p99_us"] - echo["p99_us"], "floor_share_p99": echo["p99_us"] / row["p99_us"]}


def summary(rows_by_index: dict[str, list[dict]], setup: dict, conductors: int, echo: dict) -> dict:
    """The `live` section: our rows (the first --prefix-index) with the ratio of the last conductor
    count's routes/s to the first's and the goals; the floor (the echo row) and what each of our
    rows adds to it; every other prefix index's rows and ratios to ours; the setup, and what else
    shares the cores."""
    ours, *others = rows_by_index
    rows = rows_by_index[ours]
    first, last = rows[0], rows[-1]
    cores, beats = setup["cpu_cores"], setup["heartbeats_per_s"]
    return {
        "prefix_index": ours,
        "rows": rows,
        "echo": echo,
        "above_echo": [above(r, echo) for r in rows],
        "ratio_routes_per_s": last["routes_per_s"] / first["routes_per_s"],
        "ratio_of": f"{last['conductors']} vs {first['conductors']} conductors",
        "goal_p99_us": GOAL_P99_US, "goal_p99_met": all(r["p99_us"] <= GOAL_P99_US for r in rows),
        "goal_ratio": GOAL_RATIO, "goal_ratio_met": last["routes_per_s"] / first["routes_per_s"] >= GOAL_RATIO,
        "compared": {mode: compared(rows, rows_by_index[mode]) for mode in others},
        "setup": setup,
        "shares_cores_with": (f"all on the {cores} cores this process may use (os.sched_getaffinity): nats-server "
                              f"(JetStream writes every routed event to disk), the cache index, up to {conductors} "
                              f"conductors, and this Python process (the timing client and the fake fleet's "
                              f"{beats:.0f} heartbeats/s, which every conductor and the cache "
                              f"index decode), besides whatever else runs here (load_average_1m per row)"),
    }


def print_rows(live: dict) -> None:
    """The live rows under the pure-decision table of `moonbus bench conductor`."""
    if "error" in live:
        print(f"\n  live route: FAILED: {live['error']}")
        return
    s, ours = live["setup"], live["prefix_index"]
    every = [*live["rows"], *(r for c in live["compared"].values() for r in c["rows"])]
    every.sort(key=lambda r: (r["conductors"], s["prefix_indexes"].index(r["prefix_index"])))
    print("\n  live route, end to end: RouteRequest -> nats-server -> conductor (-> cache index -> conductor, "
          "with a remote prefix index) -> RouteReply, then a Cancel")
    print(f"  {s['prefill_instances']} prefill + {s['decode_instances']} decode fake instances on {s['nodes']} "
          f"nodes; the cache index (and each local index) holds {s['blocks_indexed']:,} blocks "
          f"({s['trace_rows_stored']:,} trace rows, {s['block_tokens']}-token blocks); {s['query_prompts']:,} query "
          f"prompts of {s['mean_query_tokens']:.0f} tokens on average")
    print(f"  latency with 1 route in flight; routes/s and loaded latency with {s['concurrency']} in flight; "
          f"best pfx = mean longest prefix (blocks) the index found; index = the conductors' --prefix-index\n")
    head = (f"  {'conductors':>10}{'index':>8}{'routes/s':>10}{'p50 us':>9}{'p99 us':>9}{'loaded p50/p99 us':>20}"
            f"{'admitted':>10}{'idx hits':>10}{'best pfx':>10}{'load 1m':>9}   answered by")
    print(head)
    print("  " + "-" * (len(head) - 2))
    for r in [live["echo"], *every]:
        loaded = f"{r['loaded_p50_us']:.0f}/{r['loaded_p99_us']:.0f}"
        by = (", ".join(f"{k} {v}" for k, v in r.get("answered_by", {}).items()) or "(no routed events)"
              if r["prefix_index"] != "echo" else "the floor: a process that only answers")
        print(f"  {r['conductors']:>10}{r['prefix_index']:>8}{r['routes_per_s']:>10,.0f}{r['p50_us']:>9.0f}"
              f"{r['p99_us']:>9.0f}{loaded:>20}{r['admitted_share']:>10.1%}{r.get('index_hit_share', 0):>10.1%}"
              f"{r.get('mean_best_prefix_blocks', 0):>10.1f}{r['load_average_1m']:>9.2f}   {by}")
    kinds = ("conductor", "echo", "cache_index", "nats", "bench")
    print(f"\n  CPU us per route while {s['concurrency']} in flight (heartbeats and stream writes included)")
    print(f"  {'conductors':>10}{'index':>8}" + "".join(f"{k:>13}" for k in kinds)
          + f"{'total':>9}   ceiling on {s['cpu_cores']} cores")
    for r in [live["echo"], *every]:
        cpu = r["cpu_us_per_route"]
        ceiling = s["cpu_cores"] * 1e6 / cpu["total"] if cpu["total"] else float("nan")
        print(f"  {r['conductors']:>10}{r['prefix_index']:>8}" + "".join(f"{cpu.get(k, 0.0):>13.0f}" for k in kinds)
              + f"{cpu['total']:>9.0f}   {ceiling:,.0f} routes/s")
    for mode, compared in live["compared"].items():
        print(f"\n  {ours} / {mode} prefix index (lower is better for times, higher for routes/s)")
        for v in compared["ours_vs"]:
            print(f"  {v['conductors']:>10} conductor(s): p50 x{v['ratio_p50']:.2f}, p99 x{v['ratio_p99']:.2f}, "
                  f"routes/s x{v['ratio_routes_per_s']:.2f}")
    met = "MET" if live["goal_ratio_met"] else "NOT MET"
    print(f"\n  routes/s, {live['ratio_of']} on {s['cpu_cores']} cores: {ours} x{live['ratio_routes_per_s']:.2f} "
          f"(goal >= x{live['goal_ratio']:.1f}: {met})"
          + "".join(f", {mode} x{c['ratio_routes_per_s']:.2f}" for mode, c in live["compared"].items()))
    p99 = ", ".join(f"{r['conductors']}: {r['p99_us']:.0f} us" for r in live["rows"])
    print(f"  goal live p99 <= {live['goal_p99_us']:.0f} us ({ours} index): "
          f"{'MET' if live['goal_p99_met'] else 'NOT MET'} ({p99})")
    echo = live["echo"]
    added = ", ".join(f"{a['conductors']}: +{a['p50_us']:.0f} / +{a['p99_us']:.0f} us" for a in live["above_echo"])
    print(f"  the floor (echo, the bus alone): p50 {echo['p50_us']:.0f} us, p99 {echo['p99_us']:.0f} us; "
          f"what the conductor adds, p50 / p99: {added}")
    print(f"  {live['shares_cores_with']}")
    timeouts = sum(r["index_timeouts"] for r in every)
    if timeouts:
        print(f"  {timeouts} routes were sent on as if nothing were cached: the cache index did not answer in time")
    unanswered = sum(r["unanswered"] for r in every)
    if unanswered:
        print(f"  {unanswered} routes got no answer in time")
