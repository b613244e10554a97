"""The streamed handoff, live: the KV goes to the decode node layer by layer over the transport.

One cluster of tiny-random, 1 prefill and 2 decode instances (each on its own node), prompts
prefilled in 128-token chunks so that every request streams many slices. The prefill's transfer
steps time out after 3 s (`--transfer-timeout 3`, default 60), so that a frozen destination fails
the handoff quickly. Over tcp the prefill stripes each slice over two connections
(`--tcp-streams 2`, with the stripe minimum lowered below one slice), so that every test here also
runs the striped path: parts on two connections, the owner handed each slice once, the completion
notice after a fence. Each decode node's transport listener is reached through a relay of the
test's (its messenger advertises the relay's address), so faults come at a moment the test
chooses, whatever the machine's speed: the relays hold the first bytes of a handoff (its
destination is reserved: they follow the reservation's reply) while the decode node's messenger
(the destination's owner) is frozen (SIGSTOP) or killed (SIGKILL), then let them go.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
import time

import aiohttp
import pytest

from common import bus
from common.security import LINK_NONCE_BYTES
from common.transport.tcp import recv_exactly
from common.transport import resolve
from schemas import subjects
from schemas.pool import PoolStatus
from schemas.workers import StatusReply
from tests.integration.conftest import (AUTO_DTYPE, KV_DTYPES, collect_request_events, free_port, post,
                                        assert_greedy, start_cluster, tiny_kv_bytes_per_token)
from tests.integration.test_kv_pool import text_of
from tests.relay import pump
from tests.wait import until

pytestmark = pytest.mark.integration
CHUNK = 128
BOUND_S = 90
STRIPE_MIN = 16 << 10
RELAY_HOSTS = {"node-d0": "127.0.0.3", "node-d1": "127.0.0.2"}  # loopback too: each node's KV goes through its relay
assert CHUNK * min(map(tiny_kv_bytes_per_token, KV_DTYPES)) // 4 >= STRIPE_MIN  # one layer's slice of a chunk is striped
# (transport, KV dtype) of the clusters: every transport this host can run (rdma: a device), each in
# both dtypes for the test of the bytes moved; the fault tests run in the dtype `auto` picks here
TRANSPORTS = resolve("auto")
EVERY_DTYPE = [(t, d) for t in TRANSPORTS for d in KV_DTYPES]
AUTO = [(t, AUTO_DTYPE) for t in TRANSPORTS]


class Gate:
    """Shared by the relays: once `close()`d, the next bytes any relay is to pass towards its node
    (a handoff's first, over tcp its connection's handshake or its first slice, over rdma its
    control connection's) wait there until `open()`; the future `close()` returned says which node."""

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.opened.set()
        self.lock = threading.Lock()
        self.waiting: tuple[asyncio.AbstractEventLoop, asyncio.Future] | None = None

    def close(self) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        held = loop.create_future()
        with self.lock:
            self.waiting = loop, held
            self.opened.clear()
        return held

    def open(self) -> None:
        with self.lock:
            self.waiting = None
            self.opened.set()

    def pass_towards(self, node: str) -> None:
        """On a relay's thread, before it passes bytes towards `node`."""
        with self.lock:
            waiting, self.waiting = self.waiting, None
        if waiting is not None:
            loop, held = waiting
            loop.call_soon_threadsafe(lambda: held.done() or held.set_result(node))
        self.opened.wait()


class Relay:
    """A TCP relay in front of a decode node's transport listener (the node advertises the relay's
    address): bytes pass unchanged, except that they wait at the `gate` while it is closed, and that
    once `arm()`ed, the first write frame of the next connection gets one bit of its payload flipped
    on the way, as a bad NIC or bad memory would do. The sender's checksum is of the bytes it meant
    to send."""

    HANDSHAKE = LINK_NONCE_BYTES + 32  # what the client sends first: its nonce and its proof (HMAC-SHA256)

    def __init__(self, node: str, gate: Gate, listen: tuple[str, int], upstream: tuple[str, int]) -> None:
        self.node, self.gate = node, gate
        self.listener = socket.create_server(listen)
        self.upstream = upstream
        self.armed = False
        self.flipped: list[dict] = []  # the header of each write corrupted
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self) -> None:
        with self.lock:
            self.armed = True

    def close(self) -> None:
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            try:
                server = socket.create_connection(self.upstream)
            except OSError:  # the node's listener is down (its messenger restarting): this one connection fails
                client.close()
                continue
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, outbound: bool) -> None:
        if outbound:
            pump(src, dst, self._towards_node, first=self._first_frame)
        else:
            pump(src, dst)

    def _towards_node(self, data: bytes) -> bytes:
        self.gate.pass_towards(self.node)
        return data

    def _first_frame(self, src: socket.socket, dst: socket.socket) -> None:
        handshake = recv_exactly(src, self.HANDSHAKE)
        self.gate.pass_towards(self.node)
        dst.sendall(handshake)
        head = recv_exactly(src, 5)
        header = recv_exactly(src, int.from_bytes(head[1:], "big"))
        self.gate.pass_towards(self.node)
        dst.sendall(head + header)
        if head[:1] != b"W":
            return
        frame = json.loads(header)
        payload = bytearray(recv_exactly(src, sum(n for _, n in frame["pieces"]) + 8))  # the bytes and their xxh3
        with self.lock:
            if self.armed and len(payload) > 8 + 1000:
                self.armed = False
                payload[1000] ^= 0x10
                self.flipped.append(frame)
        self.gate.pass_towards(self.node)
        dst.sendall(payload)


