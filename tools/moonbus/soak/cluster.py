"""The soak's view of a running local cluster: its state file, its processes, its shared memory.

`moonbus up` writes `<home>/cluster.json` and rewrites it atomically on every change (a process
restarted, a pid changed), so the soak re-reads it every time it needs pids: for RSS samples and
for chaos kills. An older state file holds only `url` and `nats_url`; every reader here then says
what it cannot do (`ClusterState.missing`) instead of failing.

NATS probes (conductor status, messenger pool status) answer None where no valid reply came:
the caller decides when "unknown" becomes a failure.
"""

from __future__ import annotations

import logging
import os
import random
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence
from urllib.parse import urlparse

import orjson
import psutil

from schemas import subjects
from schemas.codec import WireError
from schemas.pool import PoolStatus
from schemas.workers import StatusReply

log = logging.getLogger(__name__)

CHAOS_KINDS = ("prefill", "decode", "messenger", "cache_index", "conductor", "nats")
SLAB_PREFIX = "slab"  # the messenger's DRAM slab file(s); every other file in the shm dir is request KV


@dataclass(frozen=True, slots=True)
class ProcInfo:
    name: str
    kind: str
    node: str = ""
    pid: int | None = None
    restarts: int = 0
    state: str = "running"  # running | restarting | gave_up


