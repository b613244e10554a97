"""The machine's cores, shared among the workers computing on it at this moment.

A prefill instance computes in bursts; a decode instance steps for as long as it holds requests.
A fixed split leaves cores idle whenever one side waits (a decode instance with one core of two
while prefill idles, or the reverse), so every worker asks, before each unit of work (a decode
step, a prefill layer), how many of the machine's cores are its own now: the cores divided among
the workers busy at this moment, the remainder to decode instances first (they hold the batch's
TBT), then by slot. Alone, a worker gets every core; beside a busy one, half.

How they know of each other: one small file in shared memory per user (`/dev/shm/moonbus-cores-40-<uid>`,
mode 0600), a fixed array of slots, one per worker process on the machine, each holding the
worker's pid, role, since when it computes (0: idle) and, for a prefill instance, the arrival and
TTFT deadline of the most urgent request waiting in its queue (a decode instance yields to it once
it has waited long enough, while its TBT has room: common/decide/yielding.py). A worker writes its own slot only (no
lock on the hot path; a slot is claimed under an flock); a slot whose process is gone, or busy
for longer than STALE_S without a word (a worker killed mid-step), is ignored. Containers with
their own /dev/shm see only their own workers, inside their own CPU limits.

Threads: a worker computes on ONE thread of its own (`ComputeThread`: its model's loading, its
decode steps, its prefills), and torch.set_num_threads in that thread, when its share changed.
Every other thread of the process (the event loop's, the default executor's, the KV streamers)
computes on one torch thread (`helper_thread`): OpenMP gives each thread that runs a parallel
region a team of its own, and once a process holds more of its threads than the machine has
cores, libgomp stops spinning almost at once (100 spins) wherever a team waits. Measured on the
served decode instance (2 cores, bf16, batch 16): steps on the default executor, beside the teams
the model's loading and the KV pool's allocation had made, took 43 ms with 1.3 cores busy; on one
compute thread, 36 ms with 1.7. OpenMP's
threads spin a short while when they wait, then sleep (GOMP_SPINCOUNT=SHARED_SPIN_COUNT, set by
`moonbus up` for workers that share the cores): long enough to span the gaps between the parallel
regions of one step (an operator's Python between two matmuls), short enough (about a quarter of
a millisecond) not to hold a core another worker was given once the unit of work is done. Measured
on 2 cores (AMD EPYC, bf16), a decode step at batch 16 with 512 tokens of context each: 36.7 ms
with this spin, 37 ms with OpenMP's default (spinning up to 300,000 times), 45-51 ms with
OMP_WAIT_POLICY=PASSIVE (no spin: every region wakes its threads from sleep, 1.4 cores busy of 2).
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import mmap
import os
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger(__name__)

SLOTS = 64
# pid, role (0 prefill, 1 decode, 2 coupled), busy since (monotonic; 0 idle), and the work most
# urgently waiting behind its current unit: a prefill instance's queued request with the first
# TTFT deadline, its arrival and deadline (wall clock; 0, 0: none) (`waiting`, read by `prefill_urgent`)
SLOT = struct.Struct("<qqddd")
BUSY = struct.Struct("<qqd")  # a slot's first three fields: claim and release leave the waiting request
WAITING = struct.Struct("<dd")
WAITING_AT = struct.calcsize("<qqd")  # the waiting request's offset in a slot
ROLES = {"prefill": 0, "decode": 1, "coupled": 2}
STALE_S = 30.0  # a unit of work never takes this long: a busy slot older than this is a dead worker's
SHARED_SPIN_COUNT = "10000"  # GOMP_SPINCOUNT for workers that share the cores (the docstring's measurement)
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # how OpenMP's threads wait, as the environment says


def wait_setting(env: dict[str, str] | os._Environ) -> str:
    """How OpenMP's threads wait in a process with environment `env` ("" when OpenMP's default), as
    a profile records it: a profile is measured with the wait its workers run with."""
    return " ".join(f"{name}={env[name]}" for name in WAIT_VARIABLES if env.get(name))


def machine_cores() -> int:
    """The cores this process may run on (its CPU affinity: a cpuset's, a container's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_path() -> Path:
    # the slot's size in the name: workers of a build whose slots differ keep files of their own
    return Path("/dev/shm") / f"moonbus-cores-{SLOT.size}-{os.getuid()}"


class CoreShare:
    """This worker's share of the machine's cores; `claim()` before each unit of work, `release()`
    when it has none. Thread-safe enough for one computing thread per process."""

    def __init__(self, role: str, path: Path | None = None, cores: int | None = None) -> None:
        if role not in ROLES:
            raise ValueError(f"role {role!r} is not one of {tuple(ROLES)}")
        self.role, self.cores = ROLES[role], cores or machine_cores()
        self.path = path or default_path()
        self.pid = os.getpid()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            if os.fstat(fd).st_uid != os.getuid():
                raise PermissionError(f"{self.path} belongs to another user")
            if os.fstat(fd).st_size < SLOTS * SLOT.size:
                os.ftruncate(fd, SLOTS * SLOT.size)
            self.map = mmap.mmap(fd, SLOTS * SLOT.size)
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                self.slot = self._free_slot()
                SLOT.pack_into(self.map, self.slot * SLOT.size, self.pid, self.role, 0.0, 0.0, 0.0)
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
        self.threads = 0  # the share last claimed

    def _free_slot(self) -> int:
        for i in range(SLOTS):
            pid = SLOT.unpack_from(self.map, i * SLOT.size)[0]
            if pid == 0 or (pid != self.pid and not _alive(pid)):  # free, or its process is gone
                return i
        raise RuntimeError(f"all {SLOTS} core-share slots of {self.path} are held by live processes")

    def share(self, now: float | None = None) -> int:
        """Threads this worker may use now, were it busy: the cores over the busy workers, the
        remainder to decode (and coupled) instances first, then by slot."""
        now = time.monotonic() if now is None else now
        busy = []  # (priority, slot) of every busy worker, this one included
        for i in range(SLOTS):
            pid, role, since, _, _ = SLOT.unpack_from(self.map, i * SLOT.size)
            if i == self.slot:
                busy.append((0 if self.role else 1, i))
            elif pid and since and now - since < STALE_S:
                busy.append((0 if role else 1, i))
        busy.sort()
        each, extra = divmod(self.cores, len(busy))
        mine = busy.index((0 if self.role else 1, self.slot))
        return max(1, each + (1 if mine < extra else 0))

    def waiting(self, arrival: float, deadline: float) -> None:
        """Say which work waits most urgently behind this worker's current unit (a prefill instance:
        the arrival and TTFT deadline of its queued request whose deadline comes first; 0, 0 when
        none has one), for the decode instances that yield to it (`prefill_urgent`)."""
        WAITING.pack_into(self.map, self.slot * SLOT.size + WAITING_AT, arrival, deadline)

    def prefill_urgent(self) -> list[tuple[float, float]]:
        """(arrival, deadline) of the most urgent request waiting at each live prefill instance on
        this machine that has one (common/decide/yielding.py `yield_due`)."""
        out = []
        for i in range(SLOTS):
            pid, role, _, arrival, deadline = SLOT.unpack_from(self.map, i * SLOT.size)
            if pid and role == ROLES["prefill"] and deadline > 0 and i != self.slot and _alive(pid):
                out.append((arrival, deadline))
        return out

    def claim(self) -> int:
        """Mark this worker busy and set torch's threads in this thread to its share; returns it."""
        import torch

        now = time.monotonic()
        BUSY.pack_into(self.map, self.slot * SLOT.size, self.pid, self.role, now)
        threads = self.share(now)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        self.threads = threads
        return threads

    def release(self) -> None:
        BUSY.pack_into(self.map, self.slot * SLOT.size, self.pid, self.role, 0.0)

    def close(self) -> None:
        SLOT.pack_into(self.map, self.slot * SLOT.size, 0, 0, 0.0, 0.0, 0.0)
        self.map.close()


def for_worker(role: str, threads: int) -> CoreShare | None:
    """A worker's share of the cores when it follows the work (`--threads 0`); None when it runs a
    fixed number of threads, or when the share file cannot be used (then torch's own default)."""
    if threads:
        return None
    try:
        return CoreShare(role)
    except (OSError, RuntimeError) as exc:
        log.warning("cores are not shared with the other workers (%s); torch's default threads", exc)
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # gone, or not a pid at all
        return False
    except PermissionError:  # another user's: alive
        return True
    return True


def helper_thread() -> None:
    """This thread computes on one torch thread: run first in every thread of a worker process but
    its compute thread (the module's docstring says why)."""
    _this_thread_computes_on(1)


def _this_thread_computes_on(threads: int) -> None:
    import torch

    torch.get_num_threads()  # NOTE: a thread takes torch's latest process-wide setting at its first parallel call: taken now
    torch.set_num_threads(threads)


class ComputeThread:
    """The one thread a worker process computes on; `threads` > 0 fixes its torch threads, else its
    CoreShare sets them before each unit of work. `start` also makes every other thread of the
    process a helper (helper_thread): the event loop's and its default executor's."""

    def __init__(self, threads: int = 0) -> None:
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="compute", initializer=_this_thread_computes_on,
                                           initargs=(threads or machine_cores(),))

    @classmethod
    def start(cls, threads: int = 0) -> "ComputeThread":
        """From the worker's event loop, before anything computes."""
        helper_thread()
        asyncio.get_running_loop().set_default_executor(
            ThreadPoolExecutor(thread_name_prefix="helper", initializer=helper_thread))
        return cls(threads)

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def close(self) -> None:
        self.executor.shutdown(wait=False)
