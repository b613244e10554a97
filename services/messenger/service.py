"""Messenger: one per node. Owns the node's KV pool and moves KV between nodes.

Control (NATS, messenger_control(node, op)), dispatched through one table:
  send      move a request's whole KV file to another node (prefill -> decode handoff)
  lookup / reserve / commit / release   the node pool (see node_pool.py)
  pull      fetch blocks from another node's messenger and keep them (hot-block replication)
  snapshot  everything the node holds, for the cache index
Bytes: the TCP link (link.py). KV events: numbered, published in order by one outbox task.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

from nats.aio.msg import Msg

from common import bus, kvfiles, models, runner
from common.kv import blocks as kvblocks
from common.kv.pool import capacity_in_blocks
from schemas import subjects
from schemas.codec import Wire
from schemas.pool import (
    CommitRequest, FetchBlocks, FetchReply, LookupReply, LookupRequest, PoolReply, PullRequest,
    ReleaseRequest, ReserveReply, ReserveRequest, SlotRef, SnapshotReply,
)
from schemas.transfer import SendKv, SendKvReply, TransferAck, TransferHeader
from schemas.workers import WorkerInfo
from services.messenger import link
from services.messenger.config import MessengerConfig
from services.messenger.node_pool import NodePool, PoolEvent

log = logging.getLogger(__name__)


class MessengerService:
    def __init__(self, cfg: MessengerConfig, nc, tasks: runner.TaskGroup, pool: NodePool) -> None:
        self.cfg = cfg
        self.nc = nc
        self.tasks = tasks
        self.pool = pool
        self.events = bus.EventPublisher(nc, "messenger", cfg.instance_id)
        self.outbox: asyncio.Queue[PoolEvent] = asyncio.Queue()  # KV events, published in seq order
        self.transfer_addr = ""
        self.peers: dict[str, tuple[str, float]] = {}  # node -> (host:port, last heartbeat, monotonic)
        self.hold_since: dict[str, float] = {}  # request_id -> when it first pinned blocks (lease)
        # op -> (handler, runs as its own task); slow ops must not hold up the others
        self.ops: dict[str, tuple[Callable[[bytes], Awaitable[Wire]], bool]] = {
            "send": (self.op_send, True),
            "pull": (self.op_pull, True),
            "lookup": (self.op_lookup, False),
            "reserve": (self.op_reserve, False),
            "commit": (self.op_commit, False),
            "release": (self.op_release, False),
            "snapshot": (self.op_snapshot, False),
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
            self.tasks.spawn(self.answer(msg, handler), f"messenger-{op}")
        else:
            await self.answer(msg, handler)

    async def answer(self, msg: Msg, handler: Callable[[bytes], Awaitable[Wire]]) -> None:
        try:
            reply = await handler(msg.data)
        except Exception as exc:  # answered, never a hang
            log.exception("messenger op %s failed", msg.subject)
            reply = PoolReply(False, f"{type(exc).__name__}: {exc}")
        if msg.reply:
            await msg.respond(reply.to_bytes())

    async def on_heartbeat(self, msg: Msg) -> None:
        info = WorkerInfo.from_bytes(msg.data)
        if info.role != "messenger" or info.node == self.cfg.node:
            return
        if info.leaving:
            self.peers.pop(info.node, None)
        else:
            self.peers[info.node] = (info.transfer_addr, time.monotonic())

    # --- the pool ops -----------------------------------------------------------------------
    async def op_lookup(self, data: bytes) -> LookupReply:
        req = LookupRequest.from_bytes(data)
        found, events = self.pool.lookup(req.request_id, req.keys)
        self.publish(events)
        if found:
            self.hold_since.setdefault(req.request_id, time.monotonic())
        return LookupReply(found, str(self.pool.slab_path))

    async def op_reserve(self, data: bytes) -> ReserveReply:
        req = ReserveRequest.from_bytes(data)
        slots, events = self.pool.reserve(req.request_id, req.keys, req.first_depth)
        self.publish(events)
        if slots:
            self.hold_since.setdefault(req.request_id, time.monotonic())
        return ReserveReply(slots, str(self.pool.slab_path))

    async def op_commit(self, data: bytes) -> PoolReply:
        req = CommitRequest.from_bytes(data)
        self.publish(self.pool.commit(req.request_id, req.blocks))
        return PoolReply(True, num_blocks=len(req.blocks))

    async def op_release(self, data: bytes) -> PoolReply:
        req = ReleaseRequest.from_bytes(data)
        self.publish(self.pool.release(req.request_id))
        self.hold_since.pop(req.request_id, None)
        return PoolReply(True)

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
        # in rounds, as a worker stores: reserved blocks stay pinned until written
        for _ in range(len(keys)):
            slots, events = self.pool.reserve(req.request_id, keys, req.first_depth)
            self.publish(events)
            if not slots:
                break
            written = []
            for ref in slots:
                checksum, payload = by_key[ref.key]
                self.pool.slab.write(ref.slot, payload)
                written.append(SlotRef(ref.key, ref.slot, checksum))
            self.publish(self.pool.commit(req.request_id, written))
            self.publish(self.pool.release(req.request_id))
        return PoolReply(True, num_blocks=len(fetched), nbytes=nbytes, seconds=time.perf_counter() - started)

    async def fetch(self, addr: str, request: FetchBlocks) -> tuple[list[tuple[int, int, bytes]], int]:
        """[(key, checksum, payload)] of the leading requested blocks the peer has (verified)."""
        host, port = addr.rsplit(":", 1)
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), self.cfg.connect_timeout_s)
        try:
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
        host, port = addr.rsplit(":", 1)
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), self.cfg.connect_timeout_s)
        try:
            await link.write_frame(writer, TransferHeader(request.request_id, request.src, len(payload)), payload,
                                   op=link.OP_TRANSFER)
            ack = await link.read_header(reader, TransferAck)
        finally:
            writer.close()
        if not ack.ok:
            return SendKvReply(False, error=f"node {request.dest_node} refused the KV: {ack.error}")
        path.unlink(missing_ok=True)  # it lives on the decode node now
        return SendKvReply(True, ack.dest, nbytes=len(payload), seconds=time.perf_counter() - started)

    async def peer_addr(self, node: str) -> str | None:
        """The link address of `node`'s messenger; waits a little for one that just started."""
        deadline = time.monotonic() + 2 * self.cfg.heartbeat_interval_s
        while True:
            entry = self.peers.get(node)
            if entry is not None and time.monotonic() - entry[1] <= self.cfg.peer_timeout_s:
                return entry[0]
            if time.monotonic() > deadline:
                return None
            await asyncio.sleep(0.05)

    # --- the link (TCP server side) -------------------------------------------------------
    async def on_link(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            op = await link.read_op(reader)
            if op == link.OP_TRANSFER:
                await self.serve_transfer(reader, writer)
            elif op == link.OP_FETCH:
                await self.serve_fetch(reader, writer)
            else:
                log.warning("link from %s: unknown op %r", writer.get_extra_info("peername"), op)
        except link.LinkError as exc:
            log.warning("link from %s broke: %s", writer.get_extra_info("peername"), exc)
        finally:
            writer.close()

    async def serve_transfer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        header = await link.read_header(reader, TransferHeader)
        payload = await link.read_payload(reader, header.nbytes)
        try:
            dest = await asyncio.to_thread(kvfiles.write_bytes, self.cfg.shm_dir, header.handle, payload, self.cfg.node)
            ack = TransferAck(True, dest)
        except (OSError, kvfiles.KvChecksumError) as exc:
            log.error("request %s: cannot land KV: %s", header.request_id, exc)
            ack = TransferAck(False, error=str(exc))
        await link.write_frame(writer, ack)

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

    # --- events and housekeeping -------------------------------------------------------------
    def publish(self, events: list[PoolEvent]) -> None:
        for event in events:
            self.outbox.put_nowait(event)

    async def publish_loop(self) -> None:
        while True:
            event = await self.outbox.get()
            await self.events.kv(event.kind, self.cfg.node, event.data.to_dict())

    async def heartbeat(self) -> None:
        info = WorkerInfo(self.cfg.instance_id, "messenger", self.cfg.node, transfer_addr=self.transfer_addr)
        await self.nc.publish(subjects.WORKER_HEARTBEAT, info.to_bytes())

    async def sweep_leases(self) -> None:
        now = time.monotonic()
        for rid, since in list(self.hold_since.items()):
            if now - since > self.cfg.pin_lease_s:
                log.warning("request %s: pin lease expired; releasing its blocks", rid)
                self.publish(self.pool.release(rid))
                del self.hold_since[rid]


async def serve(cfg: MessengerConfig, stop: asyncio.Event) -> None:
    cfg.shm_dir.mkdir(parents=True, exist_ok=True)
    ref = models.prepare(cfg.model, cfg.home)
    layout = models.read_shape(ref).kv_layout(cfg.block_tokens)
    dram_blocks = cfg.dram_blocks if cfg.dram_blocks > 0 else max(1, capacity_in_blocks(cfg.dram_bytes, layout))
    ssd_blocks = cfg.ssd_blocks if cfg.ssd_blocks >= 0 else capacity_in_blocks(cfg.ssd_bytes, layout)
    pool = NodePool(cfg.node, layout, cfg.shm_dir / "slab", dram_blocks, cfg.ssd_dir, ssd_blocks, cfg.eviction)
    nc = await bus.connect(cfg.nats_url, cfg.instance_id)
    tasks = runner.TaskGroup(stop)
    service = MessengerService(cfg, nc, tasks, pool)
    server = await asyncio.start_server(service.on_link, cfg.transfer_host, cfg.transfer_port, limit=1 << 20)
    port = server.sockets[0].getsockname()[1]
    service.transfer_addr = f"{cfg.transfer_addr_host}:{port}"
    await nc.subscribe(subjects.WORKER_HEARTBEAT, cb=service.on_heartbeat)
    await nc.subscribe(subjects.messenger_control(cfg.node, "*"), cb=service.on_control)
    tasks.spawn(service.publish_loop(), "kv-events")
    tasks.spawn(runner.every(cfg.heartbeat_interval_s, stop, service.heartbeat), "heartbeat")
    tasks.spawn(runner.every(10.0, stop, service.sweep_leases), "pin-leases")
    await service.events.instance("started", cfg.instance_id, role="messenger", node=cfg.node,
                                  transfer_addr=service.transfer_addr, epoch=pool.epoch,
                                  dram_blocks=pool.pool.dram_capacity_blocks, ssd_blocks=pool.pool.ssd_capacity_blocks,
                                  block_nbytes=layout.block_nbytes)
    log.info("messenger %s for node %s: KV link on %s; pool %d DRAM + %d SSD blocks of %d bytes (%s)",
             cfg.instance_id, cfg.node, service.transfer_addr, pool.pool.dram_capacity_blocks,
             pool.pool.ssd_capacity_blocks, layout.block_nbytes, cfg.eviction)
    await stop.wait()
    await nc.publish(subjects.WORKER_HEARTBEAT, WorkerInfo(cfg.instance_id, "messenger", cfg.node, leaving=True).to_bytes())
    server.close()
    await tasks.cancel_all()
    await bus.shutdown(nc)
    pool.close()