@dataclass(frozen=True)
class ClusterState:
    """cluster.json, typed once; fields the file lacks keep a default and are named in `missing`."""

    url: str = ""
    nats_url: str = ""
    model: str = ""
    home: str = ""
    shm_root: str = ""
    profile: str = ""
    dtype: str = ""  # the workers' (resolved); "" from a cluster.json that predates it
    prefill: int = 0
    decode: int = 0
    coupled: int = 0
    processes: dict[str, ProcInfo] = field(default_factory=dict)  # name -> ProcInfo
    missing: tuple[str, ...] = ()
    nats_credentials: dict[str, str] = field(default_factory=dict)  # NATS user -> its password file (a closed bus)

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> ClusterState:
        wanted = ("url", "nats_url", "model", "home", "shm_root", "profile", "prefill", "decode", "coupled", "processes")
        procs = {}
        for name, p in (obj.get("processes") or {}).items():
            if isinstance(p, dict) and p.get("kind"):
                pid = p.get("pid")
                procs[name] = ProcInfo(name, str(p["kind"]), str(p.get("node") or ""),
                                       int(pid) if isinstance(pid, int) and pid > 0 else None,
                                       int(p.get("restarts") or 0), str(p.get("state") or "running"))
        return cls(str(obj.get("url") or ""), str(obj.get("nats_url") or ""), str(obj.get("model") or ""),
                   str(obj.get("home") or ""), str(obj.get("shm_root") or ""), str(obj.get("profile") or ""),
                   str(obj.get("dtype") or ""), int(obj.get("prefill") or 0), int(obj.get("decode") or 0), int(obj.get("coupled") or 0), procs,
                   tuple(k for k in wanted if k not in obj), dict(obj.get("nats_credentials") or {}))

    @property
    def num_prefill(self) -> int:
        """Instances that prefill (0: the file does not say)."""
        return self.coupled or self.prefill or sum(1 for p in self.processes.values() if p.kind in ("prefill", "coupled"))

    def of_kind(self, kind: str) -> list[ProcInfo]:
        return sorted((p for p in self.processes.values() if p.kind == kind), key=lambda p: p.name)

    def messenger_nodes(self) -> list[str]:
        return sorted({p.node for p in self.processes.values() if p.kind == "messenger" and p.node})

    def restarts_by_kind(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for p in self.processes.values():
            out[p.kind] = out.get(p.kind, 0) + p.restarts
        return out


def read_state(path: Path) -> ClusterState | None:
    """None if the file is absent or unreadable (the caller keeps its last good state)."""
    try:
        obj = orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return None
    return ClusterState.from_dict(obj) if isinstance(obj, dict) else None


def guess_shm_root(nats_url: str) -> str:
    """Where `moonbus up` puts node shm directories when the state file does not say: /dev/shm/moonbus-<nats port>."""
    port = urlparse(nats_url).port
    return f"/dev/shm/moonbus-{port}" if port else ""


# --------------------------------------------------------------------------- sampling


def rss_by_kind(state: ClusterState) -> dict[str, int]:
    """Kind -> largest resident set (bytes) among its live processes now."""
    out: dict[str, int] = {}
    for p in state.processes.values():
        if p.pid is None:
            continue
        try:
            rss = psutil.Process(p.pid).memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        out[p.kind] = max(out.get(p.kind, 0), rss)
    return out


@dataclass(frozen=True)
class ShmUsage:
    """Files under the cluster's shm directory, in bytes actually allocated (st_blocks)."""

    request_files: dict[str, int]  # path under the root -> bytes: request KV files (named <request id>.kv)
    slab_files: int
    slab_bytes: int

    @property
    def request_bytes(self) -> int:
        return sum(self.request_files.values())

    def summary(self) -> dict:
        return {"request_files": len(self.request_files), "request_bytes": self.request_bytes,
                "slab_files": self.slab_files, "slab_bytes": self.slab_bytes}


def scan_shm(root: str) -> ShmUsage | None:
    """None if the directory does not exist (unknown, not empty)."""
    if not root or not os.path.isdir(root):
        return None
    requests: dict[str, int] = {}
    slab_files = slab_bytes = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            try:
                allocated = os.stat(path).st_blocks * 512
            except OSError:  # removed while we walked
                continue
            if name.startswith(SLAB_PREFIX):
                slab_files, slab_bytes = slab_files + 1, slab_bytes + allocated
            else:
                requests[os.path.relpath(path, root)] = allocated
    return ShmUsage(requests, slab_files, slab_bytes)


def dev_shm_used(path: str = "/dev/shm") -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def others_shm_bytes(exclude: str, path: str = "/dev/shm") -> int:
    """Bytes allocated by the files in /dev/shm outside `exclude` (other clusters, other programs).

    /dev/shm is shared by the whole machine: what these files grow by is not this cluster's leak.
    What no visible file explains (an unlinked file still mapped) stays counted.
    """
    total = 0
    for dirpath, dirs, files in os.walk(path):
        if exclude and os.path.abspath(dirpath) == os.path.abspath(exclude):
            dirs.clear()
            continue
        for name in files:
            try:
                total += os.stat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                continue
    return total


def deleted_shm_maps(state: ClusterState, root: str) -> list[str]:
    """"<process>: <file>" for every removed file under `root` (the shm directory) a cluster process still maps.

    Such a file (typically the slab of a messenger that restarted, still mapped by the node's
    workers) keeps its memory, which is what /dev/shm growth with no visible file means.
    """
    out = []
    for p in sorted(state.processes.values(), key=lambda p: p.name):
        if p.pid is None:
            continue
        try:
            maps = psutil.Process(p.pid).memory_maps(grouped=True)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        # psutil drops the kernel's " (deleted)" suffix: a removed file is one whose path is gone
        out += [f"{p.name}: {m.path} (deleted)" for m in maps
                if root and m.path.startswith(root) and not os.path.exists(m.path.removesuffix(" (deleted)"))]
    return out


# --------------------------------------------------------------------------- chaos


@dataclass(frozen=True, slots=True)
class Kill:
    at_s: float
    kind: str
    name: str
    pid: int


def choose_victim(state: ClusterState, kinds: Sequence[str], rng: random.Random) -> ProcInfo | None:
    """A random running process of a random listed kind that has one (None if no kind has)."""
    candidates = {k: [p for p in state.of_kind(k) if p.pid is not None and p.state == "running"] for k in kinds}
    live = sorted(k for k, procs in candidates.items() if procs)
    if not live:
        return None
    return rng.choice(candidates[rng.choice(live)])


def is_cluster_process(p: ProcInfo) -> bool:
    """The pid still runs what the state file says (not a pid reused by something else)."""
    try:
        cmdline = " ".join(psutil.Process(p.pid).cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False
    return "nats-server" in cmdline if p.kind == "nats" else f"services.{p.kind}" in cmdline


def kill(p: ProcInfo, at_s: float) -> Kill | None:
    """SIGKILL `p` if it is still the cluster's process; None if it was not."""
    if p.pid is None or not is_cluster_process(p):
        return None
    try:
        os.kill(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        return None
    log.info("chaos: killed %s (%s, pid %d)", p.name, p.kind, p.pid)
    return Kill(at_s, p.kind, p.name, p.pid)


# --------------------------------------------------------------------------- NATS probes


async def conductor_in_flight(nc, timeout_s: float = 2.0) -> int | None:
    try:
        msg = await nc.request(subjects.CONDUCTOR_STATUS, b"", timeout=timeout_s)
        return StatusReply.from_bytes(msg.data).in_flight
    except Exception as exc:  # no responders, timeout, a reply of another shape
        log.debug("conductor status: %r", exc)
        return None


async def pool_status(nc, node: str, timeout_s: float = 2.0) -> tuple[PoolStatus | None, str]:
    """(status, "") or (None, why): a messenger that does not know the op answers an error reply."""
    try:
        msg = await nc.request(subjects.messenger_control(node, "status"), b"{}", timeout=timeout_s)
    except Exception as exc:
        return None, f"no reply ({type(exc).__name__})"
    try:
        return PoolStatus.from_bytes(msg.data), ""
    except WireError:
        try:
            error = orjson.loads(msg.data).get("error")
        except (orjson.JSONDecodeError, AttributeError):
            error = None
        return None, f"error reply: {error}" if error else f"unreadable reply {msg.data[:80]!r}"
