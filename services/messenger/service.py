"""Messenger: one per node. Owns the node's KV pool and moves KV between nodes.

Control (NATS, messenger_control(node, op)), dispatched through one table:
  accept / abort   reserve (or drop) the destination of a streamed handoff in this node's memory
                   (prefill -> decode, handoff.py: the prefill writes each layer slice into it)
  lookup / reserve / commit / release   the node pool (see node_pool.py)
  pull      fetch blocks from another node's messenger and keep them (hot-block replication, pulls.py)
  snapshot  everything the node holds, for the cache index
  status    occupancy, pins by holder and request files (what a leak check reads)
Bytes: the point-to-point transports (common/transport: tcp, rdma; `--transport`), serving this
node's registered regions (its slab, read-only; handoff destinations) to peers that prove the
cluster secret. KV events: numbered, published in order by one outbox task.

Nothing outlives its owner: pins are keyed by holder process (schemas.pool), so the pins of a
worker of this node that left, restarted (new incarnation) or went silent are released; handoff
reservations die with their prefill process, their decode instance or their idle lease
(handoff.py); request files are swept when their owner restarts (common/kvfiles.py) and, as a
last resort, by age.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

from nats.aio.msg import Msg

from prometheus_client import Counter, Gauge, Histogram

from common import bus, health, kvfiles, metrics, models, runner, security, worker
from common.decide.pool import capacity_in_blocks
from common.transport import Transports
from common.transport.refusals import Refusals
from schemas import subjects
from schemas.codec import Wire
from schemas.codec import WireError
from schemas.pool import (
    CommitRequest, LookupReply, LookupRequest, PoolReply, PoolStatus, PullRequest, ReleaseRequest, ReserveReply,
    ReserveRequest, SnapshotReply,
)
from schemas.transfer import AbortKv, AcceptKv, AcceptKvReply
from schemas.workers import Alive, Layout, WorkerInfo
from services.messenger.config import MessengerConfig
from services.messenger.handoff import Reservations
from services.messenger.node_pool import NodePool, PoolEvent
from services.messenger.pulls import Pulls

log = logging.getLogger(__name__)
REFUSAL_EVENT_S = 10.0  # one link_refused event per refused source network per this long


class MessengerMetrics:
    def __init__(self, pool: NodePool) -> None:
        self.registry = r = metrics.registry()
        self.bytes = Counter("moonbus_messenger_bytes", "KV bytes moved, by peer node, transport and direction",
                             ["peer", "transport", "direction"], registry=r)
        self.transfer_s = Histogram("moonbus_messenger_transfer_seconds", "KV transfers (pull: blocks fetched "
                                    "for replication)", ["op"], buckets=metrics.SLOW_BUCKETS, registry=r)
        self.link_refused = Counter("moonbus_messenger_link_refused", "connections the KV transport refused "
                                    "(no proof of the cluster secret, too many at once)", registry=r)
        self.reserved = Gauge("moonbus_messenger_handoff_reservations", "handoff destinations reserved in this "
                              "node's memory, not complete yet", registry=r)
        blocks = Gauge("moonbus_messenger_pool_blocks", "blocks held, by tier", ["tier"], registry=r)
        blocks.labels("dram").set_function(lambda: pool.pool.num_dram)
        blocks.labels("ssd").set_function(lambda: pool.pool.num_ssd)
        capacity = Gauge("moonbus_messenger_pool_capacity_blocks", "capacity, by tier", ["tier"], registry=r)
        capacity.labels("dram").set(pool.pool.dram_capacity_blocks)
        capacity.labels("ssd").set(pool.pool.ssd_capacity_blocks)
        Gauge("moonbus_messenger_pinned_blocks", "blocks pinned by a reader or writer", registry=r).set_function(
            lambda: pool.num_pinned)
        self.pool_events = Counter("moonbus_messenger_pool_events", "pool changes, by kind (stored, evicted, "
                                   "promoted, demoted, corrupt) and tier", ["kind", "tier"], registry=r)


class MessengerService:
    def __init__(self, cfg: MessengerConfig, nc, tasks: runner.TaskGroup, pool: NodePool, max_kv_tokens: int,
                 transports: Transports) -> None:
        self.cfg = cfg
        self.max_kv_tokens = max_kv_tokens  # the model's context: no request's KV is longer
        self.transports = transports  # peers must prove they hold the cluster secret
        self.layout = Layout(cfg.model, cfg.block_tokens, 0, pool.layout.signature)  # what the cluster checks
        self.nc = nc
        self.tasks = tasks
        self.pool = pool
        self.events = bus.EventPublisher.of(nc, "messenger", cfg)
        self.metrics = MessengerMetrics(pool)
        self.outbox: asyncio.Queue[PoolEvent] = asyncio.Queue()  # KV events, published in seq order
        self.transfer_addr = ""  # tcp host:port of this node's transports
        self.peers: dict[str, tuple[dict[str, str], float]] = {}  # node -> (transport endpoints, last heartbeat, monotonic)
        self.hold_since: dict[str, float] = {}  # hold -> when it first pinned blocks (lease)
        self.workers: dict[str, tuple[str, float]] = {}  # instance on this node -> (incarnation, last heartbeat)
        self.own_holder = f"{cfg.instance_id}:{pool.epoch}"  # pins the messenger makes itself (pulls)
        self.reservations = Reservations(cfg.node, cfg.shm_dir, pool.layout, max_kv_tokens, transports,
                                         cfg.reserve_idle_s, self.count_handoff)
        self.seen: dict[str, tuple[str, float]] = {}  # prefill/decode instance anywhere -> (incarnation, last heartbeat)
        self.pulls: Pulls | None = None  # set by serve(): it needs the running loop
        self.replies = bus.Replies()  # control ops asked again after a lost reply run once
        self.refusals = Refusals(REFUSAL_EVENT_S)  # which refused connections are audited
        self.loop: asyncio.AbstractEventLoop | None = None
        # op -> (handler, runs as its own task); slow ops must not hold up the others
        self.ops: dict[str, tuple[Callable[[bytes], Awaitable[Wire]], bool]] = {
            "accept": (self.op_accept, True),
            "abort": (self.op_abort, True),
            "pull": (self.op_pull, True),
            "lookup": (self.op_lookup, False),
            "reserve": (self.op_reserve, False),
            "commit": (self.op_commit, False),
            "release": (self.op_release, False),
            "snapshot": (self.op_snapshot, False),
            "status": (self.op_status, False),
        }

    # --- control (NATS) -------------------------------------------------------------------
    async def on_control(self, msg: Msg) -> None:
        op = msg.subject.rsplit(".", 1)[-1]
        entry = self.ops.get(op)
        if entry is None:
            await msg.respond(PoolReply(False, f"unknown messenger op {op!r}").to_bytes())
            return
        handler, own_task = entry
        if own_task:
            self.tasks.spawn(self.answer(msg, handler), f"messenger-{op}", essential=False)
        else:
            await self.answer(msg, handler)

    async def answer(self, msg: Msg, handler: Callable[[bytes], Awaitable[Wire]]) -> None:
        """Run the op once per call (a repeat of a call whose reply was lost gets the same answer:
        bus.Replies) and answer; a failure is an error reply, never a hang."""
        async def run() -> bytes:
            try:
                reply = await handler(msg.data)
            except WireError as exc:  # a malformed request: answered, logged, dropped
                log.warning("messenger op %s: malformed request: %s", msg.subject, exc)
                reply = PoolReply(False, f"malformed request: {exc}")
            except Exception as exc:
                log.exception("messenger op %s failed", msg.subject)
                reply = PoolReply(False, f"{type(exc).__name__}: {exc}")
            return reply.to_bytes()

        await self.replies.answer(msg, run)

    async def on_heartbeat(self, info: WorkerInfo, msg: Msg) -> None:
        if not subjects.speaks_for(msg.subject, info.role, info.instance_id):
            return  # one instance speaking for another: the conductor audits it
        if info.role in ("prefill", "decode"):
            if info.node == self.cfg.node:
                self.track_worker(info)
            await self.track_reserver(info)
        if info.role != "messenger" or info.node == self.cfg.node:
            return
        if info.leaving:
            self.peers.pop(info.node, None)
        else:
            self.peers[info.node] = (info.endpoints or {"tcp": info.transfer_addr}, time.monotonic())

    async def on_alive(self, alive: Alive, msg: Msg) -> None:
        """A worker's liveness beacon (a thread of its own): a prefill busy with a long prompt may
        send no heartbeat for seconds, and its reservations and pins must not go with it."""
        if not subjects.speaks_for(msg.subject, alive.instance_id):
            return
        now = time.monotonic()
        for table in (self.seen, self.workers):
            known = table.get(alive.instance_id)
            if known is not None and known[0] == alive.incarnation:
                table[alive.instance_id] = (known[0], now)

    async def track_reserver(self, info: WorkerInfo) -> None:
        """Handoff reservations die with their prefill process (on any node) or their decode instance."""
        known = self.seen.get(info.instance_id)
        self.seen[info.instance_id] = (info.incarnation, time.monotonic())
        gone = []
        if known is not None and known[0] != info.incarnation:  # restarted: its predecessor's are orphans
            gone += self.reservations.of_holder(f"{info.instance_id}:{known[0]}")
        if info.leaving:
            gone += self.reservations.of_holder(info.holder)
            self.seen.pop(info.instance_id, None)
        if info.role == "decode" and (info.leaving or (known is not None and known[0] != info.incarnation)):
            gone += self.reservations.of_decode(info.instance_id)
        for region in set(gone):
            await asyncio.to_thread(self.reservations.drop, region, f"{info.instance_id} left or restarted")

    def track_worker(self, info: WorkerInfo) -> None:
        """A worker of this node: when it leaves or comes back as a new process, its old pins go."""
        known = self.workers.get(info.instance_id)
        if known is not None and known[0] != info.incarnation:
            self.release_holder(f"{info.instance_id}:{known[0]}", "restarted")
        if info.leaving:
            self.release_holder(info.holder, "left")
            self.workers.pop(info.instance_id, None)
        else:
            self.workers[info.instance_id] = (info.incarnation, time.monotonic())

    def release_holder(self, holder: str, why: str) -> None:
        events = self.pool.release_holder(holder)
        for hold in [h for h in self.hold_since if h.split("/", 1)[0] == holder]:
            del self.hold_since[hold]
        if events:
            log.warning("released the pins of %s (%s)", holder, why)
        self.publish(events)

    # --- the pool ops -----------------------------------------------------------------------
    async def op_lookup(self, data: bytes) -> LookupReply:
        req = LookupRequest.from_bytes(data)
        found, events = self.pool.lookup(req.hold_key, req.keys)
        self.publish(events)
        if found:
            self.hold_since.setdefault(req.hold_key, time.monotonic())
        return LookupReply(found, str(self.pool.slab_path))

    async def op_reserve(self, data: bytes) -> ReserveReply:
        req = ReserveRequest.from_bytes(data)
        slots, events = self.pool.reserve(req.hold_key, req.keys, req.first_depth)
        self.publish(events)
        if slots:
            self.hold_since.setdefault(req.hold_key, time.monotonic())
        return ReserveReply(slots, str(self.pool.slab_path))

    async def op_commit(self, data: bytes) -> PoolReply:
        req = CommitRequest.from_bytes(data)
        self.publish(self.pool.commit(req.hold_key, req.blocks))
        return PoolReply(True, num_blocks=len(req.blocks))

    async def op_release(self, data: bytes) -> PoolReply:
        req = ReleaseRequest.from_bytes(data)
        self.publish(self.pool.release(req.hold_key, req.corrupt))
        self.hold_since.pop(req.hold_key, None)
        return PoolReply(True)

    async def op_status(self, data: bytes) -> PoolStatus:
        files, nbytes = kvfiles.usage(self.cfg.shm_dir)
        pool = self.pool.pool
        return PoolStatus(self.cfg.node, self.pool.epoch, str(self.pool.slab_path), pool.dram_capacity_blocks,
                          pool.num_dram, pool.ssd_capacity_blocks, pool.num_ssd, self.pool.num_pinned,
                          self.pool.holders(), files, nbytes)

    async def op_snapshot(self, data: bytes) -> SnapshotReply:
        seq, held = self.pool.snapshot()
        return SnapshotReply(self.cfg.node, self.pool.epoch, seq, list(held), list(held.values()))

    async def op_pull(self, data: bytes) -> PoolReply:
        """Fetch blocks from a peer and keep them here (replication of hot blocks, pulls.py)."""
        req = PullRequest.from_bytes(data)
        endpoints = await self.peer_endpoints(req.source_node)
        if endpoints is None:
            return PoolReply(False, f"no live messenger on node {req.source_node}")
        reply, transport = await self.pulls.pull(req, endpoints)
        self.metrics.bytes.labels(req.source_node, transport, "in").inc(reply.nbytes)
        self.metrics.transfer_s.labels("pull").observe(reply.seconds)
        return reply

    # --- the streamed handoff (prefill -> this node's decode; handoff.py) ----------------------------
    async def op_accept(self, data: bytes) -> AcceptKvReply:
        req = AcceptKv.from_bytes(data)
        region = await asyncio.to_thread(self.reservations.accept, req, req.src_node)
        self.seen.setdefault(req.holder.split(":", 1)[0], (req.holder.split(":", 1)[1], time.monotonic()))
        self.metrics.reserved.set(len(self.reservations.held))
        return AcceptKvReply(True, region)

    async def op_abort(self, data: bytes) -> PoolReply:
        req = AbortKv.from_bytes(data)
        dropped = await asyncio.to_thread(self.reservations.abort, req.request_id, req.attempt, req.dest_instance)
        self.metrics.reserved.set(len(self.reservations.held))
        return PoolReply(True, num_blocks=int(dropped))

    def count_handoff(self, src_node: str, nbytes: int) -> None:
        """A handoff completed (a connection thread): its bytes came in over the transports."""
        self.metrics.bytes.labels(src_node or "?", self.transports.label, "in").inc(nbytes)

    async def peer_endpoints(self, node: str) -> dict[str, str] | None:
        """The transport endpoints of `node`'s messenger; waits a little for one that just started,
        and up to the peer timeout for a heartbeat of one we know (e.g. right after a broker outage)."""
        wait = self.cfg.peer_timeout_s if node in self.peers else 2 * self.cfg.heartbeat_interval_s
        deadline = time.monotonic() + wait
        while True:
            entry = self.peers.get(node)
            if entry is not None and time.monotonic() - entry[1] <= self.cfg.peer_timeout_s:
                return entry[0]
            if time.monotonic() > deadline:
                return None
            await asyncio.sleep(0.05)

    def on_refused(self, peer: str, reason: str) -> None:
        """The transport refused a connection (from a connection thread): counted, and audited as a
        `link_refused` event at most once per source network every REFUSAL_EVENT_S and for a few
        sources in that time, with the counts since (common/transport/refusals.py), so that a
        flood of strangers, from as many addresses as they like, cannot flood the audit log."""
        self.metrics.link_refused.inc()
        self.loop.call_soon_threadsafe(self._audit_refusal, peer, reason)

    def _audit_refusal(self, peer: str, reason: str) -> None:
        told = self.refusals.refused(peer.rsplit(":", 1)[0], time.monotonic())
        if told is None:
            return
        self.tasks.spawn(self.events.instance("link_refused", self.cfg.instance_id, node=self.cfg.node, peer=peer,
                                              reason=reason, source=told.source, refusals_since_last=told.untold,
                                              refusals_from_sources_not_audited=told.untold_elsewhere),
                         "link-refused-event", essential=False)

    # --- events and housekeeping -------------------------------------------------------------
    def publish(self, events: list[PoolEvent]) -> None:
        for event in events:
            self.metrics.pool_events.labels(event.kind, event.data.tier).inc(len(event.data.keys))
            self.outbox.put_nowait(event)

    async def publish_loop(self) -> None:
        while True:
            event = await self.outbox.get()
            await self.events.kv(event.kind, self.cfg.node, event.data.to_dict())

    async def heartbeat(self) -> None:
        info = WorkerInfo(self.cfg.instance_id, "messenger", self.cfg.node, self.layout.model, transfer_addr=self.transfer_addr,
                          incarnation=self.pool.epoch, layout=self.layout, sent_at=time.time(),
                          transport=self.transports.label, endpoints=self.transports.endpoints)
        await bus.heartbeat(self.nc, info)

    async def sweep(self) -> None:
        """Pins of silent workers and expired leases, handoff reservations nobody will complete, and
        request files nobody came back for."""
        now = time.monotonic()
        quiet_since = now - self.cfg.peer_timeout_s
        trust = not self.nc.recently_reconnected()  # after a broker outage, silence proves nothing
        alive_any = {f"{iid}:{inc}" for iid, (inc, seen) in self.seen.items() if seen >= quiet_since} if trust else None
        live_decodes = {iid for iid, (_, seen) in self.seen.items() if seen >= quiet_since} if trust else None
        for region, why in self.reservations.expired(alive_any, live_decodes):
            await asyncio.to_thread(self.reservations.drop, region, why)
        self.metrics.reserved.set(len(self.reservations.held))
        alive = {f"{iid}:{inc}" for iid, (inc, seen) in self.workers.items() if seen >= quiet_since}
        for hold, since in list(self.hold_since.items()):
            holder = hold.split("/", 1)[0]
            if holder != self.own_holder and holder not in alive and since < quiet_since and not self.nc.recently_reconnected():
                self.release_holder(holder, "its process stopped sending heartbeats")
            elif now - since > self.cfg.pin_lease_s:
                log.warning("%s: pin lease expired; releasing its blocks", hold)
                self.publish(self.pool.release(hold))
                self.hold_since.pop(hold, None)
        removed = await asyncio.to_thread(kvfiles.sweep, self.cfg.shm_dir, "", False, self.cfg.stale_kv_s)
        if removed:
            log.warning("removed %d request KV files older than %g s", removed, self.cfg.stale_kv_s)


async def serve(cfg: MessengerConfig, stop: asyncio.Event) -> None:
    security.private_dir(cfg.shm_dir)  # its KV files and slab are this user's alone
    kvfiles.sweep(cfg.shm_dir, kvfiles.IN, temporary_only=True)  # transfers a dead predecessor was landing
    ref = await models.prepare_for_service(cfg.model, cfg.home, stop)  # may wait for model-init
    if ref is None:
        return True  # stopped while it waited
    shape = models.read_shape(ref)
    layout = shape.kv_layout(cfg.block_tokens, cfg.dtype)
    dram_blocks = cfg.dram_blocks if cfg.dram_blocks > 0 else max(1, capacity_in_blocks(cfg.dram_bytes, layout))
    ssd_blocks = cfg.ssd_blocks if cfg.ssd_blocks >= 0 else capacity_in_blocks(cfg.ssd_bytes, layout)
    pool = NodePool(cfg.node, layout, cfg.shm_dir, dram_blocks, cfg.ssd_dir, ssd_blocks, cfg.eviction)
    nc = await bus.connect(cfg.nats_url, cfg.instance_id, cfg.nats_auth)
    tasks = runner.TaskGroup(stop)
    transports = Transports(cfg.transport, security.read_secret(cfg.cluster_secret_file), cfg.link_timeout_s,
                            tcp_streams=cfg.tcp_streams, tcp_stripe_min=cfg.tcp_stripe_min,
                            tls=security.link_tls(cfg.link_cert, cfg.link_ca), allow=cfg.link_peers)
    service = MessengerService(cfg, nc, tasks, pool, shape.max_context, transports)
    service.layout = Layout(ref.name, cfg.block_tokens, 0, layout.signature)
    service.loop = asyncio.get_running_loop()
    service.pulls = Pulls(pool, transports, service.own_holder, service.publish, service.loop, cfg.link_timeout_s)
    transports.on_refused = service.on_refused
    await worker.obey_refusal(nc, cfg.instance_id, tasks)
    endpoints = transports.listen(cfg.transfer_host, cfg.transfer_port, cfg.advertise_host)
    service.transfer_addr = endpoints.get("tcp", "")
    await bus.receive(nc, subjects.WORKER_HEARTBEAT_ALL, WorkerInfo, service.on_heartbeat, background=True)
    await bus.receive(nc, subjects.CONTROL_ALIVE_ALL, Alive, service.on_alive, background=True)
    await bus.subscribe(nc, subjects.messenger_control(cfg.node, "*"), service.on_control)
    tasks.spawn(service.publish_loop(), "kv-events")
    tasks.spawn(runner.every(cfg.heartbeat_interval_s, stop, service.heartbeat), "heartbeat")
    tasks.spawn(runner.every(2.0, stop, service.sweep), "sweep")
    tasks.spawn(bus.watchdog(nc), "broker-watchdog")
    tasks.spawn(health.beacon(cfg.health_file, nc, stop), "health", essential=False)
    metrics.serve(cfg.metrics_port, service.metrics.registry, cfg.metrics_host)
    await service.events.instance("started", cfg.instance_id, role="messenger", node=cfg.node,
                                  transfer_addr=service.transfer_addr, transport=transports.label, epoch=pool.epoch,
                                  dram_blocks=pool.pool.dram_capacity_blocks, ssd_blocks=pool.pool.ssd_capacity_blocks,
                                  block_nbytes=layout.block_nbytes)
    log.info("messenger %s for node %s: KV transports %s on %s; pool %d DRAM + %d SSD blocks of %d bytes (%s)",
             cfg.instance_id, cfg.node, transports.label, endpoints, pool.pool.dram_capacity_blocks,
             pool.pool.ssd_capacity_blocks, layout.block_nbytes, cfg.eviction)
    await runner.serving(stop)
    await bus.heartbeat(nc, WorkerInfo(cfg.instance_id, "messenger", cfg.node, leaving=True, incarnation=pool.epoch))
    transports.close()
    await tasks.cancel_all()
    await bus.shutdown(nc)
    for region in list(service.reservations.held):
        service.reservations.drop(region, "the messenger stopped")
    service.pulls.close()
    pool.close()
    return not tasks.failed
