"""The live status page: GET /dashboard (one static HTML file, its JS inline) and GET /dashboard/state
(the JSON it polls about once a second).

What the state holds and where each part comes from:
- instances: the conductor's view (CONDUCTOR_STATUS): role, node, queue and batch of each worker;
- nodes: each node's KV pool (messenger_control(node, "status")), for every node that runs a messenger;
- decisions: the last `RecentDecisions.capacity` `routed` audit events of the whole cluster (every
  gateway's requests), each with its candidates' predicted costs;
- outcomes: this gateway's own requests, counted per second over the last `OutcomeSeries.window_s`;
- ttft_error: for this gateway's completed requests, actual TTFT over the conductor's prediction,
  the median per second over the same window (`RatioSeries`): prediction error over time.

Who sees what (`scope`): an open gateway and an operator's key see all of the above ("cluster").
A tenant's key sees its own requests only ("tenant"): their decisions, without their candidates,
and their outcomes at this gateway (`tenant_outcomes`); the instances, the pools, the requests in
flight, every tenant's outcomes, the prediction error and the candidates' queues and batches count
every tenant's traffic, and would tell one tenant how busy the others are (and when).

What must stay true: the handlers never block on a silent cluster. Each NATS request has a
timeout of `QUERY_TIMEOUT_S` and all of them run concurrently, so a state answers within about
that long; a conductor or messenger that does not answer is reported as unavailable. Concurrent
pollers share one gathering at a time (`StateCache`), so many open pages cost the bus no more
than one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from statistics import median
from pathlib import Path
from typing import Any, Awaitable, Callable

import orjson
from aiohttp import web
from nats.aio.msg import Msg
from nats.errors import Error as NatsError

from schemas import subjects
from schemas.codec import WireError
from schemas.events import Event
from schemas.pool import PoolStatus
from schemas.workers import StatusReply

log = logging.getLogger(__name__)

PAGE = Path(__file__).parent / "static" / "dashboard.html"
QUERY_TIMEOUT_S = 1.0  # per NATS request of one state
STATE_MAX_AGE_S = 0.5  # a state younger than this is served again instead of asking the cluster
OUTCOMES = ("completed", "rejected_arrival", "rejected_late", "failed")
# the fields of a `routed` event the page shows (the rest of the event stays in the audit log)
DECISION_FIELDS = ("prefill_id", "decode_id", "ttft_s", "queue_s", "prefill_s", "transfer_s", "tbt_s",
                   "predicted_tbt_s", "reason", "admitted", "verdict", "policy", "prefix_blocks", "attempt", "tenant")
PREFILL_COST_FIELDS = ("instance_id", "queue_s", "prefix_blocks", "pull_blocks", "prefill_s", "transfer_s", "ttft_s")
DECODE_COST_FIELDS = ("instance_id", "num_running", "context_tokens", "tbt_s", "fits")


# --- the collectors (pure: the caller passes the clock) -------------------------------------

class RecentDecisions:
    """The last `capacity` routing decisions, newest first; each a small JSON-ready dict."""

    def __init__(self, capacity: int = 50) -> None:
        if capacity < 1:
            raise ValueError(f"capacity {capacity} must be >= 1")
        self.capacity = capacity
        self._ring: deque[dict[str, Any]] = deque(maxlen=capacity)

    def add(self, event: Event) -> dict[str, Any]:
        data = event.data
        record = {"ts": event.ts, "request_id": event.request_id}
        record |= {name: data[name] for name in DECISION_FIELDS if name in data}
        record["prefill_costs"] = [_pick(c, PREFILL_COST_FIELDS) for c in data.get("prefill_costs") or []]
        record["decode_costs"] = [_pick(c, DECODE_COST_FIELDS) for c in data.get("decode_costs") or []]
        self._ring.append(record)
        return record

    def newest_first(self) -> list[dict[str, Any]]:
        return list(reversed(self._ring))

    def __len__(self) -> int:
        return len(self._ring)


def _pick(candidate: Any, names: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(candidate, dict):
        return {}
    return {name: candidate[name] for name in names if name in candidate}


class OutcomeSeries:
    """Counts of request outcomes per whole second of wall-clock time, for the last `window_s` seconds,
    plus totals since start. `series(now)` has exactly `window_s` points per outcome, oldest first,
    the last one being the second `now` falls in."""

    def __init__(self, window_s: int = 300, outcomes: tuple[str, ...] = OUTCOMES) -> None:
        if window_s < 1:
            raise ValueError(f"window {window_s} s must be >= 1")
        self.window_s = window_s
        self.outcomes = outcomes
        self.totals = dict.fromkeys(outcomes, 0)
        self._seconds: dict[int, dict[str, int]] = {}  # second -> outcome -> count, at most window_s seconds
        self._newest = None  # the newest second recorded

    def record(self, outcome: str, now: float) -> None:
        if outcome not in self.totals:
            raise ValueError(f"outcome {outcome!r} is not one of {self.outcomes}")
        self.totals[outcome] += 1
        second = int(now)
        if self._newest is None or second > self._newest:
            self._newest = second
            for old in [sec for sec in self._seconds if sec <= second - self.window_s]:
                del self._seconds[old]
        elif second <= self._newest - self.window_s:
            return  # the clock stepped back past the window: only the totals count it
        self._seconds.setdefault(second, dict.fromkeys(self.outcomes, 0))[outcome] += 1

    def series(self, now: float) -> dict[str, Any]:
        last = int(now)
        first = last - self.window_s + 1
        points = {outcome: [0] * self.window_s for outcome in self.outcomes}
        for sec, counts in self._seconds.items():
            if first <= sec <= last:
                for outcome, count in counts.items():
                    points[outcome][sec - first] = count
        return {"start": first, "window_s": self.window_s, "points": points, "totals": dict(self.totals)}


class RatioSeries:
    """Ratios (actual / predicted) per whole second for the last `window_s` seconds; `series(now)`
    has `window_s` points, oldest first, each the median of its second's ratios (None: none)."""

    def __init__(self, window_s: int = 300) -> None:
        if window_s < 1:
            raise ValueError(f"window {window_s} s must be >= 1")
        self.window_s = window_s
        self._seconds: dict[int, list[float]] = {}

    def record(self, ratio: float, now: float) -> None:
        second = int(now)
        if second not in self._seconds:  # a new second: what left the window goes
            for old in [sec for sec in self._seconds if sec <= second - self.window_s]:
                del self._seconds[old]
        self._seconds.setdefault(second, []).append(ratio)

    def series(self, now: float) -> dict[str, Any]:
        last = int(now)
        first = last - self.window_s + 1
        points: list[float | None] = [None] * self.window_s
        for sec, ratios in self._seconds.items():
            if first <= sec <= last:
                points[sec - first] = round(median(ratios), 4)
        return {"start": first, "window_s": self.window_s, "points": points}


