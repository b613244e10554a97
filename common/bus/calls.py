"""Calls: request/reply that survives a broker blip, and the answering side that runs each call
once however often it arrives (`Replies`), so that a call whose reply was lost in a reconnect can
be asked again safely.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import secrets
import time
from typing import Awaitable, Callable

import nats
from nats.aio.msg import Msg
from nats.errors import NoRespondersError, TimeoutError as NatsTimeout

from common.bus.connection import OUTAGE_S, Connection

CALL_ID_HEADER = "Moonbus-Call-Id"  # the same on every attempt of one call: its responder answers it once
ATTEMPT_S = 2.0  # one attempt of a call that a lost reply must not stall for its whole timeout


async def request(nc: Connection, subject: str, data: bytes, timeout: float, outage_s: float = OUTAGE_S,
                  absent_s: float = 0.0, attempt_s: float | None = None) -> Msg:
    """Request/reply that survives a broker blip: if the connection was down (or just came back,
    so the responder may not have resubscribed) when an attempt timed out or found no responder,
    wait for the connection and ask again, for up to `outage_s` more. With `absent_s`, a missing
    responder (a process being restarted) is asked again for that long. Raises NoRespondersError
    or nats.errors.TimeoutError otherwise, like nc.request.

    With `attempt_s`, the call carries a call id (CALL_ID_HEADER) and each attempt waits at most
    `attempt_s`; one without an answer is sent again under the same id until `timeout` has
    passed. NATS delivers at most once: a request or its reply lost while either side reconnects
    then costs one attempt, not the whole timeout. Only for responders that answer through
    `Replies`, which runs a call once however often it arrives and answers every copy alike."""
    started = time.monotonic()
    give_up = started + timeout + outage_s
    headers = {CALL_ID_HEADER: secrets.token_hex(8)} if attempt_s else None
    while True:
        reconnects = nc.stats["reconnects"]
        try:
            if not nc.is_connected:
                await _wait_connected(nc, give_up)
            wait = timeout if not attempt_s else max(0.05, min(attempt_s, started + timeout - time.monotonic()))
            return await nc.request(subject, data, timeout=wait, headers=headers)
        except NoRespondersError:
            if time.monotonic() + 0.25 < started + absent_s:
                await asyncio.sleep(0.25)
                continue
            if not _blinked(nc, reconnects) or time.monotonic() + 0.2 > give_up:
                raise
            await asyncio.sleep(0.2)
        except (NatsTimeout, nats.errors.OutboundBufferLimitError):
            if attempt_s and time.monotonic() < started + timeout:
                continue  # the next attempt, under the same call id
            if not _blinked(nc, reconnects) or time.monotonic() + 0.2 > give_up:
                raise
            await asyncio.sleep(0.2)


class Replies:
    """The answering side of calls made with `request(..., attempt_s=...)`: each call (by its call
    id) runs once; a repeat that arrives while it runs waits for it, one that arrives after gets
    the same answer, for `keep_s`. Requests without a call id simply run.

    So a handler that is not idempotent by itself (reserve KV, pin blocks, accept a handoff)
    can be asked again safely after a reply was lost in a broker's reconnect."""

    def __init__(self, keep_s: float = 120.0, max_calls: int = 10_000) -> None:
        self.keep_s = keep_s
        self.max_calls = max_calls
        self._calls: collections.OrderedDict[str, tuple[float, asyncio.Future[bytes]]] = collections.OrderedDict()
        self.repeats = 0  # calls answered from an earlier run (a metric of lost replies)

    async def answer(self, msg: Msg, run: Callable[[], Awaitable[bytes]]) -> None:
        call_id = msg.headers.get(CALL_ID_HEADER) if msg.headers else None
        if call_id is None:
            reply = await run()
        else:
            self._forget_old(time.monotonic())
            known = self._calls.get(call_id)
            if known is not None:
                self.repeats += 1
                reply = await asyncio.shield(known[1])
            else:
                future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
                self._calls[call_id] = (time.monotonic(), future)
                try:
                    reply = await run()
                except BaseException as exc:
                    future.set_exception(exc)
                    future.exception()  # retrieved: a call that failed is not an unhandled error
                    self._calls.pop(call_id, None)
                    raise
                future.set_result(reply)
        if msg.reply:
            with contextlib.suppress(Exception):  # the asker may be gone (or the broker)
                await msg.respond(reply)

    def _forget_old(self, now: float) -> None:
        while self._calls:
            call_id, (at, future) = next(iter(self._calls.items()))
            if (now - at <= self.keep_s and len(self._calls) <= self.max_calls) or not future.done():
                return
            del self._calls[call_id]


def _blinked(nc: Connection, reconnects_before: int) -> bool:
    return not nc.is_connected or nc.stats["reconnects"] != reconnects_before or nc.recently_reconnected()


async def _wait_connected(nc: Connection, give_up: float) -> None:
    while not nc.is_connected:
        if nc.is_closed or time.monotonic() > give_up:
            raise NatsTimeout
        await asyncio.sleep(0.05)
