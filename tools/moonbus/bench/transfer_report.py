"""The ratios, goals and printed report of `moonbus bench transfer`, and its rows for `make bench`.

Every row with a time gets its GiB/s over each baseline's on the same pattern (`vs_<case>`).
The transport's goals (issue 17) are judged on ours with one connection against the plain socket
doing the same work (`socket_verified`: the same bytes, the same pattern, xxh3 at both ends or on
arrival, as ours): the streamed handoffs and the pulls at least GOAL_THROUGHPUT of its speed, one
block's round trip at most GOAL_ROUND_TRIP times its time. Speed is measured, never asserted:
the report says whether each goal was met.
"""

from __future__ import annotations

GOAL_THROUGHPUT = 0.8  # ours / socket_verified, GiB/s
GOAL_ROUND_TRIP = 2.0  # ours / socket_verified, seconds
FAIR = "socket_verified"
BASELINES = ("socket_verified", "socket", "mooncake_te_verified", "mooncake_te")


TLS, PLAIN = "ours_tcp_tls", "ours_tcp"  # TLS on the link's cost: the first's GiB/s over the second's


def add_ratios(rows: list[dict]) -> list[dict]:
    by = {(r["pattern"], r["case"]): r["gib_s"] for r in rows}
    for r in rows:
        for base in BASELINES + ((PLAIN,) if r["case"] == TLS else ()):
            theirs = by.get((r["pattern"], base))
            r[f"vs_{base}"] = r["gib_s"] / theirs if r["gib_s"] and theirs else None
    return rows


def goals(rows: list[dict], goal_of: dict[str, str], ours: str) -> dict:
    """One entry per pattern that judges a goal: ours against `socket_verified`."""
    by = {(r["pattern"], r["case"]): r for r in rows}
    out = []
    for pattern, goal in goal_of.items():
        mine, base = by.get((pattern, ours)), by.get((pattern, FAIR))
        if not goal or mine is None or base is None:
            continue
        if goal == "round trip":
            ratio = mine["seconds"] / base["seconds"] if mine["seconds"] and base["seconds"] else None
            target, met = f"<= {GOAL_ROUND_TRIP:g}x the socket's time", ratio is not None and ratio <= GOAL_ROUND_TRIP
        else:
            ratio = mine["vs_socket_verified"]
            target, met = f">= {GOAL_THROUGHPUT:g}x the socket's GiB/s", ratio is not None and ratio >= GOAL_THROUGHPUT
        out.append({"pattern": pattern, "measure": goal, "ratio": ratio, "goal": target, "met": met})
    return {"ours": ours, "against": FAIR, "rows": out, "all_met": all(g["met"] for g in out)}


def summary(result: dict) -> list[dict]:
    """`make bench`'s rows: ours (the goals' case) against each baseline per pattern, ours unverified
    against the unverified socket on the pulls, the handoff's tail. A round-trip pattern's rows
    compare times (lower is better), the others GiB/s."""
    goal_by = {g["pattern"]: g for g in result["goals"]["rows"]}
    ours = result["goals"]["ours"]
    by = {(r["pattern"], r["case"]): r for r in result["rows"]}
    pairs = [(r, base) for r in result["rows"] if r["case"] == ours for base in BASELINES]
    pairs += [(r, "socket") for r in result["rows"] if r["case"] == f"{ours}_unverified"]
    pairs += [(r, PLAIN) for r in result["rows"] if r["case"] == TLS]
    out = []
    for r, base in pairs:
        theirs = by.get((r["pattern"], base))
        if r["gib_s"] is None or theirs is None or theirs["gib_s"] is None:
            continue
        g = goal_by.get(r["pattern"]) if r["case"] == ours and base == FAIR else None
        round_trip = goal_by.get(r["pattern"], {}).get("measure") == "round trip"
        row = {"row": f"{r['pattern']}{' round trip' if round_trip else ''}: {r['case']} ({r['integrity']}) vs "
                      f"{base} ({theirs['integrity']})",
               "goal": g and f"{g['measure']}: {g['goal']}", "met": g and g["met"]}
        if round_trip:
            row |= {"ours": f"{r['seconds'] * 1e6:.0f} us", "baseline": f"{theirs['seconds'] * 1e6:.0f} us",
                    "ratio": r["seconds"] / theirs["seconds"]}
        else:
            row |= {"ours": f"{r['gib_s']:.2f} GiB/s", "baseline": f"{theirs['gib_s']:.2f} GiB/s",
                    "ratio": r[f"vs_{base}"]}
        out.append(row)
    for r in result["rows"]:
        if r["case"] == "handoff_tail":
            out.append({"row": f"handoff tail at {r['prompt_tokens']} tokens vs one layer's compute",
                        "ours": f"{r['seconds'] * 1e3:.2f} ms", "baseline": f"{r['layer_compute_s'] * 1e3:.2f} ms",
                        "ratio": r["vs_layer_compute"], "goal": None, "met": None})
    return out