# --- the cluster's state ---------------------------------------------------------------------

async def ask(nc, subject: str, body: bytes, decode: Callable[[bytes], Any]) -> tuple[Any, str]:
    """One bounded request: (decoded reply, "") or (None, why it is unavailable)."""
    try:
        msg = await nc.request(subject, body, timeout=QUERY_TIMEOUT_S)
        return decode(msg.data), ""
    except (NatsError, asyncio.TimeoutError) as exc:
        return None, f"no answer ({type(exc).__name__})"
    except WireError as exc:
        return None, f"malformed answer: {exc}"


def instances_view(status: StatusReply) -> list[dict[str, Any]]:
    rows = []
    for w in sorted(status.workers, key=lambda w: (w.role, w.instance_id)):
        kv = w.decode
        rows.append({"instance_id": w.instance_id, "role": w.role, "node": w.node, "num_queued": w.num_queued,
                     "num_running": w.num_running, "draining": w.draining,
                     "queue_s": status.prefill_queue_s.get(w.instance_id),
                     "decode_running": status.decode_running.get(w.instance_id),
                     # a decode instance's KV room: its pool's bytes, and the share of its tokens held
                     "kv_cache_bytes": kv.kv_cache_bytes if kv is not None else None,
                     "kv_used_tokens": kv.kv_used_tokens if kv is not None else None,
                     "kv_free_tokens": kv.kv_free_tokens if kv is not None else None})
    return rows


def pool_view(node: str, pool: PoolStatus | None, error: str) -> dict[str, Any]:
    if pool is None:
        return {"node": node, "available": False, "error": error}
    return {"node": node, "available": True, "dram_capacity_blocks": pool.dram_capacity_blocks,
            "dram_used_blocks": pool.dram_used_blocks, "ssd_capacity_blocks": pool.ssd_capacity_blocks,
            "ssd_used_blocks": pool.ssd_used_blocks, "pinned_blocks": pool.pinned_blocks}


