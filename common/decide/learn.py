"""Predictions that learn from what actually happened, per instance (ARCHITECTURE.md: "Predictions
that learn").

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

    def observe(self, instance_id: str, kind: str, predicted_s: float, actual_s: float) -> None:
        if kind not in KINDS:
            raise ValueError(f"kind {kind!r} is not one of {KINDS}")
        self._factors.setdefault((instance_id, kind), Factor()).observe(predicted_s, actual_s)

    def factor(self, instance_id: str, kind: str) -> float:
        """The instance's own factor once it has MIN_SAMPLES outcomes; before that its peers'
        (the median of theirs: a new instance most likely runs on the same kind of machine, and
        one priced at the profile while its peers are faster would never be chosen to learn);
        with no peers, the profile's 1.0."""
        known = self._factors.get((instance_id, kind))
        if known is not None and len(known.ratios) >= MIN_SAMPLES:
            return known.value
        peers = [f.value for (i, k), f in self._factors.items() if k == kind and len(f.ratios) >= MIN_SAMPLES]
        return median(peers) if peers else 1.0

    def forget(self, instance_id: str) -> None:
        """An instance that left: a new one under the same id starts from the profile."""
        for kind in KINDS:
            self._factors.pop((instance_id, kind), None)

    def snapshot(self) -> dict[str, dict[str, float]]:
        """instance -> kind -> factor (for events, metrics and the dashboard)."""
        out: dict[str, dict[str, float]] = {}
        for (instance, kind), f in self._factors.items():
            out.setdefault(instance, {})[kind] = round(f.value, 4)
        return out