def print_report(result: dict) -> None:
    print(f"{result['model']}: KV {result['layout']}, {result['bytes_per_token']} bytes/token; median of >= "
          f"{result['repeats']} runs; {result['cpus']} cpus; loopback, one receiving process per peer; "
          f"socket buffers {result['socket_buffers']}; Mooncake TE: {result['mooncake']}")
    rows = [r for r in result["rows"] if r["case"] != "handoff_tail"]
    if rows:
        print("every run's bytes stamped with its number and checked at the destination after the run (checked = "
              "runs right / runs)\n")
        print(f"{'pattern':<13} {'case':<20} {'integrity':<15} {'bytes':>11} {'msgs':>4} {'ms/run':>8} {'GiB/s':>6} "
              f"{'vs sock+':>8} {'vs sock':>7} {'vs TE+':>6} {'vs TE':>6} {'checked':>8}")
        for r in rows:
            if r["seconds"] is None:
                print(f"{r['pattern']:<13} {r['case']:<20} {r.get('note') or '; '.join(r['errors'])}")
                continue
            print(f"{r['pattern']:<13} {r['case']:<20} {r['integrity']:<15} {r['bytes']:>11} {r['messages']:>4} "
                  f"{r['seconds'] * 1e3:>8.3f} {r['gib_s']:>6.2f} {_x(r['vs_socket_verified']):>8} "
                  f"{_x(r['vs_socket']):>7} {_x(r['vs_mooncake_te_verified']):>6} {_x(r['vs_mooncake_te']):>6} "
                  f"{r['runs_verified']:>4}/{r['runs_checked']:<3}")
        print("(vs X = GiB/s over X's on the same pattern; + = the baseline checks xxh3 too)")
        tls = [r for r in rows if r["case"] == TLS and r.get(f"vs_{PLAIN}") is not None]
        if tls:
            print(f"\nTLS on the link (--link-cert): {TLS} GiB/s over {PLAIN}'s, the same pattern")
            for r in tls:
                print(f"  {r['pattern']:<13} {r['gib_s']:>6.2f} GiB/s against {r['gib_s'] / r[f'vs_{PLAIN}']:>6.2f}: "
                      f"{r[f'vs_{PLAIN}']:.2f}x")
    tail = [r for r in result["rows"] if r["case"] == "handoff_tail"]
    if tail:
        print("\nhandoff tail: last layer's slice written + the completion notice, vs one layer's compute")
        print(f"{'prompt tokens':>13} {'slice bytes':>12} {'tail ms':>9} {'(write ms)':>10} {'layer ms':>9} "
              f"{'tail/layer':>10} {'intact':>6}")
        for r in tail:
            print(f"{r['prompt_tokens']:>13} {r['bytes']:>12} {r['seconds'] * 1e3:>9.2f} {r['write_s'] * 1e3:>10.2f} "
                  f"{r['layer_compute_s'] * 1e3:>9.2f} {r['vs_layer_compute']:>10.3f} {str(r['intact']):>6}")
    g = result["goals"]
    if g["rows"]:
        print(f"\ngoals: {g['ours']} against {g['against']} (the same bytes in the same pattern, integrity checked "
              f"as ours does)")
        for row in g["rows"]:
            ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}x"
            print(f"  {row['pattern']:<13} {row['measure']:<10} {ratio:>6}  goal {row['goal']}: "
                  f"{'met' if row['met'] else 'NOT met'}")


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}"
