"""Measures of a run (docs/architecture.md, "Traces, replay and simulation"), shared by `moonbus replay` and `moonbus sim`.

    TTFT              arrival to first token
    TBT of a request  mean of its longest 10% of inter-token intervals (at least one interval)
    effective request capacity
                      share of ALL requests (rejected ones included) that ended ok with
                      TTFT <= ttft_slo and TBT <= tbt_slo (a one-token reply has no TBT: it passes)
    goodput           such requests per second of the run (first arrival to last end)
    rejections        at arrival (cheap) and late, after the prefill (wasted), counted apart
    cache hit ratio   cached prompt tokens / prompt tokens, over requests that got a prefill

Intervals are kept as runs: (interval seconds, count). A live replay has count 1 everywhere; the
simulator produces one run per decode batch segment, which keeps 4M simulated intervals cheap.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Iterable, Sequence

OK, REJECTED_ARRIVAL, REJECTED_LATE, FAILED = "ok", "rejected_arrival", "rejected_late", "failed"
STATUSES = (OK, REJECTED_ARRIVAL, REJECTED_LATE, FAILED)
TBT_SHARE = 0.10  # a request's TBT is the mean of this share of its longest intervals


@dataclass(slots=True)
class RequestResult:
    """One request's outcome. Times are seconds from the start of the run."""

    index: int  # row of the trace
    status: str
    arrival_s: float
    input_tokens: int
    output_tokens: int = 0  # tokens the client received
    cached_tokens: int = 0
    first_token_s: float | None = None  # absolute time of the first token
    end_s: float | None = None  # absolute time the request ended (any status)
    ttft_s: float | None = None
    tbt_s: float | None = None
    intervals: list = field(default_factory=list)  # [[seconds, count], ...] runs
    error: str = ""
    request_id: str = ""  # the X-Request-Id the gateway answered with ("" if none came back)
    http_status: int = 0  # of the response (0: no response, e.g. the connection failed)
    error_code: int = 0  # `code` of an error event inside a stream that had started (429 = late rejection)

    def to_json(self) -> dict:
        return asdict(self)


def tbt_from_runs(runs: Iterable[Sequence[float]], share: float = TBT_SHARE) -> float | None:
    """Mean of the longest `share` of the intervals given as (seconds, count) runs; None if none."""
    runs = [(float(s), int(c)) for s, c in runs if c > 0]
    total = sum(c for _, c in runs)
    if total == 0:
        return None
    want = max(1, math.ceil(share * total))
    taken, acc = 0, 0.0
    for s, c in sorted(runs, reverse=True):
        use = min(c, want - taken)
        acc += s * use
        taken += use
        if taken == want:
            break
    return acc / want


def tbt_of(intervals: Sequence[float], share: float = TBT_SHARE) -> float | None:
    return tbt_from_runs(((x, 1) for x in intervals), share)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear interpolation; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def meets(r: RequestResult, ttft_slo_s: float, tbt_slo_s: float) -> bool:
    return (r.status == OK and r.ttft_s is not None and r.ttft_s <= ttft_slo_s
            and (r.tbt_s is None or r.tbt_s <= tbt_slo_s))


def effective_capacity(results: Sequence[RequestResult], ttft_slo_s: float, tbt_slo_s: float) -> float:
    if not results:
        return 0.0
    return sum(1 for r in results if meets(r, ttft_slo_s, tbt_slo_s)) / len(results)


def summarize(results: Sequence[RequestResult], ttft_slo_s: float, tbt_slo_s: float) -> dict:
    """The summary every report prints: counts, percentiles, capacity, goodput, hit ratio."""
    counts = {s: 0 for s in STATUSES}
    for r in results:
        counts[r.status] += 1
    ok = [r for r in results if r.status == OK]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    tbts = [r.tbt_s for r in ok if r.tbt_s is not None]
    good = sum(1 for r in results if meets(r, ttft_slo_s, tbt_slo_s))
    start = min((r.arrival_s for r in results), default=0.0)
    end = max((r.end_s if r.end_s is not None else r.arrival_s for r in results), default=0.0)
    span = max(end - start, 1e-9)
    prefilled = [r for r in results if r.status in (OK, REJECTED_LATE)]
    input_tokens = sum(r.input_tokens for r in prefilled)
    return {
        "requests": len(results),
        "ok": counts[OK],
        "rejected_arrival": counts[REJECTED_ARRIVAL],
        "rejected_late": counts[REJECTED_LATE],
        "failed": counts[FAILED],
        "ttft_slo_s": ttft_slo_s,
        "tbt_slo_s": tbt_slo_s,
        "ttft_mean_s": sum(ttfts) / len(ttfts) if ttfts else None,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p90_s": percentile(ttfts, 90),
        "ttft_p99_s": percentile(ttfts, 99),
        "tbt_p50_s": percentile(tbts, 50),
        "tbt_p90_s": percentile(tbts, 90),
        "tbt_p99_s": percentile(tbts, 99),
        "meets_slo": good,
        "effective_capacity": good / len(results) if results else 0.0,
        # of the requests served, the share within both SLOs: what admission must keep high
        "slo_attainment": good / counts[OK] if counts[OK] else None,
        "goodput_rps": good / span,
        "goodput_per_min": 60.0 * good / span,
        "rejections": rejection_reasons(results),
        "span_s": span,
        "cache_hit_ratio": sum(r.cached_tokens for r in prefilled) / input_tokens if input_tokens else 0.0,
    }


