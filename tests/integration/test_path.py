"""The whole path of a request through real processes: outputs, streaming, concurrency, events."""

from __future__ import annotations

import asyncio
import random
import urllib.request

import openai
import pytest

from tests.integration.conftest import assert_greedy, collect_request_events, post, stream_events
from tests.wait import until

pytestmark = pytest.mark.integration

PROMPTS = [
    "Hello there, how are you?",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Once upon a time",
]


def long_prompt(n_chars: int = 1300) -> str:
    rng = random.Random(7)
    words = ["moon", "cake", "cache", "block", "prefill", "decode", "node", "transfer", "layer", "token"]
    text = ""
    while len(text) < n_chars:
        text += rng.choice(words) + " "
    return text


async def completion_tokens(cluster, prompt: str, max_tokens: int, **extra) -> dict:
    status, body, _ = await post(f"{cluster.spec.url}/v1/completions", {
        "model": "tiny-random", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "return_token_ids": True, **extra})
    assert status == 200, body
    return body


@pytest.mark.parametrize("prompt", PROMPTS + [long_prompt()], ids=["short", "repeated", "story", "long"])
async def test_greedy_matches_single_process_generate(cluster, tiny, prompt):
    tokenizer, model = tiny
    prompt_ids = tokenizer(prompt)["input_ids"]
    body = await completion_tokens(cluster, prompt, 24)
    choice = body["choices"][0]
    assert_greedy(choice["token_ids"], model, prompt_ids, 24, what=prompt[:20])
    assert choice["text"] == tokenizer.decode(choice["token_ids"], skip_special_tokens=True)
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)
    assert body["usage"]["completion_tokens"] == len(choice["token_ids"])
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    if prompt.startswith("moon") or len(prompt_ids) > 1000:
        assert len(prompt_ids) > 1000


