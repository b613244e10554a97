"""Calls over a real nats-server whose reply is lost: asked again under the same call id, run once;
and an event the broker refuses holds back no later one.

A responder that handles a request and then loses its reply (as when it reconnects to another
server just then) is stood in for by one that drops its first answer on the floor. The asker
must get the answer from its next attempt, and the handler (reserve KV, pin blocks) must have run
once, not once per attempt.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import pytest

from common import bus
from schemas import subjects
from tools.moonbus.cluster.processes import free_port

pytestmark = pytest.mark.integration


@dataclass
class LostReply:
    """A request whose reply will not reach its asker."""

    headers: dict
    data: bytes
    reply: str = ""


async def test_a_lost_reply_costs_one_attempt_and_the_handler_runs_once(bare_nats_url):
    asker = await bus.connect(bare_nats_url, "asker")
    responder = await bus.connect(bare_nats_url, "responder")
    replies, runs, deliveries = bus.Replies(), [], []

    async def on_call(msg) -> None:
        deliveries.append(msg.data)

        async def run() -> bytes:
            runs.append(msg.data)
            await asyncio.sleep(0.05)
            return b"slot-7"

        if len(deliveries) == 1:  # handled, and its reply lost on the way
            msg = LostReply(msg.headers, msg.data)
        await replies.answer(msg, run)

    try:
        await responder.subscribe("test.reserve", cb=on_call)
        await bus.flush(responder)
        # the whole call may take 30 s; each attempt waits 0.3 s
        reply = await bus.request(asker, "test.reserve", b"reserve 4 blocks", timeout=30.0, attempt_s=0.3)
        assert reply.data == b"slot-7"
        assert len(deliveries) == 2 and len(runs) == 1
        assert replies.repeats == 1
    finally:
        await asker.close()
        await responder.close()


async def test_a_repeat_that_arrives_while_the_call_runs_waits_for_it(bare_nats_url):
    asker = await bus.connect(bare_nats_url, "asker")
    responder = await bus.connect(bare_nats_url, "responder")
    replies, runs = bus.Replies(), []
    release = asyncio.Event()

    async def on_call(msg) -> None:
        async def run() -> bytes:
            runs.append(1)
            await release.wait()  # slower than an attempt: the asker sends the call again meanwhile
            return b"accepted"

        asyncio.get_running_loop().create_task(replies.answer(msg, run))

    try:
        await responder.subscribe("test.accept", cb=on_call)
        await bus.flush(responder)
        call = asyncio.ensure_future(bus.request(asker, "test.accept", b"accept", timeout=30.0, attempt_s=0.2))
        while replies.repeats < 2:  # two repeats arrived while the first still runs
            await asyncio.sleep(0.05)
        release.set()
        assert (await call).data == b"accepted"
        assert len(runs) == 1
    finally:
        await asker.close()
        await responder.close()



async def test_an_event_the_bus_refuses_holds_back_no_later_one(tmp_path):
    """A messenger's user once could not publish its link_refused events: each was sent again for
    120 s and held back every later event of that messenger (its KV events among them)."""
    import json
    import subprocess

    from nats.js.api import ConsumerConfig, DeliverPolicy

    from common.config import NatsAuth
    from tools.moonbus.cluster.processes import nats_server_binary

    port = free_port()
    (tmp_path / "pw").write_text("writer-password")
    users = [{"user": "admin", "password": "admin-password"},
             {"user": "writer", "password": "writer-password",
              "permissions": {"publish": {"allow": [subjects.request_event("allowed", "*")]},
                              "subscribe": {"allow": ["_INBOX_writer.>"]}}}]
    conf = tmp_path / "nats.conf"
    conf.write_text(json.dumps({"host": "127.0.0.1", "port": port, "jetstream": {"store_dir": str(tmp_path / "js")},
                                "authorization": {"users": users}}))
    server = subprocess.Popen([nats_server_binary(), "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        admin = await bus.connect(f"nats://admin:admin-password@127.0.0.1:{port}", "admin", first_connect_timeout_s=20)
        await bus.ensure_events_stream(admin)
        writer = await bus.connect(f"nats://127.0.0.1:{port}", "writer", NatsAuth("writer", str(tmp_path / "pw")))
        publisher = bus.EventPublisher(writer, "gateway", "gateway")
        await publisher.request("denied", "r1")
        await publisher.request("allowed", "r1")
        # the refused one is dropped once the broker has said so (its acknowledgement's timeout,
        # EVENT_ACK_S): far inside the EVENT_MAX_AGE_S it was once retried for
        assert bus.EVENT_ACK_S * 10 < bus.EVENT_MAX_AGE_S
        assert await publisher.flush(timeout_s=bus.EVENT_ACK_S * 10)
        sub = await admin.jetstream().subscribe(subjects.events_of_request("r1"), ordered_consumer=True,
                                                config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL))
        stored = json.loads((await sub.next_msg(timeout=10)).data)
        assert stored["kind"] == "allowed"
        await bus.shutdown(writer)
        await bus.shutdown(admin)
    finally:
        server.kill()
        server.wait()


async def test_a_subscription_flushed_with_bus_flush_is_in_place_for_every_other_connection(bare_nats_url):
    """nats-py's own flush can return before the server has read a SUB made just before it (its
    PING overtakes the buffer); bus.flush must not: each new responder is asked at once, from
    another connection, and must be found."""
    asker = await bus.connect(bare_nats_url, "asker")
    responder = await bus.connect(bare_nats_url, "responder")

    async def echo(msg) -> None:
        await msg.respond(msg.data)

    try:
        for i in range(200):
            await responder.subscribe(f"test.fresh.{i}", cb=echo)
            await bus.flush(responder)
            reply = await asker.request(f"test.fresh.{i}", str(i).encode(), timeout=10.0)  # not bus.request: no retry
            assert reply.data == str(i).encode()
    finally:
        await asker.close()
        await responder.close()


async def test_a_background_subscription_lets_a_request_that_came_during_its_burst_go_first(bare_nats_url):
    """A burst of heartbeats, then a route: on a background subscription the route is handled
    after a few of them, not after the whole burst (what it is without)."""
    sender = await bus.connect(bare_nats_url, "sender")
    receiver = await bus.connect(bare_nats_url, "receiver")
    burst = 200
    try:
        for background in (False, True):
            order: list[str] = []
            done = asyncio.Event()

            async def on_beat(msg) -> None:  # a handler that does not yield, as a heartbeat's, and works a while
                until = time.perf_counter() + 0.001
                while time.perf_counter() < until:
                    pass
                order.append("beat")
                if order.count("beat") == burst:
                    done.set()

            routed = asyncio.Event()

            async def on_route(msg) -> None:
                order.append("route")
                routed.set()

            beats, routes = f"test.beat.{background}", f"test.route.{background}"
            await bus.subscribe(receiver, beats, on_beat, background=background)
            await bus.subscribe(receiver, routes, on_route)
            await bus.flush(receiver)
            for _ in range(burst):  # buffered and written together: they arrive in one read
                await sender.publish(beats, b"b")
            await sender.publish(routes, b"r")
            await sender.flush()
            await asyncio.wait_for(asyncio.gather(done.wait(), routed.wait()), 10)
            assert order.count("route") == 1
            if background:  # it waits for the beats before it was read, one at most after: not the burst's 200 ms
                assert order.index("route") < burst // 2
            else:
                assert order.index("route") == burst
    finally:
        await bus.shutdown(sender)
        await bus.shutdown(receiver)


async def test_a_typed_subscription_hands_over_what_decodes_and_drops_the_rest(bare_nats_url):
    """One place decodes a subscription's wire type: a malformed message is dropped there, and the
    subscription goes on with the next."""
    from schemas.tokens import Cancel

    sender = await bus.connect(bare_nats_url, "sender")
    receiver = await bus.connect(bare_nats_url, "receiver")
    heard: list[tuple[Cancel, str]] = []
    second = asyncio.Event()

    async def on_cancel(cancel: Cancel, msg) -> None:
        heard.append((cancel, msg.subject))
        if len(heard) == 2:
            second.set()

    try:
        await bus.receive(receiver, subjects.REQUEST_CANCEL, Cancel, on_cancel)
        await bus.flush(receiver)
        for data in (b"not json", Cancel("r-1", 0).to_bytes(), b'{"request_id": "has spaces", "attempt": 0}',
                     b'{"request_id": "r-2", "attempt": "zero"}', Cancel("r-2", 3).to_bytes()):
            await sender.publish(subjects.REQUEST_CANCEL, data)
        await sender.flush()
        await asyncio.wait_for(second.wait(), 10)
        assert heard == [(Cancel("r-1", 0), subjects.REQUEST_CANCEL), (Cancel("r-2", 3), subjects.REQUEST_CANCEL)]
    finally:
        await bus.shutdown(sender)
        await bus.shutdown(receiver)
