"""6. Live: one scaled slice of the conversation trace, replayed against a disaggregated and a coupled cluster.

Both clusters are real processes on this machine, started by tools.moonbus.cluster.processes exactly as
`moonbus up` starts them (`--prefill 1 --decode 1`, then `--coupled 2`), with the same model,
profile, SLOs, admission and torch threads; each one is replayed with tools.moonbus.traces.replay under
the same settings, then stopped before the next starts. The model is SmolLM2-135M: on CPU its
prefill (~3.5 ms per token on one thread) is long against a decode step (~60 ms), which is the
contrast the experiment is about; tiny-random computes so little that the bus and Python
overheads would hide it.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from common import models, profiles  # noqa: E402
from common.config import default_home  # noqa: E402
from tools.moonbus.traces.measures import OK, format_summary, summarize  # noqa: E402
from tools.moonbus.traces.rows import load_trace  # noqa: E402
from tools.experiments.runs import _write  # noqa: E402
from tools.moonbus.traces import replay  # noqa: E402
from tools.moonbus.cluster.processes import Cluster, ClusterSpec, free_port  # noqa: E402

MODEL = models.SMOLLM2
ROWS = 40  # first rows of the conversation trace (12 s of it)
SPEED = 0.15  # 12 s of trace -> 80 s of replay: what 2 CPU cores serve without a growing queue
BLOCK_TOKENS = 16  # tokens per trace hash id AND per KV block, so the trace's shared prefixes hit the cache
MAX_OUTPUT = 16
MAX_INPUT = 1024  # 2 of the 40 prompts are longer (1,435 and 2,724 tokens): one would hold a prefill for ~10 s
TTFT_SLO_S, TBT_SLO_S = 10.0, 0.5
ADMISSION = "predictive"  # `moonbus up`'s default
SETUPS = {"disaggregated 1P+1D": {"prefill": 1, "decode": 1}, "coupled x2": {"coupled": 2}}
UP_FLAGS = {"disaggregated 1P+1D": "--prefill 1 --decode 1", "coupled x2": "--coupled 2"}


def live(args: argparse.Namespace) -> Path:
    """6. Disaggregated 1P+1D vs 2 coupled instances, live on this machine, same trace slice."""
    trace = args.traces / "conversation_trace.jsonl"
    limit = args.limit or ROWS
    rows = load_trace(trace, limit)
    home = default_home().resolve()
    profile = ensure_profile(home)
    runs, table = {}, []
    for label, workers in SETUPS.items():
        results = run_one(home, profile, workers, trace, limit)
        s = summarize(results, TTFT_SLO_S, TBT_SLO_S)
        runs[label] = results
        print(f"{label}:\n{format_summary(s)}", flush=True)
        table.append([label, s["ok"], s["ttft_p50_s"], s["ttft_p90_s"], s["tbt_p50_s"], s["tbt_p90_s"],
                      s["effective_capacity"], s["goodput_rps"], s["rejected_arrival"], s["rejected_late"],
                      s["failed"], s["cache_hit_ratio"]])
    return write(args.out, runs, table, limit, len(rows))


def replay_flags(trace: Path, limit: int, url: str) -> list[str]:
    return ["--trace", str(trace), "--limit", str(limit), "--url", url, "--speed", f"{SPEED:g}",
            "--tokens-per-block", str(BLOCK_TOKENS), "--max-output", str(MAX_OUTPUT), "--max-input", str(MAX_INPUT),
            "--ttft-slo", f"{TTFT_SLO_S:g}", "--tbt-slo", f"{TBT_SLO_S:g}"]


def ensure_profile(home: Path) -> Path:
    """The model's measured profile, made once as `moonbus up` makes it; both clusters load this file."""
    dtype = models.resolve_dtype("auto")  # what the clusters' workers run (ClusterSpec's dtype)
    path = profiles.profile_path(home, models.prepare(MODEL, home).name, dtype)
    if not path.exists():
        subprocess.run([sys.executable, "-m", "tools.moonbus.cli", "profile", "--quick", "--model", MODEL,
                        "--home", str(home), "--threads", "1", "--max-input", str(MAX_INPUT), "--dtype", dtype],
                       check=True)
    return path


