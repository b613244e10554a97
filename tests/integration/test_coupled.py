"""Coupled mode through real processes: two coupled instances (prefill + decode on one model each).

Outputs must equal single-process generate(), and every request must stay on one node: the
conductor routes with --colocate, and the KV "transfer" is the messenger's same-node hand-off.
"""

from __future__ import annotations

import asyncio

import pytest

from common import models
from tests.integration.conftest import TINY, assert_greedy, collect_request_events, post, start_cluster

pytestmark = pytest.mark.integration

PROMPTS = ["Hello there, how are you?", "The quick brown fox jumps over the lazy dog. " * 3, "Once upon a time"]


@pytest.fixture(scope="module")
def coupled(tmp_path_factory, tiny_profile):
    cluster = start_cluster(tmp_path_factory.mktemp("coupled"), coupled=2, profile=tiny_profile)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def tiny_model(coupled):
    ref = models.prepare(TINY, coupled.spec.home)
    return models.load_tokenizer(ref), models.load_model(ref, models.resolve_dtype(coupled.spec.dtype))


async def complete(cluster, prompt: str, max_tokens: int) -> dict:
    status, body, _ = await post(f"{cluster.spec.url}/v1/completions", {
        "model": TINY, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True})
    assert status == 200, body
    return body


def test_each_instance_announces_both_roles(coupled):
    instances = coupled.health()["instances"]
    assert (instances["prefill"], instances["decode"], instances["messenger"]) == (2, 2, 2)
    assert sorted(n for n in coupled.procs if n.startswith(("coupled", "prefill", "decode"))) == ["coupled-0", "coupled-1"]


async def test_concurrent_greedy_outputs_match_single_process_generate(coupled, tiny_model):
    tokenizer, model = tiny_model
    # concurrent requests: prefills of some land while others decode, so the lock is contended
    bodies = await asyncio.gather(*(complete(coupled, p, 24) for p in PROMPTS * 2))
    for prompt, body in zip(PROMPTS * 2, bodies):
        assert_greedy(body["choices"][0]["token_ids"], model, tokenizer(prompt)["input_ids"], 24, what=prompt[:20])
        assert body["usage"]["completion_tokens"] == 24


async def test_a_request_stays_on_one_node(coupled):
    body = await complete(coupled, PROMPTS[2], 8)
    events = await collect_request_events(coupled.spec.nats_url, body["id"])
    kinds = [e["kind"] for e in events]
    assert kinds[-1] == "completed" and kinds.count("kv_transferred") == 1, kinds
    routed = next(e for e in events if e["kind"] == "routed")["data"]
    assert routed["admitted"] is True
    assert routed["prefill_node"] == routed["decode_node"]
    instance = routed["prefill_id"].removesuffix("-prefill")
    assert instance in ("coupled-0", "coupled-1")
    assert routed["decode_id"] == f"{instance}-decode"
    assert routed["prefill_node"] == f"node-c{instance[-1]}"
    assert {c["instance_id"] for c in routed["prefill_costs"]} == {"coupled-0-prefill", "coupled-1-prefill"}
    transfer = next(e for e in events if e["kind"] == "kv_transferred")["data"]
    assert transfer["src_node"] == transfer["dest_node"] == routed["prefill_node"]
    by_kind = {e["kind"]: e for e in events}
    assert (by_kind["prefilled"]["service"], by_kind["prefilled"]["instance_id"]) == ("prefill", routed["prefill_id"])
    assert (by_kind["decode_finished"]["service"], by_kind["decode_finished"]["instance_id"]) == (
        "decode", routed["decode_id"])
