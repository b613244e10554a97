"""What proves the bytes an RDMA write or read moved (common/transport/rdma.py): they pass no frame
of the link's keyed MAC, so each carries its own GMAC under a key of the cluster secret. Checked here
without an RDMA device: the owner's handlers are served over a real (keyed) TCP control connection,
as the writer's notices are; the bytes are placed in the region as an RDMA WRITE would have put them.
The RDMA path itself runs in the VM (tests/rdma, tests/integration/test_rdma_vm.py)."""

from __future__ import annotations

import json
import os

import pytest

from common.transport import TransportError, Transports
from common.transport.rdma import NONCE_BYTES, OP_LANDED, OP_MAC, RdmaBackend
from common.transport.tcp import derived_seal, mac_of

SECRET = b"s" * 32
SIZE = 1 << 20


class Owner:
    def __init__(self, link_mac: bool = True) -> None:
        self.transports = Transports("tcp", SECRET, 30.0, link_mac=link_mac)
        self.transports.listen("127.0.0.1")
        self.memory = bytearray(SIZE)
        self.landed: list[tuple[dict, list, str | None]] = []
        self.ref = self.transports.register("r1", self.memory, lambda m, spans, error: self.landed.append((m, spans, error)))
        rdma = RdmaBackend(self.transports)  # its handlers only: no device is opened
        self.transports.handle(OP_LANDED, rdma._on_landed)
        self.transports.handle(OP_MAC, rdma._on_mac)


@pytest.fixture
def owner():
    side = Owner()
    yield side
    side.transports.close()


@pytest.fixture
def writer():
    transports = Transports("tcp", SECRET, 30.0)
    yield transports
    transports.close()


def landed(pieces, proof: dict, meta=None) -> bytes:
    return json.dumps({"region": "r1", "pieces": pieces, "meta": meta or {"layer": 1}} | proof).encode()


def keyed(secret: bytes, *parts: bytes) -> dict:
    nonce = os.urandom(NONCE_BYTES)
    return {"nonce": nonce.hex(), "mac": mac_of(derived_seal(secret, b"rdma bytes"), nonce, parts).hex()}


def test_a_write_whose_bytes_landed_intact_passes_and_the_owner_hears_it(owner, writer):
    a, b = os.urandom(5000), os.urandom(70_000)  # one kept and MAC'd at once, one streamed
    owner.memory[0:5000], owner.memory[8192:8192 + 70_000] = a, b
    with writer.connect(owner.transports.endpoints) as ch:
        ch.call(OP_LANDED, landed([[0, 5000], [8192, 70_000]], keyed(SECRET, a, b)))
    assert owner.landed == [({"layer": 1}, [(0, 5000), (8192, 70_000)], None)]


@pytest.mark.parametrize("how", ["a bit flipped on the way", "another secret's MAC", "no MAC, only an xxh3"])
def test_a_write_that_does_not_prove_its_bytes_fails_and_the_owner_hears_it(owner, writer, how):
    meant = os.urandom(4096)
    owner.memory[0:4096] = meant
    proof = keyed(b"x" * 32, meant) if how == "another secret's MAC" else keyed(SECRET, meant)
    if how == "a bit flipped on the way":
        owner.memory[100] ^= 0x10
    if how == "no MAC, only an xxh3":  # a writer (or someone on the path) turning the MAC off
        from common.transport import checksum
        proof = {"sum": checksum([meant])}
    with writer.connect(owner.transports.endpoints) as ch:
        with pytest.raises(TransportError, match="keyed MAC"):
            ch.call(OP_LANDED, landed([[0, 4096]], proof))
    [(meta, spans, error)] = owner.landed
    assert error and "keyed MAC" in error


def test_a_read_is_checked_against_the_owners_mac_of_the_bytes_it_holds(owner, writer):
    held = os.urandom(3000)
    owner.memory[4096:7096] = held
    nonce = os.urandom(NONCE_BYTES)
    with writer.connect(owner.transports.endpoints) as ch:
        theirs = ch.call(OP_MAC, json.dumps({"region": "r1", "pieces": [[4096, 3000]], "nonce": nonce.hex()}).encode())
        seal = derived_seal(SECRET, b"rdma bytes")
        assert theirs == mac_of(seal, nonce, [held])
        changed = bytearray(held)
        changed[0] ^= 1
        assert theirs != mac_of(seal, nonce, [bytes(changed)])
        with pytest.raises(TransportError, match="outside|bounds|beyond|region"):
            ch.call(OP_MAC, json.dumps({"region": "r1", "pieces": [[SIZE - 10, 20]], "nonce": nonce.hex()}).encode())


def test_without_the_keyed_mac_a_write_carries_its_xxh3():
    from common.transport import checksum

    owner = Owner(link_mac=False)
    writer = Transports("tcp", SECRET, 30.0, link_mac=False)
    try:
        data = os.urandom(2048)
        owner.memory[0:2048] = data
        with writer.connect(owner.transports.endpoints) as ch:
            ch.call(OP_LANDED, landed([[0, 2048]], {"sum": checksum([data])}))
            owner.memory[5] ^= 1
            with pytest.raises(TransportError, match="failed its checksum"):
                ch.call(OP_LANDED, landed([[0, 2048]], {"sum": checksum([data])}))
        assert [e for _, _, e in owner.landed][0] is None
    finally:
        writer.close()
        owner.transports.close()
