"""The rdma backend through the transport interface, on rxe0: bytes verified byte for byte, failover.

Two Transports in this process stand for two nodes' processes (each its own device context, QPs
and event loop thread); the vanishing peer is a real process, killed midway.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

from common.transport import Transports, TransportError, checksum
from schemas.transfer import RegionRef
from tests.rdma.owner import SECRET

MiB = 1 << 20


class Owner:
    """A process's side that owns a region: what landed, as on_write reported it."""

    def __init__(self, nbytes: int) -> None:
        self.transports = Transports("rdma", secret=SECRET)
        self.transports.listen("127.0.0.1")
        self.memory = bytearray(nbytes)
        self.landed: list[tuple[dict, list, str | None]] = []
        self.ref = self.transports.register("kv-test", self.memory, self.on_write)
        self.transports.handle("echo", lambda body, peer: body[::-1])

    def on_write(self, meta, spans, error) -> None:
        self.landed.append((meta, spans, error))


@pytest.fixture
def owner():
    side = Owner(16 * MiB)
    yield side
    side.transports.close()


@pytest.fixture
def writer():
    transports = Transports("rdma", secret=SECRET)
    transports.listen("127.0.0.1")
    failovers: list[tuple[str, str]] = []
    transports.on_failover = lambda peer, why: failovers.append((peer, why))
    transports.failovers = failovers
    yield transports
    transports.close()


def test_the_region_ref_carries_address_and_rkey(owner):
    locator = owner.ref.endpoints["rdma"]
    host_port, addr, rkey = locator.split("/")
    assert host_port == owner.transports.endpoints["rdma"]
    assert int(addr, 16) and int(rkey, 16) >= 0


def test_write_read_and_call_byte_for_byte(owner, writer):
    staged = os.urandom(3 * MiB + 17)  # bytes: copied through the staging region
    registered = bytearray(os.urandom(2 * MiB))  # in a registered region: zero copy
    writer.register("src", registered)
    with writer.connect(owner.ref.endpoints) as ch:
        assert ch.transport == "rdma"
        # the bytes each write and read moves carry a keyed MAC (tests/unit/test_rdma_integrity.py),
        # the control connection a MAC on every frame
        assert writer.backends["rdma"].seal is not None and ch.control.mac
        ch.write(owner.ref, [(0, staged), (8 * MiB, memoryview(registered))], {"layer": 3})
        ch.write(owner.ref, [(12 * MiB, b"tail")], {"layer": 4})
        assert ch.call("echo", b"abc") == b"cba"  # ordered after both writes: both have landed
        assert owner.memory[:len(staged)] == staged
        assert owner.memory[8 * MiB:10 * MiB] == registered
        assert owner.memory[12 * MiB:12 * MiB + 4] == b"tail"
        assert owner.landed == [({"layer": 3}, [(0, len(staged)), (8 * MiB, 2 * MiB)], None),
                                ({"layer": 4}, [(12 * MiB, 4)], None)]

        back = bytearray(len(staged))
        into_registered = bytearray(2 * MiB)
        writer.register("dst", into_registered)
        ch.read(owner.ref, [(0, memoryview(back)), (8 * MiB, memoryview(into_registered))])
        assert bytes(back) == staged and into_registered == registered
    assert checksum([staged]) == checksum([staged[:100], staged[100:]])
    assert not writer.failovers


def test_one_queue_pair_per_pair_of_processes(owner, writer):
    backend = writer.backends["rdma"]
    for _ in range(3):
        with writer.connect(owner.ref.endpoints) as ch:
            ch.write(owner.ref, [(0, b"x" * 100)])
            ch.call("echo")
    assert len(backend.qps) == 1
    assert len(owner.transports.backends["rdma"].served) == 1


def test_a_broken_queue_pair_fails_over_to_tcp(owner, writer):
    with writer.connect(owner.ref.endpoints) as ch:
        ch.write(owner.ref, [(0, b"before")])
        ch.call("echo")
        # the owner's QP goes to the error state, as after a fatal error on its side
        served = owner.transports.backends["rdma"].served
        (qp,) = served.values()
        backend = owner.transports.backends["rdma"]
        backend.lp.call(lambda: qp.qp.modify(_err_attr(), _state_mask()))
        payload = os.urandom(MiB)
        ch.write(owner.ref, [(MiB, payload)], {"layer": 9})  # RDMA fails; the same write goes over TCP
        assert ch.transport == "tcp"
        assert ch.call("echo", b"x") == b"x"
        assert owner.memory[MiB:2 * MiB] == payload
        assert owner.landed[-1] == ({"layer": 9}, [(MiB, MiB)], None)
    assert len(writer.failovers) == 1 and writer.failovers[0][0] == owner.transports.endpoints["rdma"]
    with writer.connect(owner.ref.endpoints) as ch:  # within FAILOVER_S: TCP straight away
        assert ch.transport == "tcp"
        ch.write(owner.ref, [(0, b"after")])
        ch.call("echo")
    assert owner.memory[:5] == b"after" and len(writer.failovers) == 1


def test_a_peer_vanishing_midway_fails_the_write_cleanly(writer):
    proc = subprocess.Popen([sys.executable, "-m", "tests.rdma.owner", str(64 * MiB)], stdout=subprocess.PIPE)
    try:
        ref = RegionRef.from_bytes(proc.stdout.readline())
        ch = writer.connect(ref.endpoints)
        assert ch.transport == "rdma"
        ch.write(ref, [(0, b"warm")])
        outcome: list = []
        payload = os.urandom(48 * MiB)

        def big_write() -> None:
            try:
                ch.write(ref, [(0, payload)])
                ch.call("echo")
                outcome.append("done")
            except TransportError as exc:
                outcome.append(exc)

        # frozen, the owner confirms nothing (its device still takes the writes), so the write cannot
        # be done before it dies, however fast this machine is
        os.kill(proc.pid, signal.SIGSTOP)
        thread = threading.Thread(target=big_write)
        thread.start()
        os.kill(proc.pid, signal.SIGKILL)
        thread.join(120)
        assert not thread.is_alive(), "the write hung"
        assert len(outcome) == 1 and isinstance(outcome[0], TransportError), outcome
        ch.close()
    finally:
        proc.kill()
        proc.wait()


def _err_attr():
    import pyverbs.enums as e
    import pyverbs.qp as qp

    return qp.QPAttr(qp_state=e.IBV_QPS_ERR)


def _state_mask() -> int:
    import pyverbs.enums as e

    return e.IBV_QP_STATE
