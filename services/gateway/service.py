"""The gateway process: the model's tokenizer, the NATS subscriptions, the HTTP server, and shutdown.

The gateway's modules in a line, each importing only those before it:
    config, tenants, detokenize, dashboard -> protocol (requests) -> responses -> openapi
    -> core (Gateway: a request's life over NATS) -> api (HTTP routes) -> service
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from common import bus, health, models
from common.runner import TaskGroup, every, serving
from schemas import subjects
from schemas.events import Event
from schemas.tokens import TenantUsage, TokenChunk
from services.gateway.api import Api
from services.gateway.config import GatewayConfig
from services.gateway.core import Gateway

log = logging.getLogger(__name__)


async def serve(cfg: GatewayConfig, stop: asyncio.Event) -> bool:
    ref = await models.prepare_for_service(cfg.model, cfg.home, stop)  # may wait for model-init
    if ref is None:
        return True  # stopped while it waited
    tokenizer = await asyncio.to_thread(models.load_tokenizer, ref)
    shape = models.read_shape(ref)
    nc = await bus.connect(cfg.nats_url, cfg.instance_id, cfg.nats_auth)
    gateway = Gateway(cfg, nc, tokenizer, ref.name, shape.max_context)
    await bus.receive(nc, subjects.tokens_sent_to(gateway.reply_subject), TokenChunk, gateway.on_tokens)
    await bus.receive(nc, subjects.TENANT_USAGE_ALL, TenantUsage, gateway.on_usage, background=True)  # limits over every replica
    nc.on_reconnect(gateway.probe_all)  # chunks may have been lost while the broker was away
    api = Api(gateway)
    for kind in ("prefilled", "kv_pulled"):
        await bus.receive(nc, subjects.request_event(kind, "*"), Event, api.on_request_event, background=True)
    await bus.receive(nc, subjects.request_event("routed", "*"), Event, api.dashboard.on_routed, background=True)
    # handler_cancellation: a client that goes away cancels its handler, non-streaming too, so its
    # request is cancelled at the workers and audited as cancelled (not run to max_tokens)
    runner = web.AppRunner(api.app(), access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port)
    await site.start()
    tasks = TaskGroup(stop)
    tasks.spawn(health.beacon(cfg.health_file, nc, stop), "health", essential=False)
    tasks.spawn(bus.watchdog(nc), "broker-watchdog")
    tasks.spawn(every(0.1, stop, gateway.share_usage), "tenant-usage", essential=False)
    log.info("gateway %s serving %s on http://%s:%d", cfg.instance_id, ref.name, cfg.host, cfg.port)
    await serving(stop)
    await tasks.cancel_all()
    await runner.cleanup()
    await bus.shutdown(nc)
    return not tasks.failed
