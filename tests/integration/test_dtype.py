"""A cluster in bfloat16, whatever this CPU's `--dtype auto` would pick: the KV keeps the model's
dtype end to end (pool slots, the handoff between nodes, reuse from the pool), at half the bytes
of float32, and greedy output equals transformers' generate() in bfloat16."""

from __future__ import annotations

import pytest

from common import models
from tests.integration.conftest import TINY, assert_greedy, collect_request_events, post, start_cluster
from tests.integration.test_kv_pool import text_of

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def bf16(tmp_path_factory, tiny_profile):
    cluster = start_cluster(tmp_path_factory.mktemp("bf16"), dtype="bfloat16", profile=tiny_profile)
    ref = models.prepare(TINY, cluster.spec.home)
    yield cluster, models.load_tokenizer(ref), models.load_model(ref, "bfloat16"), models.read_shape(ref)
    cluster.stop()


async def test_a_bfloat16_cluster_moves_half_the_bytes_and_matches_generate(bf16):
    cluster, tokenizer, model, shape = bf16
    health = cluster.health()
    assert health["dtypes"] == ["bfloat16"], health
    prompt = text_of(400, seed=5)
    ids = tokenizer(prompt)["input_ids"]
    body = {"model": TINY, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    first_status, first, headers = await post(f"{cluster.spec.url}/v1/completions", body)
    assert first_status == 200, first
    assert_greedy(first["choices"][0]["token_ids"], model, ids, 12, ignore_eos=True)
    events = await collect_request_events(cluster.spec.nats_url, headers["X-Request-Id"])
    [moved] = [e["data"] for e in events if e["kind"] == "kv_transferred"]
    assert moved["src_node"] != moved["dest_node"]  # prefill and decode on their own nodes
    per_token = shape.kv_bytes_per_token("bfloat16")
    assert per_token * 2 == shape.kv_bytes_per_token("float32")
    assert moved["bytes"] == len(ids) * per_token  # every layer's K and V, 2 bytes a value
    again_status, again, _ = await post(f"{cluster.spec.url}/v1/completions", body)  # its blocks now in the pool
    assert again_status == 200
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16
    assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]  # the reused KV is the same KV