def run_one(model_home: Path, profile: Path, workers: dict, trace: Path, limit: int) -> list:
    """Start a cluster in a fresh home (the converted model shared), replay, stop."""
    with tempfile.TemporaryDirectory(prefix="moonbus-live-") as tmp:
        home = Path(tmp)
        (home / "models").symlink_to(model_home / "models")
        spec = ClusterSpec(home=home, model=MODEL, port=free_port(), nats_port=free_port(), threads=1,
                           block_tokens=BLOCK_TOKENS, admission=ADMISSION, ttft_slo_s=TTFT_SLO_S,
                           tbt_slo_s=TBT_SLO_S, profile=str(profile), log_level="WARNING", **workers)
        cluster = Cluster(spec)
        cluster.start(ready_timeout_s=300)
        try:
            parser = argparse.ArgumentParser()
            replay.add_arguments(parser)
            ns = parser.parse_args([*replay_flags(trace, limit, spec.url), "--no-progress"])
            return asyncio.run(replay.replay(load_trace(ns.trace, ns.limit), ns))
        finally:
            cluster.stop()


def write(out: Path, runs: dict, table: list[list], limit: int, num_rows: int) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, attr, slo, name in ((axes[0], "ttft_s", TTFT_SLO_S, "TTFT"), (axes[1], "tbt_s", TBT_SLO_S, "TBT")):
        for label, results in runs.items():
            values = [getattr(r, attr) for r in results if r.status == OK and getattr(r, attr) is not None]
            if values:
                ax.ecdf(values, label=label)
        ax.axvline(slo, color="grey", linestyle="--", linewidth=1, label=f"SLO {slo:g} s")
        ax.set_xlabel(f"{name} (s)")
        ax.set_ylabel("share of ok requests")
        ax.set_title(f"{name} CDF", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Live, {MODEL} on 2 CPU cores: conversation trace rows 1-{num_rows} at speed {SPEED:g}", fontsize=10)
    header = ["cluster", "ok", "p50 TTFT (s)", "p90 TTFT (s)", "p50 TBT (s)", "p90 TBT (s)", "effective capacity",
              "goodput (req/s)", "rejected at arrival", "rejected late", "failed", "cache hit ratio"]
    settings = [
        f"conversation trace, first {num_rows} rows (--limit {limit}), time / {SPEED:g}; {BLOCK_TOKENS} tokens per hash id "
        f"(input lengths x {BLOCK_TOKENS}/512, cut to {MAX_INPUT}), outputs x {BLOCK_TOKENS}/512 capped at {MAX_OUTPUT} "
        "tokens, ignore_eos",
        f"model {MODEL} (float32), 1 torch thread per model process, KV block {BLOCK_TOKENS} tokens, "
        f"policy kvcache-centric (coupled: --colocate), admission {ADMISSION}, SLOs TTFT {TTFT_SLO_S:g} s / TBT {TBT_SLO_S:g} s",
        "disaggregated: 1 prefill + 1 decode instance, each on its own node with a messenger; "
        "coupled: 2 instances that each prefill and decode on one model (a prefill pauses the batch), each with a messenger",
        "every process (NATS, gateway, conductor, cache index, messengers, workers, the replay client) shares 2 CPU cores",
        *[f"{label}: moonbus up --model {MODEL} {UP_FLAGS[label]} --threads 1 --block-tokens {BLOCK_TOKENS} "
          f"--admission {ADMISSION} --ttft-slo {TTFT_SLO_S:g} --tbt-slo {TBT_SLO_S:g}" for label in SETUPS],
        "then: moonbus replay " + " ".join(replay_flags(Path("conversation_trace.jsonl"), limit, "http://127.0.0.1:8000")),
        "command: python -m tools.experiments 6",
    ]
    return _write(out, "6_live", "Live: disaggregated vs coupled", settings, header, table, fig)
