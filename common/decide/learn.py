"""Predictions that learn from what actually happened, per instance (docs/architecture.md, "The
conductor").

The profile (common/decide/perf.py) is measured once, on an idle machine. Live, an instance runs
slower or faster than that (shared cores, a decode batch next to a prefill, a slower node), and it
drifts. So every prediction the conductor makes is corrected by a per-instance factor learned from
outcomes:

    corrected(x) = profile(x) * factor(instance)
    factor       = median of the last WINDOW ratios actual / profile(x), over measured outcomes
                   of that instance, each clamped to [MIN_FACTOR, MAX_FACTOR]; until it has
                   MIN_SAMPLES, the median of its peers' factors (1.0 with none)

Why these choices:
- A multiplicative factor keeps the profile's shape (more tokens, a bigger batch, a longer
  context never cost less), so no correction can price more work cheaper.
- The median of a recent window ignores outliers (a GC pause, one step next to a huge prefill)
  and follows drift within WINDOW outcomes; a new instance starts from the profile.
- Per instance: one slow node must not make its peers look slow.

Kinds of outcome: `prefill` (a prompt's compute at a prefill instance, against
profile.prefill.seconds(n, p)) and `step` (a decode iteration, against
profile.decode.step_seconds(batch, context)). The same code runs in the simulator, which can be
told that the real speed differs from the profile (tools/sim: --speed-factor, --drift) and must
converge to it.

The kvcache-centric policy's balancing threshold learns too (`Threshold`, the paper's future
work): from how late routes that pull a prefix run against their predicted TTFT, compared with
routes that recompute.

Pure: outcomes in, factors out; no clock, no I/O.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from statistics import median

WINDOW = 32  # outcomes per instance and kind a factor is the median of
MIN_SAMPLES = 3  # before this many, the profile stands (factor 1.0)
MIN_FACTOR, MAX_FACTOR = 0.1, 20.0  # a measurement outside this is a broken clock, not a speed
KINDS = ("prefill", "step")


@dataclass
class Factor:
    """The learned ratio actual / predicted of one instance and kind."""

    ratios: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    value: float = 1.0
    samples: int = 0  # outcomes seen in all

    def observe(self, predicted_s: float, actual_s: float) -> None:
        if predicted_s <= 0 or actual_s <= 0:
            return  # nothing to learn from a prediction of nothing (or a clock that did not move)
        self.ratios.append(min(max(actual_s / predicted_s, MIN_FACTOR), MAX_FACTOR))
        self.samples += 1
        self.value = median(self.ratios) if len(self.ratios) >= MIN_SAMPLES else 1.0


class Learned:
    """Every instance's factors: what the conductor (and the simulator) multiply predictions by."""

    def __init__(self) -> None:
        self._factors: dict[tuple[str, str], Factor] = {}  # (instance, kind) -> Factor
        self._peers: dict[str, float] = {}  # kind -> the median of the measured factors (kept until one changes)
        self.version = 0  # counts the changes: a caller that keeps factors takes them again when it moves

    def observe(self, instance_id: str, kind: str, predicted_s: float, actual_s: float) -> None:
        if kind not in KINDS:
            raise ValueError(f"kind {kind!r} is not one of {KINDS}")
        self._factors.setdefault((instance_id, kind), Factor()).observe(predicted_s, actual_s)
        self._peers.pop(kind, None)
        self.version += 1

    def factor(self, instance_id: str, kind: str) -> float:
        """The instance's own factor once it has MIN_SAMPLES outcomes; before that its peers'
        (the median of theirs: a new instance most likely runs on the same kind of machine, and
        one priced at the profile while its peers are faster would never be chosen to learn);
        with no peers, the profile's 1.0."""
        known = self._factors.get((instance_id, kind))
        if known is not None and len(known.ratios) >= MIN_SAMPLES:
            return known.value
        peers = self._peers.get(kind)
        if peers is None:  # NOTE: every route asks this of every instance; the factors change far less often
            measured = [f.value for (_, k), f in self._factors.items() if k == kind and len(f.ratios) >= MIN_SAMPLES]
            peers = self._peers[kind] = median(measured) if measured else 1.0
        return peers

    def forget(self, instance_id: str) -> None:
        """An instance that left: a new one under the same id starts from the profile."""
        for kind in KINDS:
            self._factors.pop((instance_id, kind), None)
        self._peers.clear()
        self.version += 1

    def snapshot(self) -> dict[str, dict[str, float]]:
        """instance -> kind -> factor (for events, metrics and the dashboard)."""
        out: dict[str, dict[str, float]] = {}
        for (instance, kind), f in self._factors.items():
            out.setdefault(instance, {})[kind] = round(f.value, 4)
        return out


