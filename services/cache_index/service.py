"""Cache index service: keeps block key -> holders (node, tier) exact, answers prefix queries.

Fed by the messengers' numbered KV events. A node is (re)synced from its messenger's snapshot
when it is first seen (so a restarted index rebuilds itself), on a sequence gap, and when its
epoch changes (the messenger restarted and numbers from 1 again), and when its messenger is heard
again after a silence (a node cut off, or this index). A node whose messenger stops sending
heartbeats for longer is dropped: its DRAM is gone with it.
"""

from __future__ import annotations

import asyncio
import logging
import time

from nats.aio.msg import Msg
from nats.errors import NoRespondersError, TimeoutError as NatsTimeout

from prometheus_client import Counter, Gauge, Histogram

from common import bus, health, metrics, runner
from schemas import subjects
from schemas.codec import WireError, check_token
from schemas.events import Event
from schemas.index import IndexDumpReply, IndexDumpRequest, IndexQuery, IndexReply, NodePrefix
from schemas.pool import KvEventData, SnapshotReply
from schemas.workers import WorkerInfo, own_heartbeat
from services.cache_index.config import CacheIndexConfig
from common.decide.index import KINDS, KvEvent, PrefixIndex

log = logging.getLogger(__name__)
SILENCE_RESYNC_S = 3.0  # a messenger heard again after this long (it heartbeats every second) is reloaded


class IndexMetrics:
    def __init__(self, index: PrefixIndex) -> None:
        self.registry = r = metrics.registry()
        Gauge("moonbus_cache_index_blocks", "distinct block keys held somewhere", registry=r).set_function(
            lambda: len(index))
        Gauge("moonbus_cache_index_holdings", "(block, node) pairs held", registry=r).set_function(index.num_holdings)
        Gauge("moonbus_cache_index_nodes", "nodes followed", registry=r).set_function(lambda: len(index.nodes))
        self.resyncs = Counter("moonbus_cache_index_resyncs", "nodes reloaded from their messenger's snapshot",
                               ["reason"], registry=r)
        self.query_s = Histogram("moonbus_cache_index_query_seconds", "prefix queries answered",
                                 buckets=metrics.FAST_BUCKETS, registry=r)
        self.events = Counter("moonbus_cache_index_kv_events", "KV events applied, by kind", ["kind"], registry=r)


