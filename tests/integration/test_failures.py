"""A dead worker gives a bounded, reported failure, never a hang; the gateway keeps serving."""

from __future__ import annotations

import json
import signal
import time

import aiohttp
import pytest

from tests.integration.conftest import collect_request_events, post, start_cluster

pytestmark = pytest.mark.integration

# generous: covers the conductor's heartbeat timeout (3 s) on a loaded 2-core machine
BOUND_S = 60


@pytest.fixture(scope="module")
def two_decodes(tmp_path_factory, tiny_profile):
    cluster = start_cluster(tmp_path_factory.mktemp("failures"), decode=2, profile=tiny_profile)
    yield cluster
    cluster.stop()


def decode_proc(cluster, instance_id):
    return cluster.procs[instance_id].popen


async def test_killing_decode_mid_stream_ends_the_stream_with_an_error(two_decodes):
    cluster = two_decodes
    body = {"model": "tiny-random", "prompt": "a long story", "max_tokens": 3000, "ignore_eos": True,
            "temperature": 0, "stream": True}
    events, request_id, killed_at, ended_at = [], None, None, None
    timeout = aiohttp.ClientTimeout(total=BOUND_S + 60)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.post(f"{cluster.spec.url}/v1/completions", json=body) as resp:
            assert resp.status == 200
            request_id = resp.headers["X-Request-Id"]
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:].strip()
                events.append({"done": True} if payload == b"[DONE]" else json.loads(payload))
                if killed_at is None and len(events) >= 5:
                    # whichever decode instance serves the request dies now
                    routed = await collect_routed(cluster, request_id)
                    decode_proc(cluster, routed).send_signal(signal.SIGKILL)
                    killed_at = time.monotonic()
            ended_at = time.monotonic()
    assert killed_at is not None, "the stream ended before the decode instance could be killed"
    errors = [e for e in events if "error" in e]
    assert len(errors) == 1, events[-3:]
    assert "stopped responding" in errors[0]["error"]["message"]
    assert events[-1] == {"done": True}
    assert ended_at - killed_at < BOUND_S
    path = await collect_request_events(cluster.spec.nats_url, request_id)
    assert [e["kind"] for e in path if e["kind"] in ("completed", "failed", "cancelled")] == ["failed"]
    # the gateway keeps serving, through the surviving decode instance
    status, reply, _ = await post(f"{cluster.spec.url}/v1/completions",
                                  {"model": "tiny-random", "prompt": "still there?", "max_tokens": 4})
    assert status == 200, reply
    assert reply["usage"]["completion_tokens"] == 4


async def collect_routed(cluster, request_id: str) -> str:
    from nats.js.api import ConsumerConfig, DeliverPolicy

    from common import bus
    from schemas import subjects

    nc = await bus.connect(cluster.spec.nats_url, "test-routed")
    try:
        sub = await nc.jetstream().subscribe(subjects.request_event("routed", request_id), ordered_consumer=True,
                                             config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL))
        msg = await sub.next_msg(timeout=10)
        return json.loads(msg.data)["data"]["decode_id"]
    finally:
        await nc.drain()


async def test_no_decode_instance_left_gives_503_with_retry_after(two_decodes):
    cluster = two_decodes
    for name in ("decode-0", "decode-1"):
        proc = decode_proc(cluster, name)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    deadline = time.monotonic() + BOUND_S
    while time.monotonic() < deadline and cluster.health().get("instances", {}).get("decode", 0) > 0:
        time.sleep(0.2)
    started = time.monotonic()
    status, reply, headers = await post(f"{cluster.spec.url}/v1/completions",
                                        {"model": "tiny-random", "prompt": "anyone?", "max_tokens": 4})
    assert status == 503, reply
    assert "no decode instance is available" in reply["error"]["message"]
    assert int(headers["Retry-After"]) >= 1
    assert time.monotonic() - started < BOUND_S
    status, reply, _ = await post(f"{cluster.spec.url}/v1/completions", {"model": "tiny-random"})
    assert status == 400  # validation still answers
