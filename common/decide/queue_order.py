"""The order a prefill instance runs what it holds: by its request's arrival at a gateway.

Shared by the live prefill instance (services/prefill/queue.py, `ArrivalQueue`) and the simulator
(tools/sim/instances.py). A request handed back because its decode instance was lost while it
waited at a prefill instance comes back as a new attempt; at the back of the line it would wait
the whole queue again and miss the TTFT its admission promised (docs/architecture.md,
"Reliability", has the replay that showed it). In arrival order it takes its request's place. An item pushed `last`
(a pipeline stage) goes to the back whatever its arrival: stages of two requests must run in the
same order on every instance of the group, or each could wait on the other's.
"""

from __future__ import annotations

import bisect
import itertools
from typing import Generic, TypeVar

T = TypeVar("T")


class ArrivalOrder(Generic[T]):
    def __init__(self) -> None:
        self._entries: list[tuple[float, int, T]] = []  # (key, push order, item), sorted
        self._seq = itertools.count()

    def push(self, item: T, arrival: float, last: bool = False) -> None:
        key = max(arrival, self._entries[-1][0]) if last and self._entries else arrival
        bisect.insort(self._entries, (key, next(self._seq), item))  # push order breaks ties: items never compared

    def pop(self) -> T:
        """The next to run."""
        return self._entries.pop(0)[2]

    def items(self) -> list[T]:
        """What waits, in the order it will run."""
        return [entry[2] for entry in self._entries]

    def __len__(self) -> int:
        return len(self._entries)