def rejection_reasons(results: Sequence[RequestResult]) -> dict[str, int]:
    """How many requests were rejected, by stage and reason (the reason's words, numbers left out)."""
    out: dict[str, int] = {}
    for r in results:
        if r.status in (REJECTED_ARRIVAL, REJECTED_LATE):
            stage = "arrival" if r.status == REJECTED_ARRIVAL else "late"
            key = f"{stage}: {_reason_kind(r.error)}"
            out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _reason_kind(error: str) -> str:
    """'HTTP 429: rejected at arrival: tbt 0.0131s on d0 ... > slo' -> 'tbt'; the first word that names a cause."""
    text = error.lower()
    for kind in ("ttft", "tbt", "kv room", "holds", "tokens per minute", "concurrent"):
        if kind in text:
            return {"holds": "gateway full", "concurrent": "tenant limit", "tokens per minute": "tenant limit"}.get(kind, kind)
    return "other"


def load_over_time(results: Sequence[RequestResult], step_s: float) -> tuple[list[float], list[int], list[int]]:
    """(times, prefill load, decode load) sampled every step_s: a request is in prefill from its
    arrival to its first token (or its late rejection) and in decode from its first token to its end."""
    spans_p, spans_d = [], []
    for r in results:
        if r.status == REJECTED_ARRIVAL or r.end_s is None:
            continue
        first = r.first_token_s if r.first_token_s is not None else r.end_s
        spans_p.append((r.arrival_s, first))
        if r.first_token_s is not None:
            spans_d.append((r.first_token_s, r.end_s))
    end = max((r.end_s or r.arrival_s for r in results), default=0.0)
    n = int(end / step_s) + 2
    times = [i * step_s for i in range(n)]
    return times, _occupancy(spans_p, n, step_s), _occupancy(spans_d, n, step_s)


def _occupancy(spans: list[tuple[float, float]], n: int, step_s: float) -> list[int]:
    """How many spans contain each sample time i*step_s (difference array, O(spans + n))."""
    diff = [0] * (n + 1)
    for a, b in spans:
        i, j = math.ceil(a / step_s), math.ceil(b / step_s)  # samples in [a, b)
        if j > i:
            diff[min(i, n)] += 1
            diff[min(j, n)] -= 1
    out, acc = [], 0
    for i in range(n):
        acc += diff[i]
        out.append(acc)
    return out


def format_summary(summary: dict, title: str = "") -> str:
    """Human-readable lines of a summary."""
    def ms(key: str) -> str:
        v = summary.get(key)
        return "-" if v is None else f"{v * 1000:.1f}ms"

    lines = [title] if title else []
    lines += [
        f"requests {summary['requests']}: ok {summary['ok']}, rejected at arrival {summary['rejected_arrival']}, "
        f"rejected late {summary['rejected_late']}, failed {summary['failed']}",
        f"TTFT p50 {ms('ttft_p50_s')}  p90 {ms('ttft_p90_s')}  p99 {ms('ttft_p99_s')}  mean {ms('ttft_mean_s')}",
        f"TBT  p50 {ms('tbt_p50_s')}  p90 {ms('tbt_p90_s')}  p99 {ms('tbt_p99_s')}   (mean of longest 10% of intervals)",
        f"SLO ttft {summary['ttft_slo_s']:g}s tbt {summary['tbt_slo_s']:g}s: effective request capacity "
        f"{summary['effective_capacity']:.3f} ({summary['meets_slo']} requests), goodput {summary['goodput_rps']:.3f} req/s "
        f"({summary.get('goodput_per_min', 0.0):.1f} per minute) over {summary['span_s']:.1f}s",
        "SLO attainment (served within both SLOs): " + ("-" if summary.get("slo_attainment") is None
                                                       else f"{summary['slo_attainment']:.3f}"),
        "rejections: " + (", ".join(f"{k} {v}" for k, v in summary.get("rejections", {}).items()) or "none"),
        f"cache hit ratio {summary['cache_hit_ratio']:.3f}",
    ]
    return "\n".join(lines)
