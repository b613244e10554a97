"""The orders of the queues inside an instance, fair between tenants: a prefill instance's tasks
(`FairOrder`) and a decode instance's requests waiting for KV room (`next_to_admit`).

`FairOrder`, the order a prefill instance runs what it holds: tenants in turn, each by its
requests' arrival. Shared by the live prefill instance (services/prefill/queue.py,
`ArrivalQueue`) and the simulator (tools/sim/instances.py).

Between tenants: start-time fair queueing over the work each is served (a task's `cost`, prompt
tokens for a prefill). The next task is the head of the tenant whose turn starts first: its served
work so far, but never less than where the last task began (`clock`), so a tenant that was idle
banks no credit. A burst of one tenant therefore does not hold another tenant's small request
behind it: that request goes next, and the burst resumes once its tenant's turn comes again. One
tenant alone (or every task of the empty tenant "") is served exactly in arrival order.

Within a tenant: by arrival at a gateway. A request handed back because its decode instance was lost
while it waited at a prefill instance comes back as a new attempt; at the back of the line it would
wait the whole queue again and miss the TTFT its admission promised (docs/architecture.md,
"Reliability", has the replay that showed it). In arrival order it takes its request's place. An
item pushed `last` (a pipeline stage) goes to the back whatever its arrival, and stages run in the
order they came, whatever their tenants: stages of two requests must run in the same order on every
instance of the group, or each could wait on the other's, and each instance has served its tenants
differently.

`next_to_admit`, the way a decode instance's waiting requests take the KV room that frees
(services/decode/join.py): first come first served, except that a request that does not fit does
not hold back the requests of other tenants behind it that do; it lets at most MAX_PASSED of
them join before it, then waits at the head as before, so it is not starved. Behind a request that
does not fit, its own tenant's requests wait: one tenant alone is served exactly in arrival order.
"""

from __future__ import annotations

import bisect
import collections
import itertools
from typing import Callable, Generic, Iterable, Iterator, TypeVar

T = TypeVar("T")

MAX_PASSED = 8  # requests of other tenants that may join before a waiting request that does not fit


class FairOrder(Generic[T]):
    def __init__(self) -> None:
        self._lanes: dict[str, list[tuple[float, int, float, T]]] = {}  # tenant -> (key, push order, cost, item), sorted
        self._stages: collections.deque[int] = collections.deque()  # push order of the stages waiting, oldest first
        self._served: dict[str, float] = {}  # tenant -> the work it has been served, on the clock's scale
        self._clock = 0.0  # where the last task's turn began
        self._seq = itertools.count()
        self._len = 0

    def push(self, item: T, arrival: float, last: bool = False, tenant: str = "", cost: float = 1.0) -> None:
        seq = next(self._seq)
        key = arrival
        if last:
            key = max([arrival] + [lane[-1][0] for lane in self._lanes.values()])
            self._stages.append(seq)
        bisect.insort(self._lanes.setdefault(tenant, []), (key, seq, cost, item))  # push order breaks ties
        self._len += 1

    def pop(self) -> T:
        """The next to run."""
        if not self._lanes:
            raise IndexError("pop from an empty queue")
        tenant, start = self._next(self._lanes, self._served, self._clock, self._stages)
        lane = self._lanes[tenant]
        _, seq, cost, item = lane.pop(0)
        if not lane:
            del self._lanes[tenant]
        if self._stages and self._stages[0] == seq:
            self._stages.popleft()
        self._clock, self._served[tenant] = start, start + cost
        for idle in [t for t, served in self._served.items() if served <= start and t not in self._lanes]:
            del self._served[idle]  # its next turn starts at the clock anyway
        self._len -= 1
        return item

    def __iter__(self) -> Iterator[T]:
        """What waits, in no particular order: where the order does not matter, without `items`'
        walk through the tenants' turns."""
        return (entry[3] for lane in self._lanes.values() for entry in lane)

    def items(self) -> list[T]:
        """What waits, in the order it will run (if nothing else comes)."""
        if len(self._lanes) <= 1:
            return [entry[3] for lane in self._lanes.values() for entry in lane]
        lanes = {tenant: collections.deque(lane) for tenant, lane in self._lanes.items()}
        served, clock, stages = dict(self._served), self._clock, collections.deque(self._stages)
        order = []
        while lanes:
            tenant, clock = self._next(lanes, served, clock, stages)
            _, seq, cost, item = lanes[tenant].popleft()
            if not lanes[tenant]:
                del lanes[tenant]
            if stages and stages[0] == seq:
                stages.popleft()
            served[tenant] = clock + cost
            order.append(item)
        return order

    @staticmethod
    def _next(lanes, served: dict[str, float], clock: float, stages: collections.deque[int]) -> tuple[str, float]:
        """The tenant whose turn starts first (ties: the earlier head), and where its turn starts.
        A tenant whose head is a stage waits while an older stage does."""
        best: tuple[float, float, int] | None = None
        chosen = ""
        stage_set = set(stages)
        for tenant, lane in lanes.items():
            key, seq, _, _ = lane[0]
            if seq in stage_set and seq != stages[0]:
                continue
            rank = (max(served.get(tenant, 0.0), clock), key, seq)
            if best is None or rank < best:
                best, chosen = rank, tenant
        assert best is not None  # the oldest stage heads its lane
        return chosen, best[0]

    def __len__(self) -> int:
        return self._len


def next_to_admit(waiting: Iterable[T], tenant: Callable[[T], str], fits: Callable[[T], bool],
                  passed: Callable[[T], int], max_passed: int = MAX_PASSED) -> tuple[int | None, list[int]]:
    """The index of the waiting request (in arrival order) to admit next, or None: none may; and
    the indices of the requests that do not fit that it passes (each one more time passed)."""
    blocked: set[str] = set()
    passing: list[int] = []
    for i, item in enumerate(waiting):
        if tenant(item) in blocked:
            continue  # behind its own tenant's request that does not fit
        if fits(item):
            return i, passing
        if passed(item) >= max_passed:
            return None, []  # its turn: nothing behind it goes first
        blocked.add(tenant(item))
        passing.append(i)
    return None, []
