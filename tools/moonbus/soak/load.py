"""The soak's workload: which trace rows are sent, when, and the rate the cluster can take.

Rows are sent in trace order and wrap around when the run needs more than the trace has. Trace
time is kept between rows, then scaled:

    arrival of request k (row k mod n, cycle c = k div n) =
        (c * cycle_ms + ts[k mod n] - ts[0]) / 1000 * time_scale
    cycle_ms = span + mean gap         (the wrap-around keeps the trace's own rate)

`--speed X` sets time_scale = 1 / X. `--load X` instead aims at X times the capacity the
cluster's profile predicts:

    capacity (req/s) = num_prefill / mean over the workload of profile.prefill.seconds(n, 0)
    time_scale       = trace rate / (X * capacity)

n is each request's prompt length as sent (scaled by tokens per hash id, cut to --max-input). No
prefix is assumed cached and decode is ignored: on these CPUs prefill is the bottleneck, so this
is an estimate, said as such in the report. Everything here is pure (no I/O but reading a trace).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from common.decide.perf import PrefillPredictor
from tools.moonbus.traces.rows import TRACE_BLOCK_TOKENS, TraceRow, scaled_input_length

# `--trace conversation` and `--trace synthetic` name the released traces beside the repository.


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request of the run: the `seq`-th sent, built from trace row `row_index`, sent at `at_s`."""

    seq: int
    row_index: int
    at_s: float
    row: TraceRow


def cycle_ms(rows: Sequence[TraceRow]) -> float:
    """Trace time of one pass over the rows including the gap before the wrap-around.

    A trace whose rows all share one timestamp (or a single row) counts as one pass per second.
    """
    if not rows:
        raise ValueError("the trace has no rows")
    span = rows[-1].timestamp_ms - rows[0].timestamp_ms
    gap = span / (len(rows) - 1) if len(rows) > 1 else 0.0
    return span + gap if span + gap > 0 else 1000.0


def trace_rate(rows: Sequence[TraceRow]) -> float:
    """Requests per second of trace time, wrap-around included."""
    return len(rows) / (cycle_ms(rows) / 1000.0)


def schedule(rows: Sequence[TraceRow], time_scale: float, count: int | None = None,
             duration_s: float | None = None) -> list[Arrival]:
    """The first `count` arrivals, or every arrival before `duration_s` (exactly one must be given)."""
    if (count is None) == (duration_s is None):
        raise ValueError("give exactly one of count and duration_s")
    if time_scale <= 0:
        raise ValueError(f"time_scale must be > 0, got {time_scale}")
    cycle, base, n = cycle_ms(rows), rows[0].timestamp_ms, len(rows)
    out: list[Arrival] = []
    seq = 0
    while count is None or seq < count:
        c, i = divmod(seq, n)
        at = (c * cycle + rows[i].timestamp_ms - base) / 1000.0 * time_scale
        if duration_s is not None and at >= duration_s:
            break
        out.append(Arrival(seq, i, at, rows[i]))
        seq += 1
    return out


def workload_rows(rows: Sequence[TraceRow], count: int | None) -> list[TraceRow]:
    """The rows the capacity estimate averages over: the first `count` sent (wrapped), else the trace."""
    if count is None:
        return list(rows)
    return [rows[i % len(rows)] for i in range(count)]


def prompt_length(row: TraceRow, tokens_per_block: int, max_input: int | None) -> int:
    """The prompt length tools.moonbus.traces.rows.prompt_token_ids builds for this row."""
    n = scaled_input_length(row, tokens_per_block)
    return max(1, min(n, max_input)) if max_input is not None else n


def capacity_rps(prefill: PrefillPredictor, input_lengths: Sequence[int], num_prefill: int) -> float:
    """Requests per second `num_prefill` instances can prefill with nothing cached (see the module doc)."""
    if not input_lengths:
        raise ValueError("no requests to estimate the capacity of")
    if num_prefill < 1:
        raise ValueError(f"num_prefill must be >= 1, got {num_prefill}")
    mean_s = sum(prefill.seconds(n, 0) for n in input_lengths) / len(input_lengths)
    if mean_s <= 0:
        raise ValueError("the profile predicts a prefill of 0 s: cannot derive a rate from it")
    return num_prefill / mean_s


def time_scale_for(rows: Sequence[TraceRow], speed: float | None = None, target_rps: float | None = None) -> float:
    """Trace seconds -> run seconds, from --speed or from a target rate (exactly one)."""
    if (speed is None) == (target_rps is None):
        raise ValueError("give exactly one of speed and target_rps")
    if speed is not None:
        if speed <= 0:
            raise ValueError(f"speed must be > 0, got {speed}")
        return 1.0 / speed
    if target_rps <= 0:
        raise ValueError(f"target rate must be > 0, got {target_rps}")
    return trace_rate(rows) / target_rps


def scaling_lines(trace: Path, rows: int, tokens_per_block: int, output_scale: float | None, max_output: int | None,
                  max_input: int | None, time_scale: float, target_rps: float) -> list[str]:
    """Every scaling the run applies, in words (printed and kept in soak.json)."""
    out_scale = output_scale if output_scale is not None else tokens_per_block / TRACE_BLOCK_TOKENS
    lines = [f"trace {trace} ({rows} rows, in order, wrapping around)",
             f"{tokens_per_block} tokens per hash id (trace: {TRACE_BLOCK_TOKENS}): input lengths x "
             f"{tokens_per_block / TRACE_BLOCK_TOKENS:g}" + (f", cut to {max_input}" if max_input is not None else ""),
             f"output lengths x {out_scale:g}" + (f", capped at {max_output}" if max_output is not None else ", no cap"),
             f"time scale: trace seconds x {time_scale:.4g} (speed {1 / time_scale:.4g})",
             f"target rate {target_rps:.3f} req/s"]
    return lines
