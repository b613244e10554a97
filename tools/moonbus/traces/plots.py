"""PNG plots of a run (replay or sim): TTFT and TBT CDFs, prefill and decode load over time.

matplotlib with the Agg backend (no display); imported only when --plot is asked for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from tools.moonbus.traces.measures import OK, RequestResult, load_over_time  # noqa: E402


def _cdf(ax, values: Sequence[float], label: str) -> None:
    xs = sorted(values)
    if not xs:
        return
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step(xs, ys, where="post", label=label)


def plot_cdfs(runs: Mapping[str, Sequence[RequestResult]], out_dir: Path, slos: tuple[float, float] | None = None) -> list[Path]:
    """ttft_cdf.png and tbt_cdf.png, one curve per run (label -> results), ok requests only."""
    paths = []
    for name, attr, slo in (("ttft", "ttft_s", slos[0] if slos else None), ("tbt", "tbt_s", slos[1] if slos else None)):
        fig, ax = plt.subplots(figsize=(6, 4))
        for label, results in runs.items():
            _cdf(ax, [getattr(r, attr) for r in results if r.status == OK and getattr(r, attr) is not None], label)
        if slo is not None:
            ax.axvline(slo, color="grey", linestyle="--", linewidth=1, label=f"SLO {slo:g}s")
        ax.set_xlabel(f"{name.upper()} (s)")
        ax.set_ylabel("share of ok requests")
        ax.set_title(f"{name.upper()} CDF")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        path = out_dir / f"{name}_cdf.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def plot_load(runs: Mapping[str, Sequence[RequestResult]], path: Path, step_s: float | None = None) -> Path:
    """Requests in prefill and in decode over time, one panel per run."""
    fig, axes = plt.subplots(len(runs), 1, figsize=(8, 2.6 * len(runs)), squeeze=False, sharex=True)
    for ax, (label, results) in zip(axes[:, 0], runs.items()):
        end = max((r.end_s or r.arrival_s for r in results), default=1.0)
        times, pre, dec = load_over_time(results, step_s or max(end / 600, 1e-3))
        ax.plot(times, pre, label="in prefill", linewidth=1)
        ax.plot(times, dec, label="in decode", linewidth=1)
        ax.set_ylabel("requests")
        ax.set_title(label, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper right")
    axes[-1, 0].set_xlabel("time (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_all(results: Sequence[RequestResult], out_dir: Path, label: str, slos: tuple[float, float]) -> list[Path]:
    """What --plot writes for one run."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return plot_cdfs({label: results}, out_dir, slos) + [plot_load({label: results}, out_dir / "load.png")]
