"""When a decode instance leaves the machine's cores to the prefill instances beside it.

The workers on one machine share its cores (common/cores.py): each takes its share among those
computing at that moment, so a decode instance that steps without pause holds half of two cores
for as long as it holds a request. A batch of a few rows steps in tens of milliseconds against a
TBT SLO of a second; meanwhile prefill requests wait in a queue for their first token, and their
TTFT is what runs out. So while requests wait in a prefill queue on the machine, a decode
instance steps at most once every `share` of its TBT SLO (a step that took longer goes on at
once): its rows still get a token well within their TBT, and between its steps every core goes
to the prefill. With no prefill queue it steps back to back, as before.

A yield holds every running request's KV longer (its tokens come slower), so it stops once the
batch holds more than YIELD_KV_SHARE of the instance's KV room: past that, the room it holds
would turn arrivals away and read as decode demand to the planner (common/decide/planner.py
counts the room held), which a prefill-heavy load is not.
"""

from __future__ import annotations


YIELD_KV_SHARE = 0.25  # a batch holding more of its KV room than this does not yield


def yield_pause(now: float, last_step_start: float | None, prefill_waiting: int, tbt_slo_s: float,
                share: float, kv_held: float = 0.0) -> float:
    """Seconds a decode instance waits before its next step: while `prefill_waiting` requests
    wait in the prefill queues on its machine, until `share` x `tbt_slo_s` after its last step
    began; 0 when none wait, when it has not stepped yet, with `share` 0 (it never yields), or
    when its batch holds more than YIELD_KV_SHARE of its KV room (`kv_held`, 0-1)."""
    if share <= 0 or prefill_waiting <= 0 or last_step_start is None or kv_held > YIELD_KV_SHARE:
        return 0.0
    return max(0.0, last_step_start + share * tbt_slo_s - now)
