"""Cache index service: keeps block key -> holders (node, tier) exact, answers prefix queries.

Fed by the messengers' numbered KV events, followed by common/index_follow.py (the same code a
conductor with its own copy of the index runs): a node is (re)synced from its messenger's
snapshot when it is first seen (so a restarted index rebuilds itself), on a sequence gap, when
its epoch changes, and when its messenger is heard again after a silence; a node whose messenger
stops sending heartbeats for longer is dropped. This service adds the answers: prefix queries
(conductors with `--prefix-index remote`) and per-node dumps, its metrics and `resynced` events.
"""

from __future__ import annotations

import asyncio
import logging

from nats.aio.msg import Msg

from prometheus_client import Counter, Gauge, Histogram

from common import bus, health, metrics, runner
from common.index_follow import IndexFollower, Resynced
from schemas import subjects
from schemas.index import IndexDumpReply, IndexDumpRequest, IndexQuery, IndexReply, NodePrefix
from schemas.events import Event
from schemas.workers import WorkerInfo
from services.cache_index.config import CacheIndexConfig
from common.decide.index import PrefixIndex

log = logging.getLogger(__name__)


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
        self.spoofed = Counter("moonbus_cache_index_spoofed", "messenger heartbeats ignored because they speak for a "
                               "node another messenger holds", registry=r)


class CacheIndexService:
    def __init__(self, cfg: CacheIndexConfig, nc, tasks: runner.TaskGroup) -> None:
        self.cfg = cfg
        self.nc = nc
        self.events = bus.EventPublisher.of(nc, "cache_index", cfg)
        self.follower = IndexFollower(nc, tasks, cfg.resync_timeout_s, cfg.node_timeout_s,
                                      on_applied=self.applied, on_resynced=self.resynced)
        self.index = self.follower.index
        self.metrics = IndexMetrics(self.index)

    def applied(self, kind: str) -> None:
        self.metrics.events.labels(kind).inc()

    async def resynced(self, done: Resynced) -> None:
        self.metrics.resyncs.labels(done.kind).inc()
        await self.events.instance("resynced", self.cfg.instance_id, node=done.node, reason=done.reason,
                                   blocks=done.blocks, seq=done.seq)

    async def on_heartbeat(self, info: WorkerInfo, msg: Msg) -> None:
        if subjects.speaks_for(msg.subject, info.role, info.instance_id) and not self.follower.heard(info):
            self.metrics.spoofed.inc()

    async def on_query(self, query: IndexQuery, msg: Msg) -> None:
        """A malformed query is dropped (bus.receive): its asker times out."""
        with self.metrics.query_s.time():
            match = self.index.match(query.keys)
            per_node = {n: NodePrefix(m.prefix_len, m.num_dram, m.num_ssd) for n, m in match.per_node.items()}
            await msg.respond(IndexReply(per_node, match.best_len, list(match.best_nodes)).to_bytes())

    async def on_dump(self, request: IndexDumpRequest, msg: Msg) -> None:
        entries = self.index.node_entries(request.node)
        await msg.respond(IndexDumpReply(request.node, self.index.last_seq(request.node),
                                         list(entries), list(entries.values())).to_bytes())

    async def sweep(self) -> None:
        self.follower.sweep()

    async def heartbeat(self) -> None:
        await bus.heartbeat(self.nc, WorkerInfo(self.cfg.instance_id, "cache_index", "", num_running=len(self.index)))


async def serve(cfg: CacheIndexConfig, stop: asyncio.Event) -> bool:
    nc = await bus.connect(cfg.nats_url, cfg.instance_id, cfg.nats_auth)
    tasks = runner.TaskGroup(stop)
    service = CacheIndexService(cfg, nc, tasks)
    await bus.receive(nc, subjects.KV_EVENTS_ALL, Event, service.follower.on_kv_event, background=True)
    await bus.receive(nc, subjects.WORKER_HEARTBEAT_ALL, WorkerInfo, service.on_heartbeat, background=True)
    await bus.receive(nc, subjects.INDEX_QUERY, IndexQuery, service.on_query, queue=subjects.INDEX_QUEUE)
    await bus.receive(nc, subjects.INDEX_DUMP, IndexDumpRequest, service.on_dump, queue=subjects.INDEX_QUEUE)
    tasks.spawn(runner.every(cfg.heartbeat_interval_s, stop, service.heartbeat), "heartbeat")
    tasks.spawn(runner.every(1.0, stop, service.sweep), "sweep")
    tasks.spawn(bus.watchdog(nc), "broker-watchdog")
    tasks.spawn(health.beacon(cfg.health_file, nc, stop), "health", essential=False)
    metrics.serve(cfg.metrics_port, service.metrics.registry, cfg.metrics_host)
    log.info("cache index %s ready", cfg.instance_id)
    await runner.serving(stop)
    await tasks.cancel_all()
    await bus.shutdown(nc)
    return not tasks.failed
