"""Integrity on a KV link without TLS, and each send's deadline: a relay between two real sockets
that rewrites KV and fixes its xxh3, or replays or reorders frames, is caught by default (every
frame carries a keyed MAC of the connection); a reader that takes a byte now and then is cut off
at its send's deadline, saying so, where each system call's timeout alone never fired."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import pytest
import xxhash

from common.security import LINK_NONCE_BYTES
from common.transport import TransportError, Transports
from common.transport import tcp
from schemas.transfer import ReadFrame, RegionRef, WriteFrame
from tests.relay import pump
from tests.wait import until_sync

SECRET = b"s" * 32
MiB = 1 << 20
PROOF = 32  # HMAC-SHA256
TRAILER = 8  # what follows a write's bytes: its xxh3, or the MAC in its place


class Owner:
    def __init__(self, nbytes: int, **options) -> None:
        self.transports = Transports("tcp", SECRET, 10.0, **options)
        self.transports.listen("127.0.0.1")
        self.memory = bytearray(nbytes)
        self.landed: list[tuple[dict, list, str | None]] = []
        self.ref = self.transports.register("r1", self.memory,
                                            lambda m, spans, error: self.landed.append((m, spans, error)))
        self.transports.handle("echo", lambda body, peer: body[::-1])


@pytest.fixture
def owner():
    side = Owner(16 * MiB)
    yield side
    side.transports.close()


@pytest.fixture
def peer():
    transports = Transports("tcp", SECRET, 10.0)
    yield transports
    transports.close()


def read_write_frame(sock: socket.socket) -> tuple[bytes, bytearray, bytes]:
    """A write frame off the wire: its op, length and header; its payload; its trailer."""
    head = tcp.recv_exactly(sock, 5)
    header = tcp.recv_exactly(sock, int.from_bytes(head[1:], "big"))
    assert head[:1] == tcp.OP_WRITE, head
    nbytes = sum(n for _, n in WriteFrame.from_bytes(header).pieces)
    return head + header, bytearray(tcp.recv_exactly(sock, nbytes)), tcp.recv_exactly(sock, TRAILER)


class Relay:
    """A man in the middle between the peer and the owner: it passes both handshakes on, then
    `outbound(src, dst)` (the peer's frames) and `inbound(src, dst)` (the owner's answers) may
    rewrite what follows before everything else is pumped through as it comes."""

    def __init__(self, upstream: str, outbound=None, inbound=None) -> None:
        host, _, port = upstream.rpartition(":")
        self.upstream = (host, int(port))
        self.outbound, self.inbound = outbound, inbound
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.locator = f"127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def endpoints(self) -> dict[str, str]:
        return {"tcp": self.locator}

    def _accept(self) -> None:
        client, _ = self.listener.accept()
        server = socket.create_connection(self.upstream)
        # the handshake: the owner's nonce, the peer's nonce and proof at once, the owner's proof
        threading.Thread(target=self._pump, args=(client, server, [LINK_NONCE_BYTES + PROOF], self.outbound),
                         daemon=True).start()
        threading.Thread(target=self._pump, args=(server, client, [LINK_NONCE_BYTES, PROOF], self.inbound),
                         daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, handshake: list[int], tamper) -> None:
        def first(src: socket.socket, dst: socket.socket) -> None:
            for n in handshake:
                dst.sendall(tcp.recv_exactly(src, n))
            if tamper is not None:
                tamper(src, dst)

        pump(src, dst, first=first)


def flip_and_fix_xxh3(src: socket.socket, dst: socket.socket) -> None:
    """The attacker's rewrite: one byte of the KV changed and the frame's xxh3 made to match it."""
    head, payload, _trailer = read_write_frame(src)
    payload[1000] ^= 0x10
    dst.sendall(head + payload + xxhash.xxh3_64(payload).intdigest().to_bytes(8, "big"))


def test_a_relay_that_rewrites_kv_and_fixes_its_xxh3_is_caught_by_default(owner, peer):
    relay = Relay(owner.transports.endpoints["tcp"], outbound=flip_and_fix_xxh3)
    kv = os.urandom(MiB)
    with peer.connect(relay.endpoints()) as ch:
        ch.write(RegionRef("r1", owner.ref.nbytes, relay.endpoints()), [(0, kv)], {"layer": 1})
        with pytest.raises(TransportError, match="failed its checksum"):
            ch.call("echo", b"x")
    [(meta, spans, error)] = owner.landed  # the owner is told, never handed it as good
    assert meta == {"layer": 1} and spans == [(0, MiB)] and "keyed MAC" in error


def test_without_the_mac_the_same_relay_goes_unnoticed(owner):
    """Why the MAC is the default: xxh3 alone catches accidents, not someone on the path."""
    plain = Transports("tcp", SECRET, 10.0, link_mac=False)
    relay = Relay(owner.transports.endpoints["tcp"], outbound=flip_and_fix_xxh3)
    kv = os.urandom(MiB)
    try:
        with plain.connect(relay.endpoints()) as ch:
            ch.write(RegionRef("r1", owner.ref.nbytes, relay.endpoints()), [(0, kv)], {"layer": 1})
            assert ch.call("echo", b"x") == b"x"
    finally:
        plain.close()
    assert owner.landed == [({"layer": 1}, [(0, MiB)], None)] and bytes(owner.memory[:MiB]) != kv


@pytest.mark.parametrize("attack", ["replayed", "reordered"])
def test_a_replayed_or_reordered_write_is_refused(owner, peer, attack):
    """Two writes of one layer, the older first: sent again after the newer, or the two swapped,
    the older would be left in place of the newer. Each frame's MAC covers its number on the
    connection."""
    def rearrange(src: socket.socket, dst: socket.socket) -> None:
        older, newer = read_write_frame(src), read_write_frame(src)
        frames = [older, newer, older] if attack == "replayed" else [newer, older]
        dst.sendall(b"".join(head + payload + trailer for head, payload, trailer in frames))

    relay = Relay(owner.transports.endpoints["tcp"], outbound=rearrange)
    ref = RegionRef("r1", owner.ref.nbytes, relay.endpoints())
    with peer.connect(relay.endpoints()) as ch:
        ch.write(ref, [(0, b"older KV" * 1000)], {"version": 1})
        ch.write(ref, [(0, b"newer KV" * 1000)], {"version": 2})
        with pytest.raises(TransportError, match="failed its checksum"):
            ch.call("echo", b"x")
    errors = [(meta["version"], error is None) for meta, _, error in owner.landed]
    # replayed: both land, then the replay fails; reordered: the first to arrive fails, and nothing after it counts
    assert errors == ([(1, True), (2, True), (1, False)] if attack == "replayed" else [(2, False)])


def test_a_read_whose_answer_is_rewritten_on_the_way_fails(owner, peer):
    owner.memory[:MiB] = os.urandom(MiB)

    def flip_reply(src: socket.socket, dst: socket.socket) -> None:
        head = tcp.recv_exactly(src, 4)
        reply = head + tcp.recv_exactly(src, int.from_bytes(head, "big"))
        payload = bytearray(tcp.recv_exactly(src, MiB))
        payload[12345] ^= 1
        dst.sendall(reply + payload)

    relay = Relay(owner.transports.endpoints["tcp"], inbound=flip_reply)
    into = bytearray(MiB)
    with peer.connect(relay.endpoints()) as ch:
        with pytest.raises(TransportError, match="a reply failed its checksum"):
            ch.read(RegionRef("r1", owner.ref.nbytes, relay.endpoints()), [(0, into)])


def test_a_frames_mac_does_not_depend_on_how_its_bytes_are_cut():
    """Each end feeds a frame's bytes as they come (a small frame is MAC'd at once, a large one
    streams): the same bytes, cut anywhere, are the same MAC, and the next frame's differs."""
    import random

    rng = random.Random(3)
    key = os.urandom(16)
    for size in (0, 100, 64 << 10, (64 << 10) + 1, 3 * MiB + 5):
        data = os.urandom(size)
        sender, receiver = tcp._Seal(key), tcp._Seal(key)
        whole = sender.open()
        whole.update(data)
        cut, at = receiver.open(), 0
        while at < size:
            n = rng.choice([1, 7, 5000, 70_000, MiB])
            cut.update(memoryview(data)[at:at + n])
            at += n
        tag = whole.tag()
        assert cut.tag() == tag
        again = sender.open()
        again.update(data)
        assert again.tag() != tag  # the frame's number is part of its MAC


