"""Chunked pipeline parallelism across prefill instances, live: same tokens, both stages at work."""

from __future__ import annotations

import pytest

from tests.integration.conftest import assert_greedy, collect_request_events, post, start_cluster
from tests.integration.test_kv_pool import text_of

pytestmark = pytest.mark.integration
CHUNK = 128


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory, tiny_profile):
    cluster = start_cluster(tmp_path_factory.mktemp("pipeline"), prefill=2, pipeline_group=2, prefill_chunk=CHUNK,
                            profile=tiny_profile)
    yield cluster
    cluster.stop()


async def test_long_prompt_is_prefilled_by_two_instances_with_the_same_tokens(pipelined, tiny):
    tokenizer, model = tiny
    prompt = text_of(700, seed=500)  # 6 chunks of 128 tokens: stages 0, 1, 0, 1, 0, 1
    ids = tokenizer(prompt)["input_ids"]
    status, body, headers = await post(f"{pipelined.spec.url}/v1/completions", {
        "model": "tiny-random", "prompt": prompt, "max_tokens": 12, "temperature": 0, "return_token_ids": True})
    assert status == 200, body
    assert_greedy(body["choices"][0]["token_ids"], model, ids, 12)
    events = await collect_request_events(pipelined.spec.nats_url, headers["X-Request-Id"])
    stages = {e["instance_id"]: e["data"] for e in events if e["kind"] == "prefill_stage"}
    assert set(stages) == {"prefill-0", "prefill-1"}
    n = len(ids)
    bounds = [[a, min(a + CHUNK, n)] for a in range(0, n, CHUNK)]
    assert stages["prefill-0"]["chunks"] == bounds[0::2] and stages["prefill-1"]["chunks"] == bounds[1::2]
    prefilled = next(e for e in events if e["kind"] == "prefilled")
    assert prefilled["instance_id"] == f"prefill-{(len(bounds) - 1) % 2}"  # the stage with the last chunk


async def test_short_prompt_runs_on_one_instance(pipelined):
    status, body, headers = await post(f"{pipelined.spec.url}/v1/completions", {
        "model": "tiny-random", "prompt": "short", "max_tokens": 4, "temperature": 0})
    assert status == 200, body
    events = await collect_request_events(pipelined.spec.nats_url, headers["X-Request-Id"])
    assert not [e for e in events if e["kind"] in ("pipelined", "prefill_stage")]
