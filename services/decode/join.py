"""The way into a decode instance's batch: check in, wait for KV room, load, join.

A request whose KV has landed is checked in (the late TBT re-check: reject it now rather than
break the batch's SLO), waits first come first served for KV room (but not for long behind another
tenant's request that does not fit: common/decide/queue_order.py `next_to_admit`), has its KV read
from the node's shared memory into the blocks it holds in the batch's pool on a thread beside the
running steps (LOADS_AT_ONCE at a time, their room held from the start), and joins the batch
between two steps: a few list operations, so the batch never waits for a file.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Protocol

from common import kvfiles, worker
from common.decide.admission import late_verdict
from common.decide.learn import Factor
from common.decide.queue_order import next_to_admit
from common.engine.batch import BatchEngine, RowKv
from schemas.decode import DecodeTask
from services.decode.config import DecodeConfig
from services.decode.keep import Running

log = logging.getLogger(__name__)

LOADS_AT_ONCE = 2  # KV files read into row buffers at the same time, beside the steps


@dataclass
class Loading:
    """A request with room held in the batch whose KV is being read into its row buffer."""

    task: DecodeTask
    job: asyncio.Future  # -> RowKv, from a thread


class Instance(Protocol):
    """What the way in uses of its decode instance (services/decode/batch_loop.py DecodeService)."""

    cfg: DecodeConfig
    engine: BatchEngine
    cancelled: worker.Cancellations
    perf: Any  # common.decide.perf.Profile
    speed: Factor
    metrics: Any  # DecodeMetrics: load_s, room_wait_s
    events: Any  # common.bus.EventPublisher
    running: dict[str, Running]
    arrived_at: worker.Stamps
    wakeup: asyncio.Event
    closed: str

    async def guarded(self, step: Callable[[DecodeTask], Awaitable[None]], task: DecodeTask) -> None: ...

    async def progress(self, kind: str, task: DecodeTask, generated: int = 0) -> None: ...

    async def fail(self, task: DecodeTask, why: str, status: int, retryable: bool) -> None: ...

    async def reject_late(self, task: DecodeTask, why: str) -> None: ...

    def forget(self, request_id: str) -> None: ...


class Joins:
    """The requests a decode instance holds that are not in its batch yet, and their way in."""

    def __init__(self, service: Instance) -> None:
        self.service = service
        self.arrived: asyncio.Queue[DecodeTask] = asyncio.Queue()  # not checked in yet
        self.waiting: collections.deque[DecodeTask] = collections.deque()  # passed the TBT check, no KV room yet
        self.loading: dict[str, Loading] = {}  # request_id -> its KV loading, its room held (oldest first)
        self.passed: dict[str, int] = {}  # request_id -> how often others joined before it, waiting too large

    def __len__(self) -> int:
        return self.arrived.qsize() + len(self.waiting) + len(self.loading)

    def tasks(self) -> list[DecodeTask]:
        return ([e.task for e in self.loading.values()] + list(self.waiting)
                + list(self.arrived._queue))  # noqa: SLF001 - a read-only look

    async def check_in_arrived(self) -> None:
        while not self.arrived.empty():
            await self.service.guarded(self.check_in, self.arrived.get_nowait())

    async def check_in(self, task: DecodeTask) -> None:
        """A request's KV has arrived: the late TBT re-check, then the wait for KV room."""
        service, rid = self.service, task.request_id
        shm_dir = service.cfg.shm_dir
        if service.cancelled.covers(rid, task.attempt):
            kvfiles.remove(shm_dir, task.kv)
            await service.progress("finished", task)
            return
        if service.closed:  # a hand-off that landed after the hand-back: resumed elsewhere too
            kvfiles.remove(shm_dir, task.kv)
            await service.fail(task, service.closed, 503, retryable=True)
            return
        if rid in service.running or rid in self.loading:  # an abandoned attempt of it is held here: the new one wins
            service.forget(rid)
        for old in [t for t in self.waiting if t.request_id == rid]:
            self.waiting.remove(old)
            kvfiles.remove(shm_dir, old.kv)
        engine, cfg = service.engine, service.cfg
        needed, budget = self.needed(task), engine.kv_budget_tokens
        why = late_verdict(engine.admission_state(step_factor=service.speed.value), len(task.prompt_token_ids),
                           needed, budget, service.perf, cfg.tbt_slo_s, check_tbt=cfg.late_check)
        if why == "tbt":
            await service.reject_late(task, f"decode instance {cfg.instance_id} cannot meet the TBT SLO")
        elif why == "kv":
            await service.reject_late(task, f"the request needs {needed} KV tokens; the decode budget is {budget}")
        else:
            self.waiting.append(task)

    def needed(self, task: DecodeTask) -> int:
        return self.service.engine.tokens_needed(len(task.prompt_token_ids), task.sampling, task.num_generated + 1)

    async def admit_waiting(self) -> None:
        """Start loading the KV of the first waiting requests that fit, first come first served,
        except that a request too large for the room left does not block other tenants' requests
        that fit (for a while: `next_to_admit`): each holds its room from now, and loads on a
        thread while the batch steps."""
        engine = self.service.engine
        while self.waiting and len(self.loading) < LOADS_AT_ONCE:
            chosen, passing = next_to_admit(self.waiting, lambda t: t.tenant,
                                            lambda t: engine.can_admit(self.needed(t)),
                                            lambda t: self.passed.get(t.request_id, 0))
            if chosen is None:
                break
            for i in passing:
                rid = self.waiting[i].request_id
                self.passed[rid] = self.passed.get(rid, 0) + 1
            task = self.waiting[chosen]
            del self.waiting[chosen]
            self.passed.pop(task.request_id, None)
            needed = self.needed(task)
            engine.reserve(task.request_id, needed, len(task.prompt_token_ids))
            job = asyncio.ensure_future(asyncio.to_thread(self.load, task))
            job.add_done_callback(self.loaded)
            self.loading[task.request_id] = Loading(task, job)
        if len(self.passed) > len(self.waiting):  # some left otherwise (cancelled, replaced)
            waiting = {t.request_id for t in self.waiting}
            self.passed = {rid: n for rid, n in self.passed.items() if rid in waiting}

    def load(self, task: DecodeTask) -> RowKv:
        """On a thread: the landed file, checked, in the blocks the request holds in the batch's pool."""
        service = self.service
        started = time.perf_counter()
        row = service.engine.load_file(task.request_id, service.cfg.shm_dir, task.kv, task.sampling,
                                       task.num_generated + 1, remove=True)
        service.metrics.load_s.observe(time.perf_counter() - started)
        return row

    def loaded(self, job: asyncio.Future) -> None:
        if not job.cancelled():
            job.exception()  # seen here: a load handed back meanwhile is never joined
        self.service.wakeup.set()

    @property
    def any_loaded(self) -> bool:
        return any(e.job.done() for e in self.loading.values())

    async def join_loaded(self) -> None:
        for entry in [e for e in self.loading.values() if e.job.done()]:
            if self.loading.get(entry.task.request_id) is not entry:  # handed back while an earlier one joined
                continue
            del self.loading[entry.task.request_id]
            await self.service.guarded(functools.partial(self.join, job=entry.job), entry.task)

    async def join(self, task: DecodeTask, job: asyncio.Future) -> None:
        service, rid = self.service, task.request_id
        engine = service.engine
        try:
            row = job.result()
        except (OSError, ValueError) as exc:  # a missing, corrupt or misshapen file (KvChecksumError is a ValueError)
            log.error("request %s: cannot load its KV: %s", rid, exc)
            engine.remove(rid)
            kvfiles.remove(service.cfg.shm_dir, task.kv)  # refused before it was read
            await service.fail(task, f"decode could not load the KV: {exc}", 500, retryable=True)
            return
        if service.cancelled.covers(rid, task.attempt):
            engine.remove(rid)
            await service.progress("finished", task)
            return
        engine.add(rid, row, task.first_token, task.sampling, task.num_generated + 1)
        service.running[rid] = Running(task, [task.first_token])
        waited = service.arrived_at.waited(rid, task.attempt, time.monotonic())
        service.metrics.room_wait_s.observe(waited)
        await service.events.request("decode_joined", rid, waited_s=round(waited, 6), batch=engine.num_running,
                                     attempt=task.attempt)

    async def drop_cancelled(self) -> None:
        service = self.service
        for task in [t for t in self.waiting if service.cancelled.covers(t.request_id, t.attempt)]:
            self.waiting.remove(task)
            kvfiles.remove(service.cfg.shm_dir, task.kv)
            await service.progress("finished", task)

    def forget(self, request_id: str) -> None:
        self.loading.pop(request_id, None)  # its load, if any, finishes unseen (the file is read and removed)

    def clear(self) -> None:
        """Hand back: nothing held here joins (what is loading finishes unseen)."""
        while not self.arrived.empty():
            self.arrived.get_nowait()
        self.waiting.clear()
        self.passed.clear()
        self.loading.clear()
