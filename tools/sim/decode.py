"""A continuous decode batch, simulated segment by segment instead of step by step.

Simulating every decode step of a 12k-request trace is millions of events. Between changes of
its membership a batch runs identical steps, so the simulator advances it in SEGMENTS:

    segment = (start t0, step time s, planned steps n)       s = step_seconds(batch, context at t0)
    n = min(steps until the first member finishes, segment_steps)

A join (KV arrived) closes the segment at the next step boundary after it, t0 + k*s with
k = ceil((t - t0) / s), and opens a new one there with the newcomer. Every closed segment is
logged as (t0, s, k, gap), gap = the pause before it (0 when it follows the previous segment
directly; > 0 after a coupled instance paused the batch for a prefill). A member's intervals
are the log entries between its join and its end:

    first entry:  its first decode token at t0 + s, after its first token (from prefill) at f:
                  one interval t0 + s - f, then k - 1 intervals of s
    later ones:   one interval s + gap, then k - 1 intervals of s

NOTE: the context grows by `batch` tokens per step inside a segment while s stays fixed;
segment_steps bounds that drift (64 steps of a 12k-token context: 0.5%).
"""

from __future__ import annotations

import math
from typing import Callable

from tools.sim.request import SimRequest


class DecodeBatch:
    """The batch of one instance; `schedule(t, callback_args)` books the segment's end event."""

    def __init__(self, step_seconds: Callable[[int, int, float], float], segment_steps: int,
                 schedule: Callable[[float, object, int], None]) -> None:
        self.step_seconds = step_seconds  # (batch, context, now) -> seconds: the machine's real speed
        self.segment_steps = segment_steps
        self.schedule = schedule  # (time, owner, version) -> books an end-of-segment event
        self.members: list[SimRequest] = []
        self.context = 0  # sum of members' context tokens
        self.steps = 0  # steps completed, ever
        self.running = False
        self.paused = False
        self.t0 = self.s = 0.0
        self.n = 0
        self.version = 0
        self.extra_s = 0.0  # added to every step (coupled + chunked prefill)
        self.prev_end: float | None = None
        self.log: list[tuple[float, float, int, float]] = []  # (t0, s, steps, gap)
        self.done: list[tuple[SimRequest, float]] = []  # (member, end time) finished, not yet taken

    # --- segments ----------------------------------------------------------------------------------

    def close(self, t: float, steps: int | None = None) -> float:
        """End the running segment at the first step boundary >= t; returns that boundary."""
        if not self.running:
            return t
        self.running = False
        if steps is None:
            steps = min(self.n, max(0, math.ceil((t - self.t0) / self.s - 1e-9))) if self.s > 0 else self.n
        end = self.t0 + steps * self.s
        if steps > 0:
            gap = 0.0 if self.prev_end is None else self.t0 - self.prev_end
            self.log.append((self.t0, self.s, steps, gap))
            self.prev_end = end
            self.steps += steps
            self.context += steps * len(self.members)
            self._reap(end)
        return end

    def _reap(self, end: float) -> None:
        """Move members whose last token is out to `done` (any close may finish some)."""
        steps = self.steps
        if all(r.target_steps > steps for r in self.members):
            return
        keep = []
        for r in self.members:
            if r.target_steps > steps:
                keep.append(r)
                continue
            self.context -= r.input_tokens + 1 + (steps - r.join_steps)
            r.runs = self.runs_of(r)
            self.done.append((r, end))
        self.members = keep

    def take_done(self) -> list[tuple[SimRequest, float]]:
        done, self.done = self.done, []
        return done

    def open(self, t: float, max_steps: int | None = None) -> None:
        """Start a segment at t if there is anything to run and the batch is not paused."""
        if self.paused or not (self.members or self.extra_s):
            return
        n = self.segment_steps if max_steps is None else min(self.segment_steps, max_steps)
        steps = self.steps
        for r in self.members:
            left = r.target_steps - steps
            if left < n:
                n = left
        base = self.step_seconds(len(self.members), self.context, t) if self.members else 0.0
        self.t0, self.s, self.n = t, base + self.extra_s, max(n, 1)
        self.running = True
        self.version += 1
        self.schedule(t + self.n * self.s, self, self.version)

    # --- membership ----------------------------------------------------------------------------------

    def join(self, r: SimRequest, t: float) -> float:
        """Add r at the next step boundary >= t (returned); r.output_tokens - 1 tokens to go.

        Closing the running segment may finish members: the caller takes them with take_done()."""
        tb = self.close(t)
        r.join_log = len(self.log)
        r.join_steps = self.steps
        r.target_steps = self.steps + r.output_tokens - 1
        self.members.append(r)
        self.context += r.input_tokens + 1
        self.open(tb)
        return tb

    def segment_end(self, t: float) -> None:
        """The planned segment ran out: close it (members done go to `done`)."""
        self.close(t, self.n)

    def pause(self, t: float) -> float:
        """Stop stepping at the next boundary >= t (a coupled prefill takes the GPU)."""
        end = self.close(t)
        self.paused = True
        return end

    def resume(self, t: float) -> None:
        self.paused = False
        self.open(t)

    def runs_of(self, r: SimRequest) -> list[list[float]]:
        """r's inter-token intervals, from its join to now, as [seconds, count] runs."""
        runs: list[list[float]] = []
        first = True
        for t0, s, k, gap in self.log[r.join_log:]:
            lead = (t0 + s - r.first_token_s) if first else s + gap
            first = False
            runs.append([lead, 1])
            if k > 1:
                runs.append([s, k - 1])
        return runs
