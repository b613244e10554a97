"""The swarm driver (tools/swarm/autoscale.py) follows the planned events on a real nats-server:
each decision published there becomes one `docker service scale` (a fake runner stands in for
docker, and only for it); a malformed message is dropped."""

from __future__ import annotations

import asyncio

import pytest

from common import bus
from schemas.events import planned_subject
from tests.unit.test_swarm_autoscale import FakeDocker, make_planned
from tests.wait import until
from tools.swarm.autoscale import SwarmScaler, follow

pytestmark = pytest.mark.integration


async def test_it_follows_the_planned_events_on_the_bus(bare_nats_url):
    docker = FakeDocker()
    scaler, stop = SwarmScaler("moonbus", docker), asyncio.Event()
    following = asyncio.create_task(follow(scaler, bare_nats_url, None, stop))
    nc = await bus.connect(bare_nats_url, "test-planner")
    subject = planned_subject("conductor")
    first, second = make_planned(2, 1, 1.0), make_planned(1, 2, 2.0)

    async def first_run() -> list:
        # published until its subscription is there (core NATS keeps nothing for a late subscriber);
        # the same decision again runs nothing more
        await nc.publish(subject, first.to_bytes())
        return docker.commands

    try:
        await until(first_run, "the first decision is run")
        await nc.publish(subject, b"not an event")  # dropped
        await nc.publish(subject, second.to_bytes())
        await until(lambda: len(docker.commands) == 2, "the second decision is run")
        assert [c[-2:] for c in docker.commands] == [["moonbus_prefill=2", "moonbus_decode=1"],
                                                     ["moonbus_prefill=1", "moonbus_decode=2"]]
    finally:
        stop.set()
        await following
        await nc.drain()
