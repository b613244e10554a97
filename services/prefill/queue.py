"""A prefill instance's queue: the tasks it was given, in the order it will compute them.

The order is the decision floor's (common/decide/queue_order.py), shared with the simulator: by
their request's arrival at a gateway, so a request re-dispatched after its instance was lost keeps
its place; the stages of a pipelined prefill (pipeline.py) at the back.
"""

from __future__ import annotations

import asyncio

from common.decide.queue_order import ArrivalOrder
from schemas.prefill import PrefillTask


class ArrivalQueue(asyncio.Queue):
    """The prefill tasks in the decision floor's order (`common.decide.queue_order`): by their
    request's arrival at a gateway, pipeline stages at the back."""

    def _init(self, maxsize: int) -> None:
        self._queue: ArrivalOrder[PrefillTask] = ArrivalOrder()

    def _put(self, task: PrefillTask) -> None:
        self._queue.push(task, task.arrival_ts, last=task.pipeline is not None)

    def _get(self) -> PrefillTask:
        return self._queue.pop()

    def tasks(self) -> list[PrefillTask]:
        """What waits, in the order it will run."""
        return self._queue.items()
