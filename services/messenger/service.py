"""Messenger: one per node. Moves KV between nodes; KV bytes never ride NATS.

Control: `SendKv` requests from the node's workers on messenger_control(node, "send").
Bytes: a TCP link to the destination node's messenger, which lands them in its node's
shared-memory directory and acknowledges with the local handle. Same node: nothing moves.
"""

from __future__ import annotations

import asyncio
import logging
import time

from nats.aio.msg import Msg

from common import bus, kvfiles, runner
from schemas import subjects
from schemas.transfer import SendKv, SendKvReply, TransferAck, TransferHeader
from schemas.workers import WorkerInfo
from services.messenger import link
from services.messenger.config import MessengerConfig

log = logging.getLogger(__name__)


class MessengerService:
    def __init__(self, cfg: MessengerConfig, nc, tasks: runner.TaskGroup) -> None:
        self.cfg = cfg
        self.nc = nc
        self.tasks = tasks  # one task per transfer, so a slow link does not hold up the others
        self.events = bus.EventPublisher(nc, "messenger", cfg.instance_id)
        self.transfer_addr = ""
        self.peers: dict[str, tuple[str, float]] = {}  # node -> (host:port, last heartbeat, monotonic)

    # --- control (NATS) -------------------------------------------------------------------
    async def on_heartbeat(self, msg: Msg) -> None:
        info = WorkerInfo.from_bytes(msg.data)
        if info.role != "messenger" or info.node == self.cfg.node:
            return
        if info.leaving:
            self.peers.pop(info.node, None)
        else:
            self.peers[info.node] = (info.transfer_addr, time.monotonic())

    async def on_send(self, msg: Msg) -> None:
        self.tasks.spawn(self.handle_send(msg), "send-kv")

    async def handle_send(self, msg: Msg) -> None:
        try:
            request = SendKv.from_bytes(msg.data)
        except ValueError as exc:
            await msg.respond(SendKvReply(False, error=f"malformed request: {exc}").to_bytes())
            return
        try:
            reply = await self.send(request)
        except Exception as exc:  # answered, never a hang
            log.exception("request %s: KV transfer to %s failed", request.request_id, request.dest_node)
            reply = SendKvReply(False, error=f"{type(exc).__name__}: {exc}")
        await msg.respond(reply.to_bytes())

    async def send(self, request: SendKv) -> SendKvReply:
        if request.dest_node == self.cfg.node:
            return SendKvReply(True, request.src)  # same node: the file is already in our shared memory
        addr = self.peer_addr(request.dest_node)
        if addr is None:
            return SendKvReply(False, error=f"no live messenger on node {request.dest_node}")
        started = time.perf_counter()
        path = kvfiles.path_of(self.cfg.shm_dir, request.src)
        payload = await asyncio.to_thread(path.read_bytes)
        host, port = addr.rsplit(":", 1)
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), self.cfg.connect_timeout_s)
        try:
            await link.write_frame(writer, TransferHeader(request.request_id, request.src, len(payload)), payload)
            ack = await link.read_header(reader, TransferAck)
        finally:
            writer.close()
        if not ack.ok:
            return SendKvReply(False, error=f"node {request.dest_node} refused the KV: {ack.error}")
        path.unlink(missing_ok=True)  # it lives on the decode node now
        return SendKvReply(True, ack.dest, nbytes=len(payload), seconds=time.perf_counter() - started)

    def peer_addr(self, node: str) -> str | None:
        entry = self.peers.get(node)
        if entry is None or time.monotonic() - entry[1] > self.cfg.peer_timeout_s:
            return None
        return entry[0]

    # --- the link (TCP) -------------------------------------------------------------------
    async def on_link(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            header = await link.read_header(reader, TransferHeader)
            payload = await link.read_payload(reader, header.nbytes)
            try:
                dest = await asyncio.to_thread(kvfiles.write_bytes, self.cfg.shm_dir, header.handle, payload, self.cfg.node)
                ack = TransferAck(True, dest)
            except (OSError, kvfiles.KvChecksumError) as exc:
                log.error("request %s: cannot land KV: %s", header.request_id, exc)
                ack = TransferAck(False, error=str(exc))
            await link.write_frame(writer, ack)
        except link.LinkError as exc:
            log.warning("link from %s broke: %s", writer.get_extra_info("peername"), exc)
        finally:
            writer.close()

    async def heartbeat(self) -> None:
        info = WorkerInfo(self.cfg.instance_id, "messenger", self.cfg.node, transfer_addr=self.transfer_addr)
        await self.nc.publish(subjects.WORKER_HEARTBEAT, info.to_bytes())


async def serve(cfg: MessengerConfig, stop: asyncio.Event) -> None:
    cfg.shm_dir.mkdir(parents=True, exist_ok=True)
    nc = await bus.connect(cfg.nats_url, cfg.instance_id)
    tasks = runner.TaskGroup(stop)
    service = MessengerService(cfg, nc, tasks)
    server = await asyncio.start_server(service.on_link, cfg.transfer_host, cfg.transfer_port, limit=1 << 20)
    port = server.sockets[0].getsockname()[1]
    service.transfer_addr = f"{cfg.transfer_addr_host}:{port}"
    await nc.subscribe(subjects.WORKER_HEARTBEAT, cb=service.on_heartbeat)
    await nc.subscribe(subjects.messenger_control(cfg.node, "send"), cb=service.on_send)
    tasks.spawn(runner.every(cfg.heartbeat_interval_s, stop, service.heartbeat), "heartbeat")
    await service.events.instance("started", cfg.instance_id, role="messenger", node=cfg.node, transfer_addr=service.transfer_addr)
    log.info("messenger %s for node %s: KV link on %s, shared memory %s", cfg.instance_id, cfg.node, service.transfer_addr, cfg.shm_dir)
    await stop.wait()
    await nc.publish(subjects.WORKER_HEARTBEAT, WorkerInfo(cfg.instance_id, "messenger", cfg.node, leaving=True).to_bytes())
    server.close()
    await tasks.cancel_all()
    await nc.drain()
