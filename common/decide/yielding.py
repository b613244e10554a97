"""When a decode instance leaves the machine's cores to the prefill instances beside it.

The workers on one machine share its cores (common/cores.py): each takes its share among those
computing at that moment, so a decode instance that steps without pause holds half of two cores
for as long as it holds a request. A batch of a few rows steps in tens of milliseconds against a
TBT SLO of a second; meanwhile prefill requests wait in a queue for their first token, and their
TTFT is what runs out. So once a request waiting in a prefill queue on the machine has used
`after` of its TTFT budget (its deadline less its arrival) in the queue, a decode instance steps
at most once every `share` of its TBT SLO (a step that took longer goes on at once): its rows
still get a token well within their TBT, and between its steps every core goes to the prefill.
Before that moment, and with no prefill queue, it steps back to back.

Why a waited share and not any queue: a chat burst queues prompts too, and a decode instance that
yielded to every queue slowed every stream of a chat load (-14% of its output tokens/s with a
share of 0.25, docs/benchmarks.md) to shorten TTFTs that were well within their SLO. Waiting on
the oldest request's queue time acts only where the TTFT SLO is at stake, and needs no prediction
of the prefill's speed beside a busy decode. A request with no deadline (admission "none", a
pipelined stage: common/decide/admission.py `ttft_deadline`) never calls for a yield.

A yield holds every running request's KV longer (its tokens come slower), so it stops once the
batch holds more than YIELD_KV_SHARE of the instance's KV room: past that, the room it holds
would turn arrivals away and read as decode demand to the planner (common/decide/planner.py
counts the room held), which a prefill-heavy load is not.
"""

from __future__ import annotations

from collections.abc import Iterable


YIELD_KV_SHARE = 0.25  # a batch holding more of its KV room than this does not yield


def most_urgent(waiting: Iterable[tuple[float, float]]) -> tuple[float, float]:
    """(arrival, deadline), wall clock, of the waiting request whose TTFT deadline comes first, of
    those (arrival, deadline) with one; (0, 0) when none has."""
    best = (0.0, 0.0)
    for arrival, deadline in waiting:
        if deadline > 0 and (best[1] == 0.0 or deadline < best[1]):
            best = (arrival, deadline)
    return best


def yield_due(urgent: Iterable[tuple[float, float]], after: float) -> float | None:
    """The wall-clock moment from which a decode instance yields, given each prefill queue's most
    urgent waiting request (arrival, deadline; (0, 0): none): the first moment one of them has
    waited `after` of its TTFT budget. None when no queue holds a request with a deadline."""
    due = None
    for arrival, deadline in urgent:
        if deadline > 0:
            t = arrival + after * max(deadline - arrival, 0.0)
            if due is None or t < due:
                due = t
    return due


def yield_pause(now: float, last_step_start: float | None, due: bool, tbt_slo_s: float,
                share: float, kv_held: float = 0.0) -> float:
    """Seconds a decode instance waits before its next step: while a prefill queue on its machine
    calls for it (`due`: `yield_due` has passed), until `share` x `tbt_slo_s` after its last step
    began; 0 when none does, when it has not stepped yet, with `share` 0 (it never yields), or
    when its batch holds more than YIELD_KV_SHARE of its KV room (`kv_held`, 0-1)."""
    if share <= 0 or not due or last_step_start is None or kv_held > YIELD_KV_SHARE:
        return 0.0
    return max(0.0, last_step_start + share * tbt_slo_s - now)
