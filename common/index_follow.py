"""Following the messengers' KV events into a PrefixIndex: the one copy of that logic, run by the
cache index service and by every conductor that keeps its own index (`--prefix-index local`).

Each messenger numbers its KV events 1, 2, 3, ... within an epoch (a new one every time it
starts). A node is (re)loaded from its messenger's snapshot (messenger_control(node, "snapshot"))
  - when it is first seen (heard or sent an event, and never synced: e.g. this process is new),
    and at each of its heartbeats after that until a snapshot has come (one whose snapshot
    failed, e.g. a messenger not answering yet, is asked again at its next heartbeat),
  - when its epoch changes (the messenger restarted and numbers from 1 again),
  - on a gap in its numbers (an event was lost),
  - when its messenger is heard again after a silence (a node cut off, or this process): its
    events of that time may never have reached us, and a gap would show only at its next event.
Events that arrive while the snapshot is asked for are held back and applied after it, those
newer than it. A node whose messenger says it is leaving, or stops sending heartbeats for
`node_timeout_s`, is dropped: its DRAM is gone with it.

What routing sees: a node never synced is not in the index, so it holds nothing (as when the
cache index does not answer); a node being resynced keeps its old entries meanwhile (slightly
stale is better than no cache hits; common/decide/index.py). Only this class writes into its
PrefixIndex, and only on the event loop, between awaits: no lock is needed.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Coroutine, Iterable, Protocol

from nats.aio.msg import Msg
from nats.errors import NoRespondersError, TimeoutError as NatsTimeout

from common import bus
from common.decide.index import KINDS, KvEvent, PrefixIndex
from common.decide.nodes import NodeHolders
from schemas import subjects
from schemas.codec import WireError, check_token
from schemas.events import Event
from schemas.pool import KvEventData, SnapshotReply
from schemas.workers import WorkerInfo

log = logging.getLogger(__name__)
SILENCE_RESYNC_S = 3.0  # a messenger heard again after this long (it heartbeats every second) is reloaded


class TaskOwner(Protocol):
    """Who owns the resync tasks and cancels them on shutdown (common.runner.TaskGroup)."""

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str, essential: bool = True) -> Any: ...


@dataclass(frozen=True, slots=True)
class Resynced:
    """A node reloaded from its messenger's snapshot."""

    node: str
    reason: str  # e.g. "gap: expected seq 5, got 7"; the part before ':' is its kind
    blocks: int
    seq: int  # the event number the snapshot is consistent with

    @property
    def kind(self) -> str:
        return self.reason.split(":")[0]