MAX_THRESHOLD = 4.0  # beyond this a pull would have to save three quarters of a prefill: never worth it


@dataclass
class Threshold:
    """The kvcache-centric policy's balancing threshold, tuned online from observed TTFT.

    A prefill candidate is priced with a pull when the best remote prefix is longer than its local
    one times the threshold (common/decide/policy.py). The configured value is right when a pull's
    predicted cost is as right as a recompute's. Each routed request's prefill end is an outcome:
    actual TTFT / predicted TTFT, filed under "pulled" or "recomputed" (WINDOW each, clamped as the
    factors are). When pulls run later against their prediction than recomputes do, pulling costs
    more than it is priced, so the threshold rises by that ratio; when they run earlier, it falls:

        value = clamp(base * median(pulled) / median(recomputed), 1, MAX_THRESHOLD)

    The ratio of medians cancels what both kinds share (a queue predicted short, a slow machine).
    Until each kind has MIN_SAMPLES outcomes, the configured base stands.
    """

    base: float
    pulled: Factor = field(default_factory=Factor)
    recomputed: Factor = field(default_factory=Factor)
    value: float = field(init=False)

    def __post_init__(self) -> None:
        self.value = self.base

    def observe(self, pulled: bool, predicted_s: float, actual_s: float) -> None:
        (self.pulled if pulled else self.recomputed).observe(predicted_s, actual_s)
        if len(self.pulled.ratios) >= MIN_SAMPLES and len(self.recomputed.ratios) >= MIN_SAMPLES:
            ratio = self.pulled.value / self.recomputed.value
            self.value = round(min(max(self.base * ratio, 1.0), MAX_THRESHOLD), 4)


MARGIN_WINDOW = 64
MARGIN_MIN_SAMPLES = 8
MAX_MARGIN = 2.0


@dataclass
class TtftMargin:
    """How much later than predicted a request's first token comes, near the TTFT SLO: what
    admission multiplies a predicted TTFT by before it compares it with the SLO.

    A prediction is right on the median at best, so admitting every request predicted within the
    SLO serves about half of those predicted just under it late; a request admitted and then served
    late is the failure admission exists to prevent. So each routed request's prefill end is an
    outcome, actual / predicted TTFT, kept when the prediction was at least `min_predicted_s` (a
    quarter of the SLO: short ones carry fixed overheads that say nothing about a long queue), and
    the margin is their `quantile` (the share of admitted requests whose first token should come
    within the SLO; 0: no margin) over the last MARGIN_WINDOW, clamped to [1, MAX_MARGIN] (never
    below 1: what is predicted late is not admitted). Until MARGIN_MIN_SAMPLES, 1.0.
    """

    min_predicted_s: float = 0.0
    quantile: float = 0.9
    ratios: deque = field(default_factory=lambda: deque(maxlen=MARGIN_WINDOW))
    value: float = 1.0

    def observe(self, predicted_s: float, actual_s: float) -> None:
        if predicted_s <= 0 or actual_s <= 0 or predicted_s < self.min_predicted_s or not self.quantile:
            return
        self.ratios.append(min(max(actual_s / predicted_s, MIN_FACTOR), MAX_FACTOR))
        if len(self.ratios) >= MARGIN_MIN_SAMPLES:
            ranked = sorted(self.ratios)
            at = ranked[min(len(ranked) - 1, int(self.quantile * len(ranked)))]
            self.value = round(min(max(at, 1.0), MAX_MARGIN), 4)
