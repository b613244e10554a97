"""The soak's report: the human summary and soak.png, both read from the soak.json dict only.

Keeping them readers of the JSON means a report can be re-drawn from a saved soak.json, and the
unit tests can check them on a made-up one.
"""

from __future__ import annotations

from pathlib import Path

from tools.moonbus.soak.verdict import DEV_SHM_LEAK_BYTES, OUTCOMES

OUTCOME_COLORS = {"completed": "tab:green", "429": "tab:orange", "503": "tab:purple", "failed": "tab:red"}


def _mib(n: float | None) -> str:
    return "?" if n is None else f"{n / 2**20:.1f} MiB"


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1000:.0f} ms"


def _by_kind(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none"


def _slabs(slabs: dict[str, dict | None]) -> str:
    return ", ".join(f"{node} {s['used']}/{s['capacity']}" if s else f"{node} ?" for node, s in sorted(slabs.items())) or "?"


def format_text(report: dict) -> str:
    """The summary printed at the end of a run."""
    load, cap, out, drain, shm = report["load"], report["capacity"], report["outcomes"], report["drain"], report["shm"]
    lines = [f"moonbus soak: {report['sent']} requests over {report['span_s']:.1f} s to {report['cluster']['url']}"]
    if cap.get("rps"):
        used = "used" if load.get("load") is not None else "(not used: --speed sets the rate)"
        lines.append(f"  capacity estimate {used}: {cap['rps']:.3f} req/s = {cap['num_prefill']} prefill instance(s) / "
                     f"mean predicted prefill {cap['mean_prefill_s'] * 1000:.1f} ms of the workload's prompts "
                     f"(profile {cap['profile']}; nothing cached, decode not counted)")
    lines.append(f"  target rate {load['target_rps']:.3f} req/s" +
                 (f" = {load['load']:g} x capacity" if load.get("load") is not None else f" (speed {load['speed']:g})"))
    if cap.get("error"):
        lines.append(f"  no capacity estimate: {cap['error']}")
    lines += [f"  scaling: {s}" for s in report["scalings"]]
    lines.append("outcomes: " + ", ".join(f"{k} {out[k]}" for k in OUTCOMES) + f"; migrated {report['migrated']}")
    if report["load_end_s"] > 0:
        lines.append(f"  achieved: {out['completed'] / report['load_end_s']:.3f} completed req/s over the "
                     f"{report['load_end_s']:.1f} s until the last answer (target {load['target_rps']:.3f} req/s sent)")
    once = report["exactly_once"]
    lines.append(f"exactly once: {len(once['ended_twice'])} ended twice, {len(once['never_ended'])} never ended "
                 f"({once['terminal_events']} terminal events for our requests)")
    chaos = report["chaos"]
    if chaos["kinds"]:
        lines.append(f"chaos every {chaos['every_s']:g} s on {','.join(chaos['kinds'])}: kills {_by_kind(chaos['kills_by_kind'])}; "
                     f"restarts (state file) {_by_kind(chaos['restarts_by_kind'])}, "
                     f"(events) {_by_kind(chaos['restarted_events_by_kind'])}")
    for kill in chaos.get("touched", []):
        lines.append("  " + _kill_line(kill))
    lines.append("peak RSS: " + (", ".join(f"{k} {_mib(v)}" for k, v in sorted(report["rss_peak_by_kind"].items())) or "not sampled"))
    before, after = shm["before"] or {}, shm["after"] or {}
    probe = drain["probe"]
    new = probe["shm_request_files"]
    lines.append(f"shm dir {shm['root'] or '?'}: request files {before.get('request_files', '?')} -> "
                 f"{after.get('request_files', '?')} ({'?' if new is None else new} new, "
                 f"{_mib(probe['shm_request_bytes'])}), slabs "
                 f"{_mib(before.get('slab_bytes'))} -> {_mib(after.get('slab_bytes'))}")
    lines.append(f"slab blocks used/capacity: before {_slabs(report['slabs']['before'])}; after {_slabs(report['slabs']['after'])}")
    growth = shm["dev_shm_growth"]
    lines.append(f"/dev/shm used {_mib(shm['dev_shm_before'])} -> {_mib(shm['dev_shm_after'])} "
                 f"({'+' if (growth or 0) >= 0 else ''}{_mib(growth)}: our slabs {_mib(shm['slab_growth'])}, other "
                 f"files in /dev/shm {_mib(shm.get('others_growth', 0))}; a leak is more than "
                 f"{DEV_SHM_LEAK_BYTES >> 20} MiB beyond those)")
    lines.append(f"after the drain ({drain['seconds']:.1f} s, {'idle' if drain['idle'] else 'NOT idle'}): conductor in flight "
                 f"{'?' if probe['in_flight'] is None else probe['in_flight']}, pinned blocks {probe['pinned_blocks']}, "
                 f"request files {probe['pool_request_files']} (messengers) / "
                 f"{'?' if new is None else new} (counted), new since the start")
    if drain["unknown_seen"]:
        lines.append("  unknown during the drain: " + "; ".join(drain["unknown_seen"]))
    lat = report["latency"]
    lines.append(f"TTFT p50 {_ms(lat['ttft_p50_s'])}  p90 {_ms(lat['ttft_p90_s'])} of completed requests")
    slo = report.get("slo")
    if slo and slo.get("slo_attainment") is not None:
        lines.append(f"SLOs ttft {slo['ttft_slo_s']:g} s, tbt {slo['tbt_slo_s']:g} s: {slo['slo_attainment']:.1%} of the "
                     f"completed requests met both ({slo['meets_slo']}); goodput {slo['goodput_per_min']:.1f} per minute; "
                     "rejections: " + (", ".join(f"{k} {v}" for k, v in slo["rejections"].items()) or "none"))
    cpu = report.get("machine_cpu")
    if cpu and cpu.get("share") is not None:
        lines.append(f"machine CPU while the load ran: {cpu['share']:.1%} of {cpu['cores']} cores")
    lines += [f"note: {n}" for n in report["notes"]]
    if report["violations"]:
        lines.append(f"FAIL: {len(report['violations'])} violation(s)")
        lines += [f"  {v}" for v in report["violations"]]
    else:
        judged = (report.get("slo") or {}).get("min_attainment", 1) > 0
        lines.append("PASS: every request completed or was rejected (429/503), each ended exactly once, nothing leaked, "
                     + ("and the completed ones met the SLOs" if judged else
                        "(SLO attainment printed above, not judged: --min-attainment 0)"))
    return "\n".join(lines)


def _kill_line(kill: dict) -> str:
    """What one kill did: the requests it handed back, how each went on and how it ended."""
    head = f"kill at {kill['at_s']:.1f} s of {kill['name']} ({kill['kind']}): "
    requests = kill["requests"]
    if not requests:
        return head + "no request handed back"
    how = {h: [r for r in requests if r["how"] == h] for h in ("re-dispatched", "resumed")}
    ended: dict[str, int] = {}
    for r in requests:
        ended[r["ended"]] = ended.get(r["ended"], 0) + 1
    cached = sorted(r["cached_tokens"] for r in how["resumed"] if r["cached_tokens"] is not None)
    resumed = f"{len(how['resumed'])} resumed after their first token"
    if cached:
        resumed += f" (cached tokens of the new prefill: median {cached[len(cached) // 2]}, min {cached[0]}, max {cached[-1]})"
    return (head + f"{len(requests)} requests handed back: {len(how['re-dispatched'])} re-dispatched before their "
            f"first token, {resumed}; they ended " + _by_kind(ended))


def outcomes_per_second(requests: list[dict], seconds: int) -> dict[str, list[int]]:
    """outcome -> requests that ended in each second of the run (by their end time)."""
    out = {k: [0] * seconds for k in OUTCOMES}
    for r in requests:
        end = r["end_s"] if r["end_s"] is not None else r["arrival_s"]
        out[r["outcome"]][min(seconds - 1, max(0, int(end)))] += 1
    return out


def plot(report: dict, path: Path) -> Path:
    """soak.png: outcomes per second (stacked) with the kills, RSS per kind, shared-memory use."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = report["timeline"]
    ends = [r["end_s"] or r["arrival_s"] for r in report["requests"]] + [s["t"] for s in samples]
    seconds = int(max(ends, default=0.0)) + 1
    fig, axes = plt.subplots(3, 1, figsize=(11, 9), sharex=True)
    ax = axes[0]
    bottom = [0] * seconds
    for kind, counts in outcomes_per_second(report["requests"], seconds).items():
        ax.bar(range(seconds), counts, bottom=bottom, width=1.0, align="edge", label=kind, color=OUTCOME_COLORS[kind])
        bottom = [b + c for b, c in zip(bottom, counts)]
    ax.set_ylabel("requests ended / s")
    ax.legend(loc="upper right", fontsize=8)
    for a in axes:
        a.axvline(report["load_end_s"], color="grey", linewidth=1.0)
    ax.annotate("load ends, drain", (report["load_end_s"], ax.get_ylim()[1]), rotation=90, fontsize=7, va="top", ha="left")
    for kill in report["chaos"]["kills"]:
        for a in axes:
            a.axvline(kill["at_s"], color="black", linestyle="--", linewidth=0.8)
        ax.annotate(f"kill {kill['kind']}", (kill["at_s"], ax.get_ylim()[1]), rotation=90, fontsize=7,
                    va="top", ha="right")
    ts = [s["t"] for s in samples]
    kinds = sorted({k for s in samples for k in s["rss"]})
    for kind in kinds:
        axes[1].plot(ts, [s["rss"].get(kind, 0) / 2**20 for s in samples], label=kind)
    axes[1].set_ylabel("RSS, MiB (largest process)")
    if kinds:
        axes[1].legend(loc="upper left", fontsize=8)
    else:
        axes[1].text(0.5, 0.5, "not sampled: the state file lists no process ids", transform=axes[1].transAxes, ha="center")
    # other programs' files in /dev/shm (other clusters) taken out: what is left is ours or unexplained
    ours = [s["dev_shm_used"] - s.get("dev_shm_others", 0) for s in samples]
    axes[2].plot(ts, [(x - ours[0]) / 2**20 for x in ours], label="/dev/shm used, less others' files, since start")
    axes[2].plot(ts, [(s["shm_slab_bytes"] or 0) / 2**20 for s in samples], label="slabs")
    axes[2].plot(ts, [(s["shm_request_bytes"] or 0) / 2**20 for s in samples], label="request KV files")
    axes[2].set_ylabel("MiB")
    axes[2].set_xlabel("seconds from the first request")
    axes[2].legend(loc="upper left", fontsize=8)
    fig.suptitle(f"moonbus soak: {report['sent']} requests, target {report['load']['target_rps']:.2f} req/s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
