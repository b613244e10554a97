"""How busy the machine was while a load ran: the share of every core's time spent not idle.

An overloaded cluster that rejects work should be using the machine; an idle core while requests
wait is a bug to find (`moonbus replay`, `soak` and `bench goodput` report it)."""

from __future__ import annotations

import psutil


class MachineCpu:
    """Started when the load starts; `result()` says how much of the machine's cores it used."""

    def __init__(self) -> None:
        self._before = psutil.cpu_times()

    def result(self) -> dict:
        after = psutil.cpu_times()
        busy = sum(_busy(after)) - sum(_busy(self._before))
        total = sum(after) - sum(self._before)
        cores = psutil.cpu_count() or 1
        return {"cores": cores, "busy_core_s": round(busy, 2), "wall_s": round(total / cores, 2),
                "share": round(busy / total, 4) if total > 0 else None}


def _busy(times) -> tuple[float, ...]:
    """Every field but idle and iowait (guest time is already inside user)."""
    return tuple(v for k, v in times._asdict().items() if k not in ("idle", "iowait", "guest", "guest_nice"))
