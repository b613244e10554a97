"""Messenger: one per node. Owns the node's KV pool and moves KV between nodes.

Control (NATS, messenger_control(node, op)), dispatched through one table:
  send      move a request's whole KV file to another node (prefill -> decode handoff)
  lookup / reserve / commit / release   the node pool (see node_pool.py)
  pull      fetch blocks from another node's messenger and keep them (hot-block replication)
  snapshot  everything the node holds, for the cache index
  status    occupancy, pins by holder and request files (what a leak check reads)
Bytes: the TCP link (link.py). KV events: numbered, published in order by one outbox task.

Nothing outlives its owner: pins are keyed by holder process (schemas.pool), so the pins of a
worker of this node that left, restarted (new incarnation) or went silent are released; request
files are swept when their owner restarts (common/kvfiles.py) and, as a last resort, by age.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Awaitable, Callable

from nats.aio.msg import Msg

from prometheus_client import Counter, Gauge, Histogram

from common import bus, health, kvfiles, metrics, models, runner, security, worker
from common.kv import blocks as kvblocks
from common.kv.pool import capacity_in_blocks
from schemas import subjects
from schemas.codec import Wire
from schemas.codec import WireError
from schemas.pool import (
    CommitRequest, FetchBlocks, FetchReply, LookupReply, LookupRequest, PoolReply, PoolStatus, PullRequest,
    ReleaseRequest, ReserveReply, ReserveRequest, SlotRef, SnapshotReply,
)
from schemas.transfer import SendKv, SendKvReply, TransferAck, TransferHeader
from schemas.workers import Layout, WorkerInfo
from services.messenger import link
from services.messenger.config import MessengerConfig
from services.messenger.node_pool import NodePool, PoolEvent

log = logging.getLogger(__name__)
MAX_LINKS = 64  # link connections served at once


class MessengerMetrics:
    def __init__(self, pool: NodePool) -> None:
        self.registry = r = metrics.registry()
        self.bytes = Counter("moonbus_messenger_bytes", "KV bytes moved, by peer node, transport and direction",
                             ["peer", "transport", "direction"], registry=r)
        self.transfer_s = Histogram("moonbus_messenger_transfer_seconds", "KV transfers (send: a request's handoff; "
                                    "pull: blocks fetched for replication)", ["op"], buckets=metrics.SLOW_BUCKETS,
                                    registry=r)
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
    def __init__(self, cfg: MessengerConfig, nc, tasks: runner.TaskGroup, pool: NodePool, max_kv_tokens: int) -> None:
        self.cfg = cfg
        self.max_kv_tokens = max_kv_tokens  # the model's context: no request's KV is longer
        self.secret = security.read_secret(cfg.cluster_secret_file)  # peers on the link must prove they hold it
        self.links = asyncio.Semaphore(MAX_LINKS)
        self.layout = Layout(cfg.model, cfg.block_tokens, 0, pool.layout.signature)  # what the cluster checks
        self.nc = nc
        self.tasks = tasks
        self.pool = pool
        self.events = bus.EventPublisher(nc, "messenger", cfg.instance_id,
                                          secret=security.read_secret(cfg.cluster_secret_file))
        self.metrics = MessengerMetrics(pool)
        self.outbox: asyncio.Queue[PoolEvent] = asyncio.Queue()  # KV events, published in seq order
        self.transfer_addr = ""
        self.peers: dict[str, tuple[str, float]] = {}  # node -> (host:port, last heartbeat, monotonic)
        self.hold_since: dict[str, float] = {}  # hold -> when it first pinned blocks (lease)
        self.workers: dict[str, tuple[str, float]] = {}  # instance on this node -> (incarnation, last heartbeat)
        self.own_holder = f"{cfg.instance_id}:{pool.epoch}"  # pins the messenger makes itself (pulls)
        # op -> (handler, runs as its own task); slow ops must not hold up the others
        self.ops: dict[str, tuple[Callable[[bytes], Awaitable[Wire]], bool]] = {
            "send": (self.op_send, True),
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
        try:
            reply = await handler(msg.data)
        except WireError as exc:  # a malformed request: answered, logged, dropped
            log.warning("messenger op %s: malformed request: %s", msg.subject, exc)
            reply = PoolReply(False, f"malformed request: {exc}")
        except Exception as exc:  # answered, never a hang
            log.exception("messenger op %s failed", msg.subject)
            reply = PoolReply(False, f"{type(exc).__name__}: {exc}")
        if msg.reply:
            with contextlib.suppress(Exception):  # the requester may be gone (or the broker)
                await msg.respond(reply.to_bytes())

    async def on_heartbeat(self, msg: Msg) -> None:
        info = WorkerInfo.from_bytes(msg.data)
        if info.role in ("prefill", "decode") and info.node == self.cfg.node:
            self.track_worker(info)
        if info.role != "messenger" or info.node == self.cfg.node:
            return
        if info.leaving:
            self.peers.pop(info.node, None)
        else:
            self.peers[info.node] = (info.transfer_addr, time.monotonic())

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
        """Fetch blocks from a peer and keep them here (replication of hot blocks)."""
        req = PullRequest.from_bytes(data)
        started = time.perf_counter()
        addr = await self.peer_addr(req.source_node)
        if addr is None:
            return PoolReply(False, f"no live messenger on node {req.source_node}")
        fetched, nbytes = await self.fetch(addr, FetchBlocks(req.request_id, req.keys))
        by_key = {k: (c, p) for k, c, p in fetched}
        keys = [k for k, _, _ in fetched]
        hold = f"{self.own_holder}/{req.request_id}"
        # in rounds, as a worker stores: reserved blocks stay pinned until written
        try:
            for _ in range(len(keys)):
                slots, events = self.pool.reserve(hold, keys, req.first_depth)
                self.publish(events)
                if not slots:
                    break
                written = []
                for ref in slots:
                    checksum, payload = by_key[ref.key]
                    self.pool.slab.write(ref.slot, payload)
                    written.append(SlotRef(ref.key, ref.slot, checksum))
                self.publish(self.pool.commit(hold, written))
                self.publish(self.pool.release(hold))
        finally:  # a failed round must not leave its reservations pinned
            self.publish(self.pool.release(hold))
        self.metrics.bytes.labels(req.source_node, "tcp", "in").inc(nbytes)
        self.metrics.transfer_s.labels("pull").observe(time.perf_counter() - started)
        return PoolReply(True, num_blocks=len(fetched), nbytes=nbytes, seconds=time.perf_counter() - started)

    async def fetch(self, addr: str, request: FetchBlocks) -> tuple[list[tuple[int, int, bytes]], int]:
        """[(key, checksum, payload)] of the leading requested blocks the peer has (verified)."""
        host, port = addr.rsplit(":", 1)
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), self.cfg.connect_timeout_s)
        try:
            await link.client_handshake(reader, writer, self.secret)
            await link.write_frame(writer, request, op=link.OP_FETCH)
            reply = await link.read_header(reader, FetchReply)
            if reply.error:
                raise link.LinkError(reply.error)
            out = []
            for key, checksum in zip(reply.keys, reply.checksums):
                payload = await link.read_payload(reader, reply.nbytes)
                if kvblocks.checksum(payload) != checksum:
                    log.error("request %s: block %016x from %s failed its checksum", request.request_id, key, addr)
                    break  # a corrupt block ends the usable prefix
                out.append((key, checksum, payload))
            return out, len(out) * reply.nbytes
        finally:
            writer.close()

    # --- the whole-request handoff (prefill -> decode) ----------------------------------------
    async def op_send(self, data: bytes) -> SendKvReply:
        request = SendKv.from_bytes(data)
        if request.dest_node == self.cfg.node:
            return SendKvReply(True, request.src)  # same node: the file is already in our shared memory
        addr = await self.peer_addr(request.dest_node)
        if addr is None:
            return SendKvReply(False, error=f"no live messenger on node {request.dest_node}")
        started = time.perf_counter()
        path = kvfiles.path_of(self.cfg.shm_dir, request.src)
        payload = await asyncio.to_thread(path.read_bytes)
        if request.src.node != self.cfg.node:
            return SendKvReply(False, error=f"the KV {request.src.name} is not on node {self.cfg.node}")
        host, port = addr.rsplit(":", 1)
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), self.cfg.connect_timeout_s)
        try:
            await link.client_handshake(reader, writer, self.secret)
            await link.write_frame(writer, TransferHeader(request.request_id, request.src, len(payload),
                                                          request.dest_instance), payload, op=link.OP_TRANSFER)
            ack = await link.read_header(reader, TransferAck)
        finally:
            writer.close()
        if not ack.ok:
            return SendKvReply(False, error=f"node {request.dest_node} refused the KV: {ack.error}")
        path.unlink(missing_ok=True)  # it lives on the decode node now
        self.metrics.bytes.labels(request.dest_node, "tcp", "out").inc(len(payload))
        self.metrics.transfer_s.labels("send").observe(time.perf_counter() - started)
        return SendKvReply(True, ack.dest, nbytes=len(payload), seconds=time.perf_counter() - started)

    async def peer_addr(self, node: str) -> str | None:
        """The link address of `node`'s messenger; waits a little for one that just started, and up
        to the peer timeout for a heartbeat of one we know (e.g. right after a broker outage)."""
        wait = self.cfg.peer_timeout_s if node in self.peers else 2 * self.cfg.heartbeat_interval_s
        deadline = time.monotonic() + wait
        while True:
            entry = self.peers.get(node)
            if entry is not None and time.monotonic() - entry[1] <= self.cfg.peer_timeout_s:
                return entry[0]
            if time.monotonic() > deadline:
                return None
            await asyncio.sleep(0.05)

    # --- the link (TCP server side) -------------------------------------------------------
    async def on_link(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        if self.links.locked():  # at the limit: refuse rather than queue (a flood must not pile up)
            log.warning("link from %s refused: %d connections already open", peer, MAX_LINKS)
            writer.close()
            return
        async with self.links:
            await self.serve_link(reader, writer, peer)

    async def serve_link(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer) -> None:
        try:
            await link.server_handshake(reader, writer, self.secret)
            op = await link.read_op(reader)
            if op == link.OP_TRANSFER:
                await self.serve_transfer(reader, writer)
            elif op == link.OP_FETCH:
                await self.serve_fetch(reader, writer)
            else:
                log.warning("link from %s: unknown op %r", writer.get_extra_info("peername"), op)
        except link.LinkRefused as exc:
            log.warning("link from %s refused: %s", peer, exc)
            await self.events.instance("link_refused", self.cfg.instance_id, node=self.cfg.node, peer=str(peer),
                                       reason=str(exc))
        except (link.LinkError, ValueError, OSError) as exc:  # a broken peer or a malformed frame
            log.warning("link from %s broke: %s", peer, exc)
        except Exception:
            log.exception("link from %s failed", peer)
        finally:
            writer.close()

    async def serve_transfer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        header = await link.read_header(reader, TransferHeader)
        problem = self.check_transfer(header)
        if problem:
            log.warning("request %s: refused a KV transfer: %s", header.request_id, problem)
            await link.write_frame(writer, TransferAck(False, error=problem))
            return
        payload = await link.read_payload(reader, header.nbytes)
        try:
            dest = await asyncio.to_thread(kvfiles.write_bytes, self.cfg.shm_dir, header.handle, payload, self.cfg.node,
                                           header.dest_instance)
            ack = TransferAck(True, dest)
            self.metrics.bytes.labels(header.handle.node, "tcp", "in").inc(header.nbytes)
        except (OSError, kvfiles.KvChecksumError) as exc:
            log.error("request %s: cannot land KV: %s", header.request_id, exc)
            ack = TransferAck(False, error=str(exc))
        await link.write_frame(writer, ack)

    def check_transfer(self, header: TransferHeader) -> str:
        """A transfer must carry a whole request's KV in this model's layout (sizes are not trusted)."""
        layout, shape = self.pool.layout, header.handle.shape
        expected = layout.request_shape(shape[3])
        if tuple(shape) != expected or not 0 < shape[3] <= self.max_kv_tokens:
            return f"shape {shape} is not this model's KV layout {expected[:3]}..{expected[4:]} of at most {self.max_kv_tokens} tokens"
        if header.nbytes != layout.bytes_per_token * shape[3]:
            return f"{header.nbytes} bytes do not match shape {shape}"
        return ""

    async def serve_fetch(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = await link.read_header(reader, FetchBlocks)
        keys, checksums, payloads = [], [], []
        for key in request.keys:
            payload = self.pool.read_block(key)
            if payload is None:
                break  # only a prefix is useful
            keys.append(key)
            checksums.append(self.pool.checksums.get(key) or kvblocks.checksum(payload))
            payloads.append(payload)
        self.publish(self.pool.take_events())  # a corrupt block found while reading is reported
        await link.write_frame(writer, FetchReply(keys, checksums, self.pool.layout.block_nbytes))
        for payload in payloads:
            writer.write(payload)
            await writer.drain()
        self.metrics.bytes.labels(str(writer.get_extra_info("peername", ("?",))[0]), "tcp", "out").inc(
            sum(len(p) for p in payloads))

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
                          incarnation=self.pool.epoch, layout=self.layout, sent_at=time.time())
        await bus.publish(self.nc, subjects.WORKER_HEARTBEAT, info.to_bytes())

    async def sweep(self) -> None:
        """Pins of silent workers and expired leases, and request files nobody came back for."""
        now = time.monotonic()
        quiet_since = now - self.cfg.peer_timeout_s
        alive = {f"{iid}:{inc}" for iid, (inc, seen) in self.workers.items() if seen >= quiet_since}
        for hold, since in list(self.hold_since.items()):
            holder = hold.split("/", 1)[0]
            if holder != self.own_holder and holder not in alive and since < quiet_since and not bus.recently_reconnected(self.nc):
                self.release_holder(holder, "its process stopped sending heartbeats")
            elif now - since > self.cfg.pin_lease_s:
                log.warning("%s: pin lease expired; releasing its blocks", hold)
                self.publish(self.pool.release(hold))
                self.hold_since.pop(hold, None)
        removed = await asyncio.to_thread(kvfiles.sweep, self.cfg.shm_dir, "", False, self.cfg.stale_kv_s)
        if removed:
            log.warning("removed %d request KV files older than %g s", removed, self.cfg.stale_kv_s)


async def serve(cfg: MessengerConfig, stop: asyncio.Event) -> None:
    cfg.shm_dir.mkdir(parents=True, exist_ok=True)
    kvfiles.sweep(cfg.shm_dir, kvfiles.IN, temporary_only=True)  # transfers a dead predecessor was landing
    ref = models.prepare(cfg.model, cfg.home)
    shape = models.read_shape(ref)
    layout = shape.kv_layout(cfg.block_tokens)
    dram_blocks = cfg.dram_blocks if cfg.dram_blocks > 0 else max(1, capacity_in_blocks(cfg.dram_bytes, layout))
    ssd_blocks = cfg.ssd_blocks if cfg.ssd_blocks >= 0 else capacity_in_blocks(cfg.ssd_bytes, layout)
    pool = NodePool(cfg.node, layout, cfg.shm_dir, dram_blocks, cfg.ssd_dir, ssd_blocks, cfg.eviction)
    nc = await bus.connect(cfg.nats_url, cfg.instance_id, cfg.nats_auth)
    tasks = runner.TaskGroup(stop)
    service = MessengerService(cfg, nc, tasks, pool, shape.max_context)
    service.layout = Layout(ref.name, cfg.block_tokens, 0, layout.signature)
    await worker.obey_refusal(nc, cfg.instance_id, tasks)
    server = await asyncio.start_server(service.on_link, cfg.transfer_host, cfg.transfer_port, limit=1 << 20)
    port = server.sockets[0].getsockname()[1]
    service.transfer_addr = f"{cfg.transfer_addr_host}:{port}"
    await bus.subscribe(nc, subjects.WORKER_HEARTBEAT, service.on_heartbeat)
    await bus.subscribe(nc, subjects.messenger_control(cfg.node, "*"), service.on_control)
    tasks.spawn(service.publish_loop(), "kv-events")
    tasks.spawn(runner.every(cfg.heartbeat_interval_s, stop, service.heartbeat), "heartbeat")
    tasks.spawn(runner.every(2.0, stop, service.sweep), "sweep")
    tasks.spawn(bus.watchdog(nc), "broker-watchdog")
    tasks.spawn(health.beacon(cfg.health_file, nc, stop), "health", essential=False)
    metrics.serve(cfg.metrics_port, service.metrics.registry, cfg.metrics_host)
    await service.events.instance("started", cfg.instance_id, role="messenger", node=cfg.node,
                                  transfer_addr=service.transfer_addr, epoch=pool.epoch,
                                  dram_blocks=pool.pool.dram_capacity_blocks, ssd_blocks=pool.pool.ssd_capacity_blocks,
                                  block_nbytes=layout.block_nbytes)
    log.info("messenger %s for node %s: KV link on %s; pool %d DRAM + %d SSD blocks of %d bytes (%s)",
             cfg.instance_id, cfg.node, service.transfer_addr, pool.pool.dram_capacity_blocks,
             pool.pool.ssd_capacity_blocks, layout.block_nbytes, cfg.eviction)
    await stop.wait()
    await bus.publish(nc, subjects.WORKER_HEARTBEAT,
                      WorkerInfo(cfg.instance_id, "messenger", cfg.node, leaving=True, incarnation=pool.epoch).to_bytes())
    server.close()
    await tasks.cancel_all()
    await bus.shutdown(nc)
    pool.close()
    return not tasks.failed
