"""Subscriptions and plain publishes that never raise into a service's loop.

A subscription names the wire type its messages carry: each message is decoded once, here, and a
bad one (not that type, or failing its checks) is logged with its subject and dropped, here, so
no handler decodes for itself. A handler that fails on one message loses that message only.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Awaitable, Callable, TypeVar

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from schemas import subjects
from schemas.codec import Wire, WireError

if TYPE_CHECKING:
    from schemas.workers import WorkerInfo

log = logging.getLogger(__name__)

W = TypeVar("W", bound=Wire)


async def subscribe(nc: Client, subject: str, handler: Callable[[Msg], Awaitable[None]], queue: str = "",
                    background: bool = False) -> Subscription:
    """Subscribe with a handler of raw messages that can never take the subscription down: an
    exception (a bug on one message) is logged with the subject and the message dropped.

    `background`: after each message the subscription gives way to the event loop, so that what
    arrived meanwhile on other subscriptions (a route waiting for its answer) runs before the
    next of a burst (every instance's heartbeat read in one go). Without it a subscription works
    through all its queued messages before any other handler runs (nats-py hands each one its
    own task, which does not yield while its queue holds messages)."""

    async def guarded(msg: Msg) -> None:
        try:
            await handler(msg)
        except Exception:
            log.exception("dropped a message on %s (%d bytes)", msg.subject, len(msg.data))
        if background:
            await asyncio.sleep(0)

    return await nc.subscribe(subject, queue=queue, cb=guarded)


async def receive(nc: Client, subject: str, message: type[W], handler: Callable[[W, Msg], Awaitable[None]],
                  queue: str = "", background: bool = False) -> Subscription:
    """Subscribe to messages of one wire type: the handler gets each decoded, with the message it
    came in (its subject, its reply); one that does not decode is logged and dropped."""

    async def decoded(msg: Msg) -> None:
        try:
            value = message.from_bytes(msg.data)
        except WireError as exc:
            log.warning("dropped a malformed message on %s: %s", msg.subject, exc)
            return
        await handler(value, msg)

    return await subscribe(nc, subject, decoded, queue=queue, background=background)


async def publish(nc: Client, subject: str, data: bytes) -> bool:
    """Publish, never raising: False (logged) if it could not be sent or buffered."""
    try:
        await nc.publish(subject, data)
        return True
    except Exception as exc:  # closed connection, full reconnect buffer, bad subject
        log.error("could not publish to %s: %r", subject, exc)
        return False


async def heartbeat(nc: Client, info: "WorkerInfo") -> bool:
    """Publish an instance's heartbeat on its own subject (the only one its credentials may use)."""
    return await publish(nc, subjects.worker_heartbeat(info.role, info.instance_id), info.to_bytes())
