"""SIGTERM on a worker drains it: it takes nothing new, finishes what it holds within its grace
period, hands the rest back to be resumed elsewhere, and exits cleanly.

Decode instances here drain for at most 3 s (`--drain-grace 3`; the default is 30 s), so one test
can finish inside the grace and another outlive it.
"""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from tests.integration.conftest import collect_request_events, post, start_cluster
from tests.integration.test_failures import BOUND_S, body, routed, stream, tokens_of, wait_healthy

pytestmark = pytest.mark.integration
GRACE_S = 3


@pytest.fixture(scope="module")
def drained(tmp_path_factory, tiny_profile):
    cluster = start_cluster(tmp_path_factory.mktemp("drain"), prefill=1, decode=2, profile=tiny_profile,
                            service_args={"decode": ["--drain-grace", str(GRACE_S)]})
    yield cluster
    cluster.stop()


async def test_a_draining_decode_finishes_its_request_and_gets_no_new_ones(drained):
    cluster = drained
    status, undisturbed, _ = await post(f"{cluster.spec.url}/v1/completions", body(60))
    assert status == 200
    state = {}

    async def term_its_decode(request_id, events):
        if not state and len(tokens_of(events)) >= 5:
            name = (await routed(cluster, request_id, 0))["decode_id"]
            cluster.procs[name].popen.send_signal(signal.SIGTERM)
            state.update(name=name, at=time.monotonic())
            # routed while it drains: the other decode instance gets it
            status, other, headers = await post(f"{cluster.spec.url}/v1/completions", body(4))
            assert status == 200
            state["other"] = (await routed(cluster, headers["X-Request-Id"], 0))["decode_id"]

    request_id, events = await stream(cluster, body(60), term_its_decode)
    assert state["other"] != state["name"]
    assert tokens_of(events) == undisturbed["choices"][0]["token_ids"]
    path = await collect_request_events(cluster.spec.nats_url, request_id)
    assert not [e for e in path if e["kind"] == "migrated"]  # finished where it was, within the grace
    code = cluster.procs[state["name"]].popen.wait(BOUND_S)
    assert code == 0
    cluster.restart(state["name"])
    await wait_healthy(cluster, 1, 2)


async def test_what_outlives_the_grace_period_is_resumed_elsewhere(drained):
    cluster = drained
    state = {}

    async def term_its_decode(request_id, events):
        if not state and len(tokens_of(events)) >= 5:
            name = (await routed(cluster, request_id, 0))["decode_id"]
            cluster.procs[name].popen.send_signal(signal.SIGTERM)
            state.update(name=name, at=time.monotonic())

    status, undisturbed, _ = await post(f"{cluster.spec.url}/v1/completions", body(3000))
    assert status == 200
    request_id, events = await stream(cluster, body(3000), term_its_decode)
    assert not [e for e in events if "error" in e], events[-3:]
    assert tokens_of(events) == undisturbed["choices"][0]["token_ids"]
    path = await collect_request_events(cluster.spec.nats_url, request_id)
    [migrated] = [e for e in path if e["kind"] == "migrated"]
    assert "shutting down" in migrated["data"]["reason"]
    assert (await routed(cluster, request_id, 1))["decode_id"] != state["name"]
    exited = await asyncio.to_thread(cluster.procs[state["name"]].popen.wait, BOUND_S)
    assert exited == 0
    cluster.restart(state["name"])
    await wait_healthy(cluster, 1, 2)