async def cluster_view(nc) -> dict[str, Any]:
    """The conductor's status, then every messenger node's pool, concurrently."""
    status, error = await ask(nc, subjects.CONDUCTOR_STATUS, b"", StatusReply.from_bytes)
    if status is None:
        return {"conductor": {"available": False, "error": error}, "instances": [], "nodes": []}
    nodes = sorted({w.node for w in status.workers if w.role == "messenger" and w.node})
    pools = await asyncio.gather(*(ask(nc, subjects.messenger_control(node, "status"), b"{}", PoolStatus.from_bytes)
                                   for node in nodes))
    return {"conductor": {"available": True, "in_flight": status.in_flight},
            "instances": instances_view(status),
            "nodes": [pool_view(node, pool, err) for node, (pool, err) in zip(nodes, pools)]}


class StateCache:
    """Serves one gathering to every poller that asks within `max_age_s` of it, or while it runs."""

    def __init__(self, gather: Callable[[], Awaitable[dict[str, Any]]], max_age_s: float = STATE_MAX_AGE_S) -> None:
        self.gather = gather
        self.max_age_s = max_age_s
        self._task: asyncio.Task | None = None
        self._at = float("-inf")  # monotonic time the last gathering finished

    async def get(self) -> dict[str, Any]:
        if self._task is None or (self._task.done() and time.monotonic() - self._at > self.max_age_s):
            self._task = asyncio.ensure_future(self._run())
        # shield: a poller that goes away must not cancel the gathering the others wait on
        return await asyncio.shield(self._task)

    async def _run(self) -> dict[str, Any]:
        try:
            return await self.gather()
        finally:
            self._at = time.monotonic()


# --- the HTTP side ---------------------------------------------------------------------------

class Dashboard:
    """The page's handlers and its collectors. `gateway` is the running Gateway (its `nc`,
    `served_model` and `cfg.instance_id` are read when a state is asked for)."""

    def __init__(self, gateway, decisions: int = 50, window_s: int = 300) -> None:
        self.gateway = gateway
        self.decisions = RecentDecisions(decisions)
        self.outcomes = OutcomeSeries(window_s)
        self.tenant_outcomes: dict[str, OutcomeSeries] = {}  # each key book tenant's own, as it first ends a request
        self.ttft_error = RatioSeries(window_s)
        self.cache = StateCache(lambda: cluster_view(self.gateway.nc))
        self._page: bytes | None = None  # the HTML, read once

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/dashboard", self.page)
        app.router.add_get("/dashboard/state", self.state)

    def record(self, outcome: str, tenant: str = "") -> None:
        """A request of `tenant` ("" where the gateway is open: no tenant's own view) ended so."""
        now = time.time()
        self.outcomes.record(outcome, now)
        if tenant:
            if tenant not in self.tenant_outcomes:
                self.tenant_outcomes[tenant] = OutcomeSeries(self.outcomes.window_s)
            self.tenant_outcomes[tenant].record(outcome, now)

    def record_ttft(self, actual_s: float, predicted_s: float) -> None:
        self.ttft_error.record(actual_s / predicted_s, time.time())

    async def on_routed(self, event: Event, msg: Msg) -> None:
        """Subscribed to every `routed` event."""
        self.decisions.add(event)

    async def page(self, request: web.Request) -> web.Response:
        if self._page is None:
            self._page = PAGE.read_bytes()
        return web.Response(body=self._page, content_type="text/html", charset="utf-8",
                            headers={"Cache-Control": "no-cache"})

    async def state(self, request: web.Request) -> web.Response:
        """The JSON the page polls; with API keys configured it takes one (the page asks for it)."""
        tenant = self.gateway.authenticate(request.headers.get("Authorization"))
        if self.gateway.keys.open or tenant.operator:
            view = await self.cache.get()
            now = time.time()
            body = {"scope": "cluster", **view, "decisions": self.decisions.newest_first(),
                    "outcomes": self.outcomes.series(now), "ttft_error": self.ttft_error.series(now)}
        else:  # nothing asked of the cluster: a tenant's view holds nothing but its own requests
            now = time.time()
            own = self.tenant_outcomes.get(tenant.name) or OutcomeSeries(self.outcomes.window_s)
            body = {"scope": "tenant", "tenant": tenant.name, "outcomes": own.series(now),
                    "decisions": [tenant_decision(d) for d in self.decisions.newest_first()
                                  if d.get("tenant") == tenant.name]}
        body |= {"now": now, "gateway": self.gateway.cfg.instance_id, "model": self.gateway.served_model}
        return web.Response(body=orjson.dumps(body), content_type="application/json",
                            headers={"Cache-Control": "no-store"})


def tenant_decision(record: dict[str, Any]) -> dict[str, Any]:
    """A decision as its tenant sees it: its own request's predicted costs, not its candidates'
    (their queues, batches and room are every tenant's load)."""
    return record | {"prefill_costs": [], "decode_costs": []}
