"""The broker watchdog gives up on a broker gone for good, and rides out a short outage."""

import asyncio

import pytest

from common import bus


class FakeConnection:
    def __init__(self, connected: bool) -> None:
        self.is_connected = connected


async def test_a_broker_gone_for_good_stops_the_process():
    with pytest.raises(bus.BrokerGone):
        await asyncio.wait_for(bus.watchdog(FakeConnection(False), give_up_s=1.5), 10)


async def test_a_short_outage_is_ridden_out():
    nc = FakeConnection(False)

    async def back_soon():
        await asyncio.sleep(1.2)
        nc.is_connected = True

    asyncio.get_running_loop().create_task(back_soon())
    with pytest.raises(asyncio.TimeoutError):  # still watching, no BrokerGone
        await asyncio.wait_for(bus.watchdog(nc, give_up_s=2.5), 5)
