"""pyverbs on rxe0: two RC queue pairs, one-sided WRITE and READ, completions through the channel."""

from __future__ import annotations

import asyncio
import os

import pytest

from common.transport.rdma_verbs import RdmaDevice, RdmaError
from tests.rdma.conftest import DEVICE

NBYTES = 4 << 20  # 4 WRs of 1 MiB each way


@pytest.fixture
async def pair():
    """Two connected QPs on one device (rxe loops packets between them inside the kernel)."""
    device = RdmaDevice(DEVICE)
    device.start()
    a, b = device.create_qp(), device.create_qp()
    a.connect(b.endpoint())
    b.connect(a.endpoint())
    yield device, a, b
    device.close()


def test_device_discovery():
    device = RdmaDevice(DEVICE)
    try:
        assert device.name == DEVICE
        # RoCEv2 over IPv4: the IPv4-mapped GID of rxenet's address (tools/rdma_vm/guest.sh)
        assert device.gid.startswith("0000:0000:0000:0000:0000:ffff:"), device.gid
        assert device.channel_fd > 2
    finally:
        device.close()


async def test_write_then_read_round_trip(pair):
    device, a, b = pair
    src, src_map = device.allocate(NBYTES)
    dst, dst_map = device.allocate(NBYTES)
    back, back_map = device.allocate(NBYTES)
    payload = os.urandom(NBYTES)
    src_map[:] = payload

    await a.write(src, 0, dst.remote(), 0, NBYTES, timeout_s=60)  # a's WRITE into b's region
    assert dst_map[:] == payload
    await a.read(back, 0, dst.remote(), 0, NBYTES, timeout_s=60)  # and a READ of it back
    assert back_map[:] == payload

    # offsets inside both regions, not whole-region copies
    await b.write(src, 1000, dst.remote(), 5000, 12345, timeout_s=60)
    assert dst_map[5000:5000 + 12345] == payload[1000:1000 + 12345]


async def test_completions_arrive_through_the_channel_not_a_poll(pair):
    """Nothing polls the CQ but the channel's reader: a write completes while the loop only waits."""
    device, a, _ = pair
    src, _ = device.allocate(1 << 16)
    dst, _ = device.allocate(1 << 16)
    assert device.loop is asyncio.get_running_loop()
    await asyncio.wait_for(a.write(src, 0, dst.remote(), 0, 1 << 16, timeout_s=30), 30)
    assert not device.waiting


async def test_a_bad_rkey_breaks_the_qp_and_fails_cleanly(pair):
    device, a, _ = pair
    src, _ = device.allocate(1 << 16)
    dst, _ = device.allocate(1 << 16)
    wrong = type(dst.remote())(dst.addr, dst.rkey ^ 0x5A5A, dst.length)
    with pytest.raises(RdmaError):
        await a.write(src, 0, wrong, 0, 1 << 16, timeout_s=30)
    assert a.broken
    with pytest.raises(RdmaError, match="broken"):
        await a.write(src, 0, dst.remote(), 0, 1 << 16, timeout_s=30)


async def test_a_vanished_peer_fails_within_the_retry_budget(pair):
    """The peer's QP is destroyed: retries run out (IBV_WC_RETRY_EXC_ERR) or the deadline passes."""
    device, a, b = pair
    src, _ = device.allocate(1 << 16)
    dst, _ = device.allocate(1 << 16)
    b.close()
    with pytest.raises(RdmaError):  # it ends: retries run out or the deadline passes, never a hang
        await a.write(src, 0, dst.remote(), 0, 1 << 16, timeout_s=20)
