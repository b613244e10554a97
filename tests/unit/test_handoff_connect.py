"""The prefill's KV link to its decode node (services/prefill/handoff.py, Handoff.connect): a
listener that turns the link away during the handshake (a door crowded with strangers'
connections) is tried again, a bounded number of times within the handoff's timeout and while the
attempt stands; a port no one listens on is final at once."""

from __future__ import annotations

import asyncio
import socket
import threading
from types import SimpleNamespace

import pytest

from common.transport import TransportError, Transports, TransportTurnedAway
from services.prefill import handoff
from services.prefill.handoff import Handoff
from tests.relay import pump
from tests.unit.test_transport import SECRET, Owner


class TurningAway:
    """A listener in front of an owner's: it closes the first `turn_away` connections as soon as
    it takes them (as a crowded door does), then passes bytes both ways unchanged."""

    def __init__(self, upstream: str, turn_away: int) -> None:
        host, _, port = upstream.rpartition(":")
        self.upstream = (host, int(port))
        self.turn_away = turn_away
        self.taken = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.locator = "127.0.0.1:%d" % self.listener.getsockname()[1]
        self.socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            self.taken += 1
            if self.taken <= self.turn_away:
                sock.close()
                continue
            up = socket.create_connection(self.upstream)
            self.socks += [sock, up]
            for a, b in ((sock, up), (up, sock)):
                threading.Thread(target=pump, args=(a, b), daemon=True).start()

    def close(self) -> None:
        self.listener.close()
        for s in self.socks:
            s.close()


@pytest.fixture
def owner():
    side = Owner(1 << 20)
    yield side
    side.transports.close()


@pytest.fixture
def peer():
    transports = Transports("tcp", SECRET, 30.0)
    yield transports
    transports.close()


def a_handoff(transports: Transports, cancelled=lambda: False) -> Handoff:
    """A Handoff as far as its connect needs one (the request it serves, its timeout)."""
    h = Handoff.__new__(Handoff)
    h.transports, h.timeout_s, h.cancelled = transports, 30.0, cancelled
    h.task = SimpleNamespace(request_id="req-1", decode_node="node-d0")
    return h


def region_at(locator: str) -> SimpleNamespace:
    return SimpleNamespace(endpoints={"tcp": locator})


def test_a_link_turned_away_twice_is_tried_again_and_served(owner, peer):
    door = TurningAway(owner.transports.endpoints["tcp"], turn_away=2)
    try:
        channel = asyncio.run(a_handoff(peer).connect(region_at(door.locator)))
        try:
            assert channel.call("echo", b"abc") == b"cba"
        finally:
            channel.close()
        assert door.taken == 3
    finally:
        door.close()


def test_a_link_turned_away_every_time_fails_after_a_bounded_number_of_tries(owner, peer):
    door = TurningAway(owner.transports.endpoints["tcp"], turn_away=10**6)
    try:
        with pytest.raises(TransportTurnedAway, match="closed the connection during the handshake"):
            asyncio.run(a_handoff(peer).connect(region_at(door.locator)))
        assert door.taken == 1 + len(handoff.CONNECT_RETRY_S)
    finally:
        door.close()


def test_an_attempt_called_off_is_not_tried_again(owner, peer):
    door = TurningAway(owner.transports.endpoints["tcp"], turn_away=10**6)
    try:
        with pytest.raises(TransportTurnedAway):
            asyncio.run(a_handoff(peer, cancelled=lambda: True).connect(region_at(door.locator)))
        assert door.taken == 1
    finally:
        door.close()


def test_a_port_no_one_listens_on_is_final_at_once(owner):
    closed = socket.create_server(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    plain = Transports("tcp", SECRET, 30.0)
    try:
        with pytest.raises(TransportError) as no_one:
            asyncio.run(a_handoff(plain).connect(region_at(f"127.0.0.1:{port}")))
        assert not isinstance(no_one.value, TransportTurnedAway)
    finally:
        plain.close()


def test_a_peer_refused_for_its_secret_looks_turned_away_and_its_tries_stay_bounded(owner):
    """The owner does not tell a connection why it closes it (a stranger learns nothing): a peer
    with another secret is tried again like one pushed out of a crowded door, as often, no more."""
    stranger = Transports("tcp", b"x" * 32, 30.0)
    door = TurningAway(owner.transports.endpoints["tcp"], turn_away=0)
    try:
        with pytest.raises(TransportTurnedAway):
            asyncio.run(a_handoff(stranger).connect(region_at(door.locator)))
        assert door.taken == 1 + len(handoff.CONNECT_RETRY_S)
        assert owner.transports.backends["tcp"].refused["secret"] == door.taken
    finally:
        door.close()
        stranger.close()
