"""The broker watchdog gives up on a broker gone for good, and rides out a short outage."""

import asyncio

import pytest

from common import bus
from tests.wait import until


class FakeConnection:
    """A connection whose state follows a script: one state per look the watchdog takes (it looks
    every second), the last one for good."""

    def __init__(self, *states: bool) -> None:
        self.states = states
        self.looks = 0

    @property
    def is_connected(self) -> bool:
        self.looks += 1
        return self.states[min(self.looks, len(self.states)) - 1]


async def test_a_broker_gone_for_good_stops_the_process():
    with pytest.raises(bus.BrokerGone):  # (a guard against a hang: it gives up at its third look)
        await asyncio.wait_for(bus.watchdog(FakeConnection(False), give_up_s=1.5), 60)


async def test_a_short_outage_is_ridden_out():
    nc = FakeConnection(False, False, True)  # down for two looks (a second apart), then back
    watching = asyncio.create_task(bus.watchdog(nc, give_up_s=60))  # far longer than the outage
    try:
        await until(lambda: nc.looks >= 4 or watching.done(), "the watchdog looks once more after the outage")
        assert not watching.done(), watching  # still watching: no BrokerGone
    finally:
        watching.cancel()
