"""NATS helpers shared by every service: connect, the event publisher, the events stream."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import nats
from nats.aio.client import Client
from nats.js.api import StorageType, StreamConfig
from nats.js.errors import BadRequestError

from schemas import subjects
from schemas.events import Event

log = logging.getLogger(__name__)


async def connect(url: str, name: str, first_connect_timeout_s: float = 60.0) -> Client:
    """Connect, retrying for a while: services may start before the server is up.

    Once connected, the client reconnects forever (a broker restart must not kill workers).
    """
    deadline = time.monotonic() + first_connect_timeout_s
    while True:
        try:
            return await nats.connect(
                url, name=name, connect_timeout=2, max_reconnect_attempts=-1,
                reconnect_time_wait=0.5, allow_reconnect=True,
                drain_timeout=5,  # shutdown must not hang on a broker that is already gone
            )
        except Exception as exc:  # NoServersError, OSError, timeouts
            if time.monotonic() > deadline:
                raise ConnectionError(f"cannot reach NATS at {url}: {exc!r}") from exc
            await asyncio.sleep(0.5)


async def ensure_events_stream(nc: Client, max_age_s: float = 24 * 3600) -> None:
    """Create the MOONBUS_EVENTS stream if it does not exist (idempotent)."""
    js = nc.jetstream()
    config = StreamConfig(
        name=subjects.EVENTS_STREAM,
        subjects=[subjects.EVENTS_ALL],
        storage=StorageType.FILE,
        max_age=max_age_s,
    )
    try:
        await js.add_stream(config)
    except BadRequestError:
        # exists with another config (e.g. max_age): keep the operator's stream
        log.info("stream %s already exists", subjects.EVENTS_STREAM)


class EventPublisher:
    """Publishes audit events for one service instance (fire and forget, captured by JetStream)."""

    def __init__(self, nc: Client, service: str, instance_id: str) -> None:
        self._nc = nc
        self._service = service
        self._instance_id = instance_id

    async def request(self, kind: str, request_id: str, **data: Any) -> None:
        await self._publish(subjects.request_event(kind, request_id), kind, request_id, data)

    async def instance(self, kind: str, instance_id: str, **data: Any) -> None:
        await self._publish(subjects.instance_event(kind, instance_id), kind, "", data)

    async def kv(self, kind: str, node: str, data: dict[str, Any]) -> None:
        await self._publish(subjects.kv_event(kind, node), kind, data.get("request_id", ""), data)

    async def _publish(self, subject: str, kind: str, request_id: str, data: dict[str, Any]) -> None:
        event = Event(kind, time.time(), self._service, self._instance_id, request_id, data)
        try:
            await self._nc.publish(subject, event.to_bytes())
        except Exception:  # the audit log must never take a request down
            log.exception("could not publish event %s", subject)


async def shutdown(nc: Client) -> None:
    """Drain (deliver what is in flight, then close); if the broker is already gone, just close."""
    try:
        await nc.drain()
    except Exception as exc:  # DrainTimeoutError, ConnectionClosedError, ...
        log.info("could not drain the NATS connection (%r); closing it", exc)
        await nc.close()