@pytest.fixture(scope="module")
def streamed(request, tmp_path_factory, tiny_profile):
    transport, dtype = request.param
    striped = ["--tcp-streams", "2", "--tcp-stripe-min", str(STRIPE_MIN)] if transport == "tcp" else []
    gate, relays, relayed = Gate(), {}, {}
    for node, host in RELAY_HOSTS.items():
        port = free_port()  # the node's transport listener; its relay listens on the same port of another address
        relays[node] = Relay(node, gate, (host, port), ("127.0.0.1", port))
        relayed[f"messenger-{node.removeprefix('node-')}"] = ["--transfer-port", str(port), "--advertise-host", host]
    cluster = start_cluster(tmp_path_factory.mktemp("handoff"), decode=2, prefill_chunk=CHUNK, profile=tiny_profile,
                            transport=transport, dtype=dtype,
                            service_args={"prefill": ["--transfer-timeout", "3", *striped], **relayed})
    cluster.gate, cluster.relay = gate, relays["node-d1"]
    yield cluster
    cluster.stop()
    for relay in relays.values():
        relay.close()


def body(prompt: str, max_tokens: int = 16) -> dict:
    return {"model": "tiny-random", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "return_token_ids": True}


@pytest.mark.parametrize("streamed", EVERY_DTYPE, indirect=True, ids=lambda p: "-".join(p))
async def test_greedy_output_is_identical_with_the_streamed_handoff(streamed, tiny_in):
    tokenizer, model = tiny_in(streamed.spec.dtype)
    prompt = text_of(1500, seed=900)
    ids = tokenizer(prompt)["input_ids"]
    assert len(ids) > 10 * CHUNK  # many chunks, each layer's slices streamed while the next computes
    started = time.monotonic()
    status, first, headers = await post(f"{streamed.spec.url}/v1/completions", body(prompt))
    took_s = time.monotonic() - started
    assert status == 200, first
    assert_greedy(first["choices"][0]["token_ids"], model, ids, 16, True)
    events = await collect_request_events(streamed.spec.nats_url, headers["X-Request-Id"])
    [moved] = [e["data"] for e in events if e["kind"] == "kv_transferred"]
    assert moved["streamed"] and moved["transport"] == streamed.spec.transport
    assert moved["src_node"] != moved["dest_node"]
    assert moved["bytes"] == len(ids) * tiny_kv_bytes_per_token(streamed.spec.dtype)  # every slice, once
    # the tail (the last layer's compute done -> the decode node holds the whole KV) is measured by
    # `moonbus bench transfer`; its size depends on the machine, so here it is only seen to be a
    # part of the request's own time, as its client measured it
    assert 0 < moved["tail_s"] < took_s
    # the same prompt again: its prefix comes from the prefill node's pool and is streamed too
    status, again, _ = await post(f"{streamed.spec.url}/v1/completions", body(prompt))
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]


