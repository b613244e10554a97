"""Tenants share the queues inside the cluster, live: one cluster of tiny-random with API keys
for two tenants. While its prefill instance is frozen (SIGSTOP), tenant burst's 20 long prompts
and then tenant small's short one are routed to it; when it runs again, small's request is served
among the first, not after the whole burst (common/decide/queue_order.py). Only the order in which
the requests complete is asserted, never their times."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import signal

import aiohttp
import pytest

from common import bus
from schemas import subjects
from tests.integration.conftest import TINY, start_cluster
from tools.moonbus.cluster import keys as keys_tool

pytestmark = pytest.mark.integration
BURST = 20


def add_key(key_file, tenant: str) -> str:
    parser = argparse.ArgumentParser()
    keys_tool.add_arguments(parser)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert keys_tool.run(parser.parse_args(["add", "--tenant", tenant, "--file", str(key_file)])) == 0
    return out.getvalue().strip()


@pytest.fixture(scope="module")
def two_tenants(tmp_path_factory, tiny_profile):
    """No instance is taken for lost by silence, nor a request probed: the test freezes the prefill.
    Each tenant may hold the whole burst in flight (--fair-share-floor): the gateway lets all in."""
    home = tmp_path_factory.mktemp("tenant-queues")
    keys = {tenant: add_key(home / "api-keys.json", tenant) for tenant in ("burst", "small")}
    cluster = start_cluster(home, profile=tiny_profile, api_keys=str(home / "api-keys.json"),
                            service_args={"conductor": ["--heartbeat-timeout", "600"],
                                          "gateway": ["--probe-after", "600", "--fair-share-floor", str(BURST + 1)]})
    yield cluster, keys
    cluster.stop()


def prompt_ids(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 250 + 3 for i in range(n)]  # distinct: no cache help


async def test_a_short_request_sent_after_another_tenants_burst_is_served_before_most_of_it(two_tenants):
    cluster, keys = two_tenants
    prefill = cluster.procs["prefill-0"].popen
    url = cluster.spec.url + "/v1/completions"
    finished: list[str] = []

    async def ask(session, tenant: str, name: str, prompt: list[int]) -> None:
        body = {"model": TINY, "prompt": prompt, "max_tokens": 4, "ignore_eos": True, "temperature": 0}
        async with session.post(url, json=body, headers={"Authorization": f"Bearer {keys[tenant]}"}) as resp:
            assert resp.status == 200, await resp.text()
        finished.append(name)

    nc = await bus.connect(cluster.spec.nats_url, "test-tenant-queues")
    routed = await nc.subscribe(subjects.request_event("routed", "*"))
    await bus.flush(nc)

    async def all_routed(count: int) -> None:
        for _ in range(count):
            event = json.loads((await routed.next_msg(timeout=60)).data)
            assert event["data"]["admitted"], event

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        prefill.send_signal(signal.SIGSTOP)
        try:
            asks = [asyncio.ensure_future(ask(session, "burst", f"burst {i}", prompt_ids(1000, i)))
                    for i in range(BURST)]
            await all_routed(BURST)  # the whole burst waits at the frozen prefill instance
            asks.append(asyncio.ensure_future(ask(session, "small", "small", prompt_ids(8, 99))))
            await all_routed(1)
        finally:
            prefill.send_signal(signal.SIGCONT)
            await nc.drain()
        await asyncio.gather(*asks)
    # in arrival order it was prefilled 21st, and finished last or nearly
    assert finished.index("small") < BURST // 2, finished