async def test_stream_equals_non_stream(cluster):
    body = {"model": "tiny-random", "prompt": PROMPTS[1], "max_tokens": 20, "temperature": 0, "return_token_ids": True}
    status, full, _ = await post(f"{cluster.spec.url}/v1/completions", body)
    assert status == 200
    events = await stream_events(f"{cluster.spec.url}/v1/completions", body | {"stream_options": {"include_usage": True}})
    assert events[-1] == {"done": True}
    chunks = [e for e in events[:-1] if e["choices"]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["choices"][0]["text"]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == full["choices"][0]["token_ids"]
    assert chunks[-1]["choices"][0]["finish_reason"] == full["choices"][0]["finish_reason"] == "length"
    assert events[-2]["usage"]["completion_tokens"] == 20


def test_openai_client_chat_stream_and_non_stream(cluster):
    client = openai.OpenAI(base_url=f"{cluster.spec.url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Tell me about the moon."}]
    full = client.chat.completions.create(model="tiny-random", messages=messages, max_tokens=16, temperature=0)
    assert full.choices[0].finish_reason in ("length", "stop")
    assert full.usage.completion_tokens >= 1
    assert full.usage.prompt_tokens_details.cached_tokens == 0
    parts = []
    for chunk in client.chat.completions.create(model="tiny-random", messages=messages, max_tokens=16,
                                                temperature=0, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
    assert "".join(parts) == full.choices[0].message.content
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-random"]
    completion = client.completions.create(model="tiny-random", prompt="Hello", max_tokens=5, temperature=0)
    assert completion.usage.completion_tokens == 5


async def test_eight_concurrent_requests_each_match_single_process(cluster, tiny):
    tokenizer, model = tiny
    prompts = [f"Request number {i}: " + "abc" * (i + 1) for i in range(8)]
    bodies = await asyncio.gather(*(completion_tokens(cluster, p, 16) for p in prompts))
    for prompt, body in zip(prompts, bodies):
        assert_greedy(body["choices"][0]["token_ids"], model, tokenizer(prompt)["input_ids"], 16, what=prompt[:20])


async def test_seeded_sampling_is_reproducible(cluster):
    body = {"prompt": PROMPTS[0], "temperature": 0.9, "top_p": 0.9, "seed": 1234}
    first = await completion_tokens(cluster, **body, max_tokens=12)
    second = await completion_tokens(cluster, **body, max_tokens=12)
    assert first["choices"][0]["token_ids"] == second["choices"][0]["token_ids"]
    body = {**body, "temperature": 0.9, "top_p": 0.9, "seed": 1234}


async def test_stop_string_ends_the_completion(cluster, tiny):
    tokenizer, model = tiny
    whole = await completion_tokens(cluster, PROMPTS[2], 30)  # greedy: the same text again, up to the stop
    assert_greedy(whole["choices"][0]["token_ids"], model, tokenizer(PROMPTS[2])["input_ids"], 30)
    expected = whole["choices"][0]["text"]
    stop = expected[5:7]
    assert stop and stop in expected
    body = await completion_tokens(cluster, PROMPTS[2], 30, stop=[stop])
    assert body["choices"][0]["text"] == expected[: expected.index(stop)]
    assert body["choices"][0]["finish_reason"] == "stop"


async def test_events_follow_the_path_and_end_once(cluster):
    body = await completion_tokens(cluster, PROMPTS[0], 8)
    events = await collect_request_events(cluster.spec.nats_url, body["id"])
    kinds = [e["kind"] for e in events]
    assert kinds[0] == "received"
    terminal = [k for k in kinds if k in ("completed", "failed", "rejected", "cancelled")]
    assert terminal == ["completed"] and kinds[-1] == "completed"
    for kind in ("routed", "prefilled", "kv_transferred", "first_token", "decode_finished"):
        assert kinds.count(kind) == 1, kinds
    order = kinds.index
    assert order("received") < order("routed") < order("prefilled") < order("first_token")
    assert order("prefilled") < order("kv_transferred") < order("decode_finished") < order("completed")
    services = {e["kind"]: e["service"] for e in events}
    assert services["routed"] == "conductor" and services["prefilled"] == "prefill"
    routed = next(e for e in events if e["kind"] == "routed")["data"]
    assert routed["admitted"] is True and routed["policy"] == "kvcache-centric"
    assert {c["instance_id"] for c in routed["prefill_costs"]} == {"prefill-0"}
    assert routed["prefill_id"] == "prefill-0" and routed["decode_id"] == "decode-0"
    assert services["decode_finished"] == "decode" and services["completed"] == "gateway"
    transfer = next(e for e in events if e["kind"] == "kv_transferred")
    assert transfer["data"]["src_node"] != transfer["data"]["dest_node"]  # KV crossed nodes
    assert transfer["data"]["bytes"] > 0


async def test_client_going_away_cancels_the_request(cluster):
    import aiohttp

    body = {"model": "tiny-random", "prompt": "cancel me", "max_tokens": 4000, "ignore_eos": True,
            "temperature": 0, "stream": True}
    generated_before = decode_tokens(cluster)
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{cluster.spec.url}/v1/completions", json=body) as resp:
            request_id = resp.headers["X-Request-Id"]
            seen = 0
            async for line in resp.content:
                seen += line.startswith(b"data: ")
                if seen >= 3:
                    break  # leave without reading the rest: the connection closes
    events = await collect_request_events(cluster.spec.nats_url, request_id)
    kinds = [e["kind"] for e in events]
    assert kinds[-1] == "cancelled" and kinds.count("cancelled") == 1
    assert "completed" not in kinds
    # the decode instance drops the request: once it runs nothing, it has generated fewer than the
    # 4,000 tokens asked for (the first came from the prefill)
    from common import bus
    from schemas import subjects
    from schemas.workers import StatusReply

    nc = await bus.connect(cluster.spec.nats_url, "test-status")

    async def decode_idle() -> bool:
        status = StatusReply.from_bytes((await nc.request(subjects.CONDUCTOR_STATUS, b"", timeout=10)).data)
        return all(w.num_running == 0 for w in status.workers if w.role == "decode")

    try:
        await until(decode_idle, "the decode instance runs nothing")
    finally:
        await nc.drain()
    assert decode_tokens(cluster) - generated_before < 4000 - 1, "the decode instance generated the whole request"


def decode_tokens(cluster) -> float:
    """The tokens decode-0 has generated."""
    with urllib.request.urlopen(cluster.procs["decode-0"].metrics, timeout=10) as resp:
        return next(float(line.split()[1]) for line in resp.read().decode().splitlines()
                    if line.startswith("moonbus_decode_tokens_total "))
