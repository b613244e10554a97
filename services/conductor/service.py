"""Conductor: the global scheduler. Routes each request to a (prefill, decode) pair.

Inputs: heartbeats (who is alive, how loaded), route requests from gateways (request/reply),
request events (prefilled, terminal) that move and end the load a request puts on instances.
Outputs: a PrefillTask to the chosen prefill instance, a RouteReply to the gateway, a `routed`
event with every candidate. When an instance's heartbeats stop, every request it held fails
with a TokenChunk error to its gateway, so no client hangs.
"""

from __future__ import annotations

import asyncio
import logging
import time

from nats.aio.msg import Msg

from common import bus, runner
from schemas import subjects
from schemas.events import TERMINAL_KINDS, Event
from schemas.prefill import PrefillTask
from schemas.route import RouteReply, RouteRequest
from schemas.tokens import TokenChunk
from schemas.workers import StatusReply, WorkerInfo
from services.conductor.config import ConductorConfig
from services.conductor.inflight import InFlight, InFlightTable
from services.conductor.registry import Registry

log = logging.getLogger(__name__)


class ConductorService:
    def __init__(self, cfg: ConductorConfig, nc) -> None:
        self.cfg = cfg
        self.nc = nc
        self.events = bus.EventPublisher(nc, "conductor", cfg.instance_id)
        self.registry = Registry(cfg.heartbeat_timeout_s)
        self.inflight = InFlightTable(cfg.lease_s)

    async def on_heartbeat(self, msg: Msg) -> None:
        info = WorkerInfo.from_bytes(msg.data)
        if self.registry.update(info, time.monotonic()):
            log.info("instance %s joined (%s on node %s)", info.instance_id, info.role, info.node)
            await self.events.instance("joined", info.instance_id, role=info.role, node=info.node)
        elif info.leaving:
            log.info("instance %s left", info.instance_id)
            await self.events.instance("left", info.instance_id, role=info.role, node=info.node)
            await self.fail_requests_of(info.instance_id, "left")

    async def on_route(self, msg: Msg) -> None:
        try:
            request = RouteRequest.from_bytes(msg.data)
        except ValueError as exc:
            await msg.respond(RouteReply(False, 400, f"malformed route request: {exc}").to_bytes())
            return
        reply = await self.route(request)
        await msg.respond(reply.to_bytes())

    async def route(self, request: RouteRequest) -> RouteReply:
        prefills = self.registry.of_role("prefill")
        decodes = self.registry.of_role("decode")
        if not prefills or not decodes:
            missing = "prefill" if not prefills else "decode"
            return RouteReply(False, 503, f"no {missing} instance is available", retry_after_s=1.0)
        # NOTE: least loaded of each for now; the KVCache-centric policy replaces this choice.
        prefill_loads = {p.instance_id: self.inflight.prefill_load(p.instance_id)[0] + p.num_queued for p in prefills}
        decode_loads = {d.instance_id: self.inflight.decode_load(d.instance_id) for d in decodes}
        prefill = min(prefills, key=lambda p: (prefill_loads[p.instance_id], p.instance_id))
        decode = min(decodes, key=lambda d: (decode_loads[d.instance_id], d.instance_id))
        rid = request.request_id
        self.inflight.add(InFlight(rid, prefill.instance_id, decode.instance_id, request.reply_subject,
                                   len(request.prompt_token_ids), time.monotonic()))
        task = PrefillTask(rid, request.prompt_token_ids, request.sampling, request.reply_subject,
                           decode.instance_id, decode.node, request.arrival_ts)
        await self.events.request(
            "routed", rid, policy="least-loaded", prefill=prefill.instance_id, decode=decode.instance_id,
            candidates={"prefill": prefill_loads, "decode": decode_loads},
            reason="least loaded prefill and decode instance",
        )
        await self.nc.publish(subjects.prefill_tasks(prefill.instance_id), task.to_bytes())
        return RouteReply(True, 200, prefill_id=prefill.instance_id, decode_id=decode.instance_id)

    async def on_request_event(self, msg: Msg) -> None:
        event = Event.from_bytes(msg.data)
        if event.kind == "prefilled":
            self.inflight.mark_prefilled(event.request_id)
        elif event.kind in TERMINAL_KINDS:
            self.inflight.finish(event.request_id)

    async def on_status(self, msg: Msg) -> None:
        workers = [i.info for i in self.registry.instances.values()]
        await msg.respond(StatusReply(workers, len(self.inflight.requests)).to_bytes())

    async def sweep(self) -> None:
        now = time.monotonic()
        for info in self.registry.expire(now):
            log.warning("instance %s (%s) stopped sending heartbeats", info.instance_id, info.role)
            await self.events.instance("lost", info.instance_id, role=info.role, node=info.node)
            await self.fail_requests_of(info.instance_id, "stopped responding")
        for request in self.inflight.expire(now):
            log.warning("request %s: lease expired, releasing its load", request.request_id)

    async def fail_requests_of(self, instance_id: str, why: str) -> None:
        for request in self.inflight.lost_with(instance_id):
            log.warning("request %s: failing, instance %s %s", request.request_id, instance_id, why)
            chunk = TokenChunk(request.request_id, -1, [], error=f"instance {instance_id} {why}",
                               error_status=503, source=self.cfg.instance_id)
            await self.nc.publish(request.reply_subject, chunk.to_bytes())


async def serve(cfg: ConductorConfig, stop: asyncio.Event) -> None:
    nc = await bus.connect(cfg.nats_url, cfg.instance_id)
    await bus.ensure_events_stream(nc)
    service = ConductorService(cfg, nc)
    tasks = runner.TaskGroup(stop)
    await nc.subscribe(subjects.WORKER_HEARTBEAT, cb=service.on_heartbeat)
    await nc.subscribe(subjects.CONDUCTOR_ROUTE, queue=subjects.CONDUCTOR_QUEUE, cb=service.on_route)
    await nc.subscribe(subjects.CONDUCTOR_STATUS, cb=service.on_status)
    await nc.subscribe(subjects.request_event("*", "*"), cb=service.on_request_event)
    tasks.spawn(runner.every(cfg.sweep_interval_s, stop, service.sweep), "sweep")
    log.info("conductor %s ready", cfg.instance_id)
    await stop.wait()
    await tasks.cancel_all()
    await nc.drain()
