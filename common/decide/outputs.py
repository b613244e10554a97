"""How many tokens a request will still generate: what decode load depends on.

The paper's predictive admission assumes every request spends one uniform time in decode; output
lengths vary by orders of magnitude (the conversation trace: 1 to thousands of tokens), so a
uniform guess over-counts short requests and under-counts long ones. Here each request gets its
own estimate of the tokens still to come:

    cap       max_tokens - generated: it cannot run longer
    hint      the client's expected output length (the API's `expected_output_tokens`), if given:
              min(hint, max_tokens) - generated, at least 1
    learned   else, from the lengths of recently completed requests L (each min(L, its cap)):
              E[min(L, max_tokens) - generated | L > generated] over those longer than what this
              one has generated (a request that has run long is likely to run longer still)
    unknown   no completed request yet, or none that long: the cap
and a request's remaining estimate shrinks as it generates.

Pure and deterministic: completed lengths in, estimates out (the simulator feeds it the trace's
output lengths through the same code).
"""

from __future__ import annotations

from bisect import bisect_right, insort
from collections import deque

KEEP = 512  # completed requests remembered


class OutputLengths:
    def __init__(self, keep: int = KEEP) -> None:
        self._recent: deque[int] = deque(maxlen=keep)  # in completion order
        self._sorted: list[int] = []  # the same lengths, sorted
        self._sums: list[int] | None = None  # prefix sums of _sorted, rebuilt lazily

    def observe(self, generated: int) -> None:
        """A request completed after generating `generated` tokens (its cap included)."""
        if generated < 1:
            return
        if len(self._recent) == self._recent.maxlen:
            old = self._recent[0]
            del self._sorted[bisect_right(self._sorted, old) - 1]
        self._recent.append(generated)
        insort(self._sorted, generated)
        self._sums = None

    @property
    def samples(self) -> int:
        return len(self._sorted)

    def remaining(self, generated: int, max_tokens: int, hint: int = 0) -> float:
        """Expected tokens still to come for a request that has generated `generated` of at most `max_tokens`."""
        cap = max(0, max_tokens - generated)
        if cap == 0:
            return 0.0
        if hint > 0:
            return float(max(1, min(hint, max_tokens) - generated))
        s = self._sorted
        i = bisect_right(s, generated)  # the completed ones longer than what this one has generated
        if i == len(s):
            return float(cap)
        if self._sums is None:
            sums = [0]
            for x in s:
                sums.append(sums[-1] + x)
            self._sums = sums
        j = bisect_right(s, max_tokens, lo=i)  # those within the cap count as themselves, longer ones as the cap
        within = self._sums[j] - self._sums[i]
        total = within + (len(s) - j) * max_tokens
        return max(1.0, total / (len(s) - i) - generated)