class IndexFollower:
    """A PrefixIndex kept equal to what the messengers hold, fed by their KV events and heartbeats.

    Wire `on_kv_event` to subjects.KV_EVENTS_ALL, call `heard` with every messenger heartbeat
    (its subject already checked) and `sweep` about every second. `on_applied(kind)` is called for
    every KV event applied, `on_resynced` after every node loaded (for metrics and audit events)."""

    def __init__(self, nc, tasks: TaskOwner, resync_timeout_s: float, node_timeout_s: float,
                 on_applied: Callable[[str], None] | None = None,
                 on_resynced: Callable[[Resynced], Awaitable[None]] | None = None) -> None:
        self.nc = nc
        self.tasks = tasks
        self.resync_timeout_s = resync_timeout_s
        self.node_timeout_s = node_timeout_s
        self.on_applied = on_applied
        self.on_resynced = on_resynced
        self.index = PrefixIndex()
        self.epochs: dict[str, str] = {}  # node -> epoch of the events we applied
        self.last_seen: dict[str, float] = {}  # node -> monotonic time of its messenger's last heartbeat
        self.syncing: dict[str, list[KvEvent]] = {}  # node -> events held back while its resync is in flight
        self.holders_of = NodeHolders()  # which messenger speaks for each node

    def holders(self, keys: Iterable[int]) -> dict[str, int]:
        """node -> leading blocks of `keys` it holds (any tier); nodes holding none are left out."""
        return {node: m.prefix_len for node, m in self.index.match(keys).per_node.items() if m.prefix_len}

    async def on_kv_event(self, event: Event, msg: Msg) -> None:
        if event.kind not in KINDS:
            return  # e.g. "corrupt": audit only
        data = KvEventData.from_dict(event.data)
        check_token("node", data.node)
        if not subjects.speaks_for(msg.subject, data.node):  # only a node's own messenger may publish there
            log.warning("KV event for node %s on subject %s dropped: not that node's subject", data.node, msg.subject)
            return
        kv_event = KvEvent(data.node, data.seq, event.kind, tuple(data.keys), data.tier)
        if data.node in self.syncing:
            self.syncing[data.node].append(kv_event)  # applied after the snapshot, if newer than it
            return
        if self.epochs.get(data.node) != data.epoch:
            self.start_resync(data.node, "new epoch")
            return
        result = self.index.apply(kv_event)
        if self.on_applied is not None:
            self.on_applied(event.kind)
        if result.resync_needed:
            self.start_resync(data.node, f"gap: expected seq {result.expected_seq}, got {data.seq}")

    def heard(self, info: WorkerInfo) -> bool:
        """A heartbeat (any role's: only messengers' count), its subject already checked; False
        for a messenger that speaks for a node another messenger holds (ignored: the caller counts
        it as a spoof)."""
        if info.role != "messenger":
            return True
        if not self.holders_of.claim(info.node, info.instance_id):
            return False
        if info.leaving:
            self.forget(info.node, "messenger left")
            return True
        now, last = time.monotonic(), self.last_seen.get(info.node)
        self.last_seen[info.node] = now
        if info.node not in self.epochs:  # never synced, or its last resync failed: ask (again)
            self.start_resync(info.node, "first seen" if last is None else "not synced yet")
        elif last is not None and now - last > SILENCE_RESYNC_S:
            # cut off (or we were: then every node is heard again after a silence): its KV events
            # of that time may never have reached us, and a gap would show only at its next event,
            # which may be long in coming
            self.start_resync(info.node, f"silence: heard again after {now - last:.1f} s")
        return True

    def start_resync(self, node: str, why: str) -> None:
        if node in self.syncing:
            return
        self.syncing[node] = []
        self.tasks.spawn(self.resync(node, why), f"resync-{node}", essential=False)

    async def resync(self, node: str, why: str) -> None:
        try:
            msg = await bus.request(self.nc, subjects.messenger_control(node, "snapshot"), b"{}",
                                    timeout=self.resync_timeout_s, attempt_s=bus.ATTEMPT_S)
            snap = SnapshotReply.from_bytes(msg.data)
            self.index.load_snapshot(node, snap.seq, dict(zip(snap.keys, snap.tiers)))
            self.epochs[node] = snap.epoch
            for event in sorted(self.syncing.get(node, []), key=lambda e: e.seq):
                if event.seq > snap.seq:
                    self.index.apply(event)  # a gap here is caught by the next live event
            log.info("node %s resynced (%s): %d blocks at seq %d", node, why, len(snap.keys), snap.seq)
        except (NoRespondersError, NatsTimeout, ValueError, WireError) as exc:
            log.warning("node %s: resync failed (%r); dropping its entries until it answers", node, exc)
            self.index.drop_node(node)
            self.epochs.pop(node, None)
            return
        finally:
            self.syncing.pop(node, None)
        if self.on_resynced is not None:
            await self.on_resynced(Resynced(node, why, len(snap.keys), snap.seq))

    def forget(self, node: str, why: str) -> None:
        log.info("node %s dropped from the index: %s", node, why)
        self.index.drop_node(node)
        self.epochs.pop(node, None)
        self.last_seen.pop(node, None)
        self.holders_of.forget(node)

    def sweep(self) -> None:
        """Drop the nodes whose messengers stopped sending heartbeats (call about every second)."""
        now = time.monotonic()
        if not self.nc.is_connected or self.nc.recently_reconnected(self.node_timeout_s):
            # our silence, not the nodes': judge them once we have listened for a whole timeout.
            # last_seen keeps their true last heartbeat, so that each is resynced when heard again
            return
        for node, seen in list(self.last_seen.items()):
            if now - seen > self.node_timeout_s:
                self.forget(node, "messenger stopped sending heartbeats")
