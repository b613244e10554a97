"""A prefill instance's queue: the tasks it was given, in the order it will compute them.

The order is the decision floor's (common/decide/queue_order.py), shared with the simulator:
tenants in turn by the prompt tokens each has been served, so one tenant's burst does not hold
another's small request behind it; within a tenant by their request's arrival at a gateway, so a
request re-dispatched after its instance was lost keeps its place; the stages of a pipelined
prefill (pipeline.py) at the back, in the order they came.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from common.decide.queue_order import FairOrder
from common.decide.yielding import most_urgent
from schemas.prefill import PrefillTask


class ArrivalQueue(asyncio.Queue):
    """The prefill tasks in the decision floor's order (`common.decide.queue_order`): tenants in
    turn, each by its requests' arrival at a gateway, pipeline stages at the back. `on_urgent`
    hears, after every put and get, the arrival and TTFT deadline of the waiting task whose deadline
    comes first ((0, 0): none has one): the decode instances beside it yield to it once it has
    waited long enough (common/cores.py `waiting`, common/decide/yielding.py)."""

    def __init__(self, on_urgent: Callable[[float, float], None] | None = None) -> None:
        self.on_urgent = on_urgent
        super().__init__()

    def _init(self, maxsize: int) -> None:
        self._queue: FairOrder[PrefillTask] = FairOrder()

    def _put(self, task: PrefillTask) -> None:
        stages = len(task.pipeline.stages) if task.pipeline is not None else 1
        self._queue.push(task, task.arrival_ts, last=task.pipeline is not None, tenant=task.tenant,
                         cost=max(1, len(task.prompt_token_ids) // stages))  # a stage computes its share
        self._tell()

    def _get(self) -> PrefillTask:
        task = self._queue.pop()
        self._tell()
        return task

    def _tell(self) -> None:
        if self.on_urgent is not None:
            self.on_urgent(*most_urgent((t.arrival_ts, t.ttft_deadline_ts) for t in self._queue))

    def tasks(self) -> list[PrefillTask]:
        """What waits, in the order it will run."""
        return self._queue.items()