async def stream_with_fault(cluster, prompt: str, fault) -> tuple[str, list[dict], str]:
    """Stream a completion; once its destination is reserved on a decode node (the relays hold the
    handoff's first bytes to it), `fault(messenger)`, then let the handoff go on.
    Returns (request id, events, the messenger hit: '' if the request never reached a decode node)."""
    hit = ""
    held = cluster.gate.close()

    async def strike() -> None:
        nonlocal hit
        node = await held
        hit = f"messenger-{node.removeprefix('node-')}"
        try:
            fault(hit)
        finally:
            cluster.gate.open()

    striking = asyncio.ensure_future(strike())
    events, request_id = [], ""
    try:
        timeout = aiohttp.ClientTimeout(total=BOUND_S * 2)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async with session.post(f"{cluster.spec.url}/v1/completions", json=body(prompt, 24) | {"stream": True}) as resp:
                assert resp.status == 200, await resp.text()
                request_id = resp.headers["X-Request-Id"]
                async for line in resp.content:
                    if line.startswith(b"data: "):
                        data = line[6:].strip()
                        events.append({"done": True} if data == b"[DONE]" else json.loads(data))
    finally:
        striking.cancel()
        cluster.gate.open()
    return request_id, events, hit


def tokens_of(events: list[dict]) -> list[int]:
    return [t for e in events if e.get("choices") for t in e["choices"][0].get("token_ids", [])]


async def messenger_incarnations(cluster) -> dict[str, str]:
    """The conductor's view: messenger -> the incarnation (process) it last heard."""
    nc = await bus.connect(cluster.spec.nats_url, "test-status")
    try:
        status = StatusReply.from_bytes((await nc.request(subjects.CONDUCTOR_STATUS, b"", timeout=10)).data)
    finally:
        await nc.drain()
    return {w.instance_id: w.incarnation for w in status.workers if w.role == "messenger"}


async def no_request_files_left(cluster, nodes=("node-p0", "node-d0", "node-d1")) -> None:
    """Nothing outlives its request: no KV files, no reservations, on any node (within the bound)."""
    nc = await bus.connect(cluster.spec.nats_url, "test-leaks")
    try:
        deadline = time.monotonic() + BOUND_S
        while True:
            left = {}
            for node in nodes:
                msg = await nc.request(subjects.messenger_control(node, "status"), b"{}", timeout=10)
                status = PoolStatus.from_bytes(msg.data)
                if status.request_files or status.holders:
                    left[node] = (status.request_files, status.holders)
            if not left:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"left behind: {left}")
            await asyncio.sleep(0.5)
    finally:
        await nc.drain()


@pytest.mark.parametrize("streamed", AUTO, indirect=True, ids=lambda p: "-".join(p))
async def test_a_frozen_destination_fails_the_handoff_and_the_request_resumes_with_the_same_tokens(streamed, tiny):
    cluster = streamed
    tokenizer, model = tiny
    frozen = []

    def thaw() -> None:
        while frozen:
            cluster.procs[frozen.pop()].popen.send_signal(signal.SIGCONT)

    def freeze(messenger: str) -> None:
        cluster.procs[messenger].popen.send_signal(signal.SIGSTOP)
        frozen.append(messenger)

    async def on_routed(msg) -> None:
        # the handoff's next step timed out (after 3 s) and the request is dispatched again: the
        # messenger comes back (a stall, not a death) and answers the new attempt's reservation
        if json.loads(msg.data)["data"].get("attempt", 0) > 0:
            thaw()

    nc = await bus.connect(cluster.spec.nats_url, "test-thaw")
    try:
        await nc.subscribe(subjects.request_event("routed", "*"), cb=on_routed)
        await bus.flush(nc)
        prompt = text_of(3000, seed=901)
        request_id, events, hit = await stream_with_fault(cluster, prompt, freeze)
        assert hit, "the request reached no decode node"
        ids = tokenizer(prompt)["input_ids"]
        assert events[-1] == {"done": True} and not [e for e in events if "error" in e], events[-3:]
        assert_greedy(tokens_of(events), model, ids, 24, True)  # resumed: nothing lost or repeated
        path = await collect_request_events(cluster.spec.nats_url, request_id)
        kinds = [e["kind"] for e in path]
        assert [k for k in kinds if k in ("completed", "failed", "cancelled", "rejected")] == ["completed"]
        assert kinds.count("routed") >= 2  # the first attempt's handoff failed; another took over
    finally:
        thaw()
        await nc.drain()
    await no_request_files_left(cluster)