class CacheIndexService:
    def __init__(self, cfg: CacheIndexConfig, nc, tasks: runner.TaskGroup) -> None:
        self.cfg = cfg
        self.nc = nc
        self.tasks = tasks
        self.index = PrefixIndex()
        self.metrics = IndexMetrics(self.index)
        self.events = bus.EventPublisher.of(nc, "cache_index", cfg)
        self.epochs: dict[str, str] = {}  # node -> epoch of the events we applied
        self.last_seen: dict[str, float] = {}  # node -> monotonic time of its messenger's last heartbeat
        self.syncing: dict[str, list[KvEvent]] = {}  # node -> events held back while its resync is in flight

    async def on_kv_event(self, msg: Msg) -> None:
        event = Event.from_bytes(msg.data)  # a malformed event raises: logged and dropped by bus.subscribe
        if event.kind not in KINDS:
            return  # e.g. "corrupt": audit only
        data = KvEventData.from_dict(event.data)
        check_token("node", data.node)
        kv_event = KvEvent(data.node, data.seq, event.kind, tuple(data.keys), data.tier)
        if data.node in self.syncing:
            self.syncing[data.node].append(kv_event)  # applied after the snapshot, if newer than it
            return
        if self.epochs.get(data.node) != data.epoch:
            self.start_resync(data.node, "new epoch")
            return
        result = self.index.apply(kv_event)
        self.metrics.events.labels(event.kind).inc()
        if result.resync_needed:
            self.start_resync(data.node, f"gap: expected seq {result.expected_seq}, got {data.seq}")

    async def on_heartbeat(self, msg: Msg) -> None:
        info = own_heartbeat(msg.subject, msg.data)
        if info is None or info.role != "messenger":
            return
        if info.leaving:
            self.forget(info.node, "messenger left")
            return
        now, last = time.monotonic(), self.last_seen.get(info.node)
        self.last_seen[info.node] = now
        if last is None and info.node not in self.epochs:
            self.start_resync(info.node, "first seen")
        elif last is not None and now - last > SILENCE_RESYNC_S:
            # cut off (or we were: then every node is heard again after a silence): its KV events
            # of that time may never have reached us, and a gap would show only at its next event,
            # which may be long in coming
            self.start_resync(info.node, f"silence: heard again after {now - last:.1f} s")

    def start_resync(self, node: str, why: str) -> None:
        if node in self.syncing:
            return
        self.syncing[node] = []
        self.tasks.spawn(self.resync(node, why), f"resync-{node}", essential=False)

    async def resync(self, node: str, why: str) -> None:
        try:
            msg = await bus.request(self.nc, subjects.messenger_control(node, "snapshot"), b"{}",
                                    timeout=self.cfg.resync_timeout_s, attempt_s=bus.ATTEMPT_S)
            snap = SnapshotReply.from_bytes(msg.data)
            self.index.load_snapshot(node, snap.seq, dict(zip(snap.keys, snap.tiers)))
            self.epochs[node] = snap.epoch
            for event in sorted(self.syncing.get(node, []), key=lambda e: e.seq):
                if event.seq > snap.seq:
                    self.index.apply(event)  # a gap here is caught by the next live event
            log.info("node %s resynced (%s): %d blocks at seq %d", node, why, len(snap.keys), snap.seq)
            self.metrics.resyncs.labels(why.split(":")[0]).inc()
            await self.events.instance("resynced", self.cfg.instance_id, node=node, reason=why,
                                       blocks=len(snap.keys), seq=snap.seq)
        except (NoRespondersError, NatsTimeout, ValueError, WireError) as exc:
            log.warning("node %s: resync failed (%r); dropping its entries until it answers", node, exc)
            self.index.drop_node(node)
            self.epochs.pop(node, None)
        finally:
            self.syncing.pop(node, None)

    def forget(self, node: str, why: str) -> None:
        log.info("node %s dropped from the index: %s", node, why)
        self.index.drop_node(node)
        self.epochs.pop(node, None)
        self.last_seen.pop(node, None)

    async def on_query(self, msg: Msg) -> None:
        with self.metrics.query_s.time():
            query = IndexQuery.from_bytes(msg.data)  # malformed: logged and dropped (the asker times out)
            match = self.index.match(query.keys)
            per_node = {n: NodePrefix(m.prefix_len, m.num_dram, m.num_ssd) for n, m in match.per_node.items()}
            await msg.respond(IndexReply(per_node, match.best_len, list(match.best_nodes)).to_bytes())

    async def on_dump(self, msg: Msg) -> None:
        request = IndexDumpRequest.from_bytes(msg.data)
        entries = self.index.node_entries(request.node)
        await msg.respond(IndexDumpReply(request.node, self.index.last_seq(request.node),
                                         list(entries), list(entries.values())).to_bytes())

    async def sweep(self) -> None:
        now = time.monotonic()
        if not self.nc.is_connected or bus.recently_reconnected(self.nc, self.cfg.node_timeout_s):
            # our silence, not the nodes': judge them once we have listened for a whole timeout.
            # last_seen keeps their true last heartbeat, so that each is resynced when heard again
            return
        for node, seen in list(self.last_seen.items()):
            if now - seen > self.cfg.node_timeout_s:
                self.forget(node, "messenger stopped sending heartbeats")

    async def heartbeat(self) -> None:
        await bus.heartbeat(self.nc, WorkerInfo(self.cfg.instance_id, "cache_index", "", num_running=len(self.index)))


async def serve(cfg: CacheIndexConfig, stop: asyncio.Event) -> bool:
    nc = await bus.connect(cfg.nats_url, cfg.instance_id, cfg.nats_auth)
    tasks = runner.TaskGroup(stop)
    service = CacheIndexService(cfg, nc, tasks)
    await bus.subscribe(nc, subjects.KV_EVENTS_ALL, service.on_kv_event)
    await bus.subscribe(nc, subjects.WORKER_HEARTBEAT_ALL, service.on_heartbeat)
    await bus.subscribe(nc, subjects.INDEX_QUERY, service.on_query, queue=subjects.INDEX_QUEUE)
    await bus.subscribe(nc, subjects.INDEX_DUMP, service.on_dump, queue=subjects.INDEX_QUEUE)
    tasks.spawn(runner.every(cfg.heartbeat_interval_s, stop, service.heartbeat), "heartbeat")
    tasks.spawn(runner.every(1.0, stop, service.sweep), "sweep")
    tasks.spawn(bus.watchdog(nc), "broker-watchdog")
    tasks.spawn(health.beacon(cfg.health_file, nc, stop), "health", essential=False)
    metrics.serve(cfg.metrics_port, service.metrics.registry, cfg.metrics_host)
    log.info("cache index %s ready", cfg.instance_id)
    await stop.wait()
    await tasks.cancel_all()
    await bus.shutdown(nc)
    return not tasks.failed
