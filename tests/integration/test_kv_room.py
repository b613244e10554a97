"""A decode instance's KV room, live: it comes from `--kv-cache-bytes`, it is reported in /health,
and a request that will fit once a running request leaves waits for that room instead of being
refused at arrival.

One cluster of tiny-random whose decode instance holds KV_TOKENS tokens. A long request takes
most of that room while it decodes; a second one, which does not fit beside it, is admitted to
wait for the room the first gives back (the conductor predicts its departure within the TTFT
SLO), and both complete. A request larger than the whole room is refused with a 400.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from common.engine.paged import BLOCK
from tests.integration.conftest import AUTO_DTYPE, TINY, collect_request_events, post, start_cluster, tiny_kv_bytes_per_token
from tests.wait import until

pytestmark = pytest.mark.integration
KV_TOKENS = 2400  # the decode instance's budget
MAX_BATCH = 4
LONG_OUTPUT = 2000  # the first request reserves 200 + 2000 of the 2400 tokens
TTFT_SLO_S = 600.0  # past any prediction of the first request's 2,000 steps here (the client waits 300 s)


@pytest.fixture(scope="module")
def small_room(tmp_path_factory, tiny_profile):
    # the pool: the budget in blocks, plus a block of slack per row (common/engine/batch.py)
    kv_bytes = (KV_TOKENS // BLOCK + MAX_BATCH) * BLOCK * tiny_kv_bytes_per_token(AUTO_DTYPE)
    # the second request waits for the first's 2,000 tokens: its TTFT SLO is set long enough that
    # the predicted wait falls within it on a machine of any speed (the profile measures this one)
    cluster = start_cluster(tmp_path_factory.mktemp("kvroom"), profile=tiny_profile, ttft_slo_s=TTFT_SLO_S,
                            service_args={"decode": ["--kv-cache-bytes", str(kv_bytes), "--max-batch", str(MAX_BATCH)]})
    yield cluster
    cluster.stop()


def held_room(cluster) -> int:
    """The KV tokens decode-0 has reserved, as its last report said (0 before it reported)."""
    kv = cluster.health().get("decode_kv", {}).get("decode-0")
    return kv["kv_tokens"] - kv["kv_free_tokens"] if kv else 0


def prompt_ids(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 250 + 3 for i in range(n)]


async def test_the_room_is_set_in_bytes_and_reported_in_health(small_room):
    health = small_room.health()
    [(instance, kv)] = health["decode_kv"].items()
    assert instance == "decode-0"
    assert kv["kv_tokens"] == KV_TOKENS and kv["kv_free_tokens"] == KV_TOKENS
    assert kv["kv_cache_bytes"] == (KV_TOKENS // BLOCK + MAX_BATCH) * BLOCK * tiny_kv_bytes_per_token(AUTO_DTYPE)


async def test_a_request_that_fits_once_another_leaves_waits_for_the_room(small_room):
    url = f"{small_room.spec.url}/v1/completions"
    first_body = {"model": TINY, "prompt": prompt_ids(200, 1), "max_tokens": LONG_OUTPUT, "ignore_eos": True,
                  "temperature": 0, "stream": True}
    second_body = {"model": TINY, "prompt": prompt_ids(200, 2), "max_tokens": 300, "ignore_eos": True,
                   "temperature": 0}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        async with session.post(url, json=first_body) as first:
            assert first.status == 200, await first.text()
            first_id = first.headers["X-Request-Id"]
            await first.content.readline()  # its first token (from its prefill)
            # its KV on its way to the decode instance, then there, waiting to load: until the
            # decode instance reserves its room and reports so, the conductors count that room free
            # (the report lists it as held: docs/architecture.md, "KV room is part of it")
            await until(lambda: held_room(small_room) >= 200 + LONG_OUTPUT - 1, "the first request holds its room")
            waiting = asyncio.ensure_future(post(url, second_body, timeout_s=300))
            async for _ in first.content:  # to its end
                pass
    status, second, headers = await waiting
    assert status == 200, second  # it waited for the room rather than being refused
    assert second["usage"]["completion_tokens"] == 300
    events = await collect_request_events(small_room.spec.nats_url, headers["X-Request-Id"])
    [routed] = [e["data"] for e in events if e["kind"] == "routed"]
    assert routed["admitted"] and "for KV room" in routed["reason"], routed
    first_events = await collect_request_events(small_room.spec.nats_url, first_id)
    assert [e for e in first_events if e["kind"] == "completed"]


async def test_a_request_larger_than_the_whole_room_is_refused(small_room):
    status, body, _ = await post(f"{small_room.spec.url}/v1/completions",
                                 {"model": TINY, "prompt": prompt_ids(200, 3), "max_tokens": KV_TOKENS})
    assert status == 400, body
    assert body["error"]["type"] == "invalid_request_error"