@pytest.mark.parametrize("streamed", AUTO, indirect=True, ids=lambda p: "-".join(p))
async def test_a_destination_killed_midway_fails_or_resumes_the_request_cleanly(streamed, tiny):
    cluster = streamed
    tokenizer, model = tiny
    killed = []

    def kill(messenger: str) -> None:
        cluster.procs[messenger].popen.send_signal(signal.SIGKILL)
        killed.append(messenger)

    incarnations = await messenger_incarnations(cluster)
    prompt = text_of(3000, seed=911)
    request_id, events, hit = await stream_with_fault(cluster, prompt, kill)
    assert hit, "the request reached no decode node"
    assert events[-1] == {"done": True}
    errors = [e for e in events if "error" in e]
    if errors:  # one clear error, no hang
        assert len(errors) == 1 and errors[0]["error"]["message"], errors
    else:
        assert_greedy(tokens_of(events), model, tokenizer(prompt)["input_ids"], 24, True)
    path = await collect_request_events(cluster.spec.nats_url, request_id)
    assert len([e for e in path if e["kind"] in ("completed", "failed", "cancelled", "rejected")]) == 1
    for messenger in killed:
        cluster.procs[messenger].popen.wait(10)
        cluster.restart(messenger)  # as the supervisor would: it sweeps what its predecessor reserved

    async def known_again() -> bool:  # the conductor routes to the restarted messenger's node again
        now = await messenger_incarnations(cluster)
        return all(now.get(m, incarnations[m]) != incarnations[m] for m in killed)

    await until(known_again, "the conductor knows the restarted messenger")
    status, after, _ = await post(f"{cluster.spec.url}/v1/completions", body(text_of(400, seed=920)), timeout_s=BOUND_S)
    assert status == 200, after
    await no_request_files_left(cluster)


# the relay reads tcp frames: rdma writes land without a byte stream to corrupt
@pytest.mark.parametrize("streamed", [("tcp", AUTO_DTYPE)], indirect=True, ids=lambda p: "-".join(p))
async def test_a_slice_corrupted_on_the_wire_is_caught_on_arrival_and_the_request_completes_elsewhere(streamed, tiny):
    """One bit of a slice flipped between prefill and node-d1 (its relay): node-d1's messenger finds
    the slice's checksum wrong on arrival, the completion fails naming it, and the request is
    dispatched again, away from node-d1, with the tokens an undisturbed run gives."""
    tokenizer, model = tiny
    cluster, relay = streamed, streamed.relay
    relay.arm()
    hit = None
    for round_ in range(6):  # the conductor picks the decode node: three at once, so that node-d1 gets one
        prompts = [text_of(1200, seed=930 + 3 * round_ + i) for i in range(3)]
        answers = await asyncio.gather(*(post(f"{cluster.spec.url}/v1/completions", body(p), timeout_s=BOUND_S)
                                         for p in prompts))
        for prompt, (status, out, headers) in zip(prompts, answers):
            assert status == 200, out
            assert_greedy(out["choices"][0]["token_ids"], model, tokenizer(prompt)["input_ids"], 16, True)
            path = await collect_request_events(cluster.spec.nats_url, headers["X-Request-Id"])
            kinds = [e["kind"] for e in path]
            assert [k for k in kinds if k in ("completed", "failed", "cancelled", "rejected")] == ["completed"]
            if "migrated" in kinds:
                hit = path
        if relay.flipped:
            break
    assert len(relay.flipped) == 1, "no request's KV went to node-d1 in 18 requests"
    assert hit is not None, "the corrupted slice went unnoticed"
    [migrated] = [e["data"] for e in hit if e["kind"] == "migrated"]
    assert "checksum" in migrated["reason"] and "node-d1" in migrated["reason"], migrated
    path = hit
    [moved] = [e["data"] for e in path if e["kind"] == "kv_transferred"]
    assert moved["dest_node"] == "node-d0"  # the new attempt avoided the node whose handoff failed
    await no_request_files_left(cluster)