# --- each send's deadline ---------------------------------------------------------------------------
def test_a_sends_deadline_is_its_bytes_at_the_minimum_rate_but_never_under_the_floor():
    pace = tcp.Pace(floor_s=5.0, min_rate=1e6)
    assert pace.seconds(1000) == 5.0 and pace.seconds(100_000_000) == 100.0


def drip(sock: socket.socket, stop: threading.Event) -> int:
    """Read one byte every 0.2 s, as a slow reader does, until the connection ends; the bytes read."""
    got = 0
    while not stop.is_set():
        try:
            if not sock.recv(1):
                break
        except OSError:
            break
        got += 1
        stop.wait(0.2)
    return got


def test_a_reader_dripping_a_listeners_answer_is_cut_off_and_frees_its_slot(caplog):
    """A read of 16 MiB (more than both kernels' buffers hold) taken a byte every 0.2 s: each
    send call's own timeout (10 s) never fires, the send's deadline (0.5 s here) does."""
    owner = Owner(16 * MiB, send_floor_s=0.5, send_min_rate=1e9)
    backend = owner.transports.backends["tcp"]
    caplog.set_level(logging.WARNING, logger="common.transport.tcp")
    sock = socket.socket()
    stop = threading.Event()
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        host, _, port = owner.transports.endpoints["tcp"].rpartition(":")
        sock.connect((host, int(port)))
        sock.settimeout(30)  # a guard only
        tcp.client_handshake(sock, SECRET)
        sock.sendall(tcp.frame(tcp.OP_READ, ReadFrame("r1", [[0, 16 * MiB]]).to_bytes()))
        threading.Thread(target=drip, args=(sock, stop), daemon=True).start()
        until_sync(lambda: [r for r in caplog.records if "broke" in r.getMessage()], "the owner cuts the reader off")
        [line] = [r.getMessage() for r in caplog.records if "broke" in r.getMessage()]
        assert "slower than 1000 MB/s: the send was cut off at its deadline of 0.5 s" in line, line
        until_sync(lambda: backend._slots._value == tcp.MAX_CONNECTIONS, "its connection slot is free again")
        assert owner.transports.unregister("r1", timeout_s=5)  # and the region it was reading
        until_sync(lambda: sends_fail(sock), "the reader's connection is reset")
    finally:
        stop.set()
        sock.close()
        owner.transports.close()


def sends_fail(sock: socket.socket) -> bool:
    try:
        sock.send(b"x")
    except OSError:
        return True
    return False


def test_a_writer_to_a_dripping_listener_gets_a_transport_error_saying_so():
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    stop = threading.Event()

    def slow_owner() -> None:
        conn, _ = listener.accept()
        with conn:
            tcp.server_handshake(conn, SECRET)
            drip(conn, stop)

    threading.Thread(target=slow_owner, daemon=True).start()
    writer = Transports("tcp", SECRET, 10.0, send_floor_s=0.5, send_min_rate=1e9)
    locator = f"127.0.0.1:{listener.getsockname()[1]}"
    try:
        with writer.connect({"tcp": locator}) as ch:
            started = time.monotonic()
            with pytest.raises(TransportError, match=r"slower than 1000 MB/s: the send was cut off at its "
                                                     r"deadline of 0.5 s"):
                ch.write(RegionRef("r1", 16 * MiB, {"tcp": locator}), [(0, bytes(16 * MiB))])
            assert time.monotonic() - started < 10  # its deadline, not a call's 10 s timeout
    finally:
        stop.set()
        writer.close()
        listener.close()
