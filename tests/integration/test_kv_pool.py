"""The KV pool live: prefix reuse, multi-turn reuse, remote SSD pulls, index resync, corruption."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import pytest

from common import bus
from common.kv.blocks import block_keys
from schemas import subjects
from schemas.index import IndexDumpReply, IndexDumpRequest
from schemas.pool import SnapshotReply
from schemas.prefill import PrefillTask, PullSpec
from schemas.route import SamplingParams
from schemas.tokens import TokenChunk
from tests.integration.conftest import (AUTO_DTYPE, KV_DTYPES, assert_greedy, post, start_cluster,
                                        tiny_kv_bytes_per_token)
from tests.wait import until

pytestmark = pytest.mark.integration
BLOCK = 16


def text_of(n_chars: int, seed: int) -> str:
    words = ["kv", "pool", "slab", "lmdb", "moon", "block", "hash", "prefix", "index", "node"]
    out, i = [], seed
    while sum(len(w) + 1 for w in out) < n_chars:
        i = (i * 1103515245 + 12345) % (2**31)
        out.append(words[i % len(words)])
    return " ".join(out)


async def complete(cluster, prompt, max_tokens=12, **extra):
    status, body, _ = await post(f"{cluster.spec.url}/v1/completions", {
        "model": "tiny-random", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "return_token_ids": True, **extra})
    assert status == 200, body
    return body


async def request(nats_url: str, subject: str, payload: bytes, reply_type):
    nc = await bus.connect(nats_url, "test-client")
    try:
        msg = await nc.request(subject, payload, timeout=10)
        return reply_type.from_bytes(msg.data)
    finally:
        await nc.drain()


async def test_same_prompt_twice_reuses_its_blocks_with_identical_output(cluster, tiny):
    tokenizer, model = tiny
    prompt = text_of(600, seed=1)
    ids = tokenizer(prompt)["input_ids"]
    first = await complete(cluster, prompt)
    second = await complete(cluster, prompt)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == ((len(ids) - 1) // BLOCK) * BLOCK
    assert first["choices"][0]["token_ids"] == second["choices"][0]["token_ids"]  # the reused KV is the same KV
    assert_greedy(first["choices"][0]["token_ids"], model, ids, 12)


async def test_next_turn_reuses_the_kv_of_the_generated_tokens(cluster, tiny):
    tokenizer, _ = tiny
    prompt = text_of(200, seed=2)
    turn1 = await complete(cluster, prompt, max_tokens=80, ignore_eos=True)
    history = tokenizer(prompt)["input_ids"] + turn1["choices"][0]["token_ids"]
    # decode stores the KV (all but the last token) after the last token is sent: wait for the index to know
    stored = block_keys(history[:-1], BLOCK)
    await until(lambda: _holds(cluster, "node-d0", stored), "the index holds the decode node's stored blocks")
    turn2 = await complete(cluster, history + tokenizer(" and more")["input_ids"])
    cached = turn2["usage"]["prompt_tokens_details"]["cached_tokens"]
    # more than the first prompt: blocks holding generated tokens came from the decode node's pool
    assert cached > len(tokenizer(prompt)["input_ids"])
    assert cached == (len(history) - 1) // BLOCK * BLOCK


@pytest.fixture(scope="module")
def two_nodes(request, tmp_path_factory, tiny_profile):
    """2 prefill nodes with a DRAM tier of 32 blocks each (older blocks are demoted to the SSD tier),
    in the KV dtype of the parameter (tests that do not depend on it ask for the one `auto` picks here)."""
    dtype = request.param
    block_nbytes = BLOCK * tiny_kv_bytes_per_token(dtype)
    cluster = start_cluster(tmp_path_factory.mktemp("pool"), prefill=2, dram_bytes=32 * block_nbytes,
                            ssd_bytes=256 * block_nbytes, profile=tiny_profile, dtype=dtype)
    yield cluster
    cluster.stop()


async def index_entries(cluster, node: str) -> dict[int, str]:
    dump = await request(cluster.spec.nats_url, subjects.INDEX_DUMP, IndexDumpRequest(node).to_bytes(), IndexDumpReply)
    return dict(zip(dump.keys, dump.tiers))


async def messenger_entries(cluster, node: str) -> dict[int, str]:
    snap = await request(cluster.spec.nats_url, subjects.messenger_control(node, "snapshot"), b"{}", SnapshotReply)
    return dict(zip(snap.keys, snap.tiers))


async def run_prefill_task(cluster, task_fields: dict, prefill_id: str) -> list[TokenChunk]:
    """Dispatch a PrefillTask by hand (as the conductor would) and collect its tokens."""
    nc = await bus.connect(cluster.spec.nats_url, "test-dispatch")
    inbox = subjects.gateway_tokens("test-dispatch")  # workers may send tokens only where gateways listen
    sub = await nc.subscribe(subjects.tokens_sent_to(inbox))
    try:
        task = PrefillTask(reply_subject=inbox, arrival_ts=time.time(), **task_fields)
        await nc.publish(subjects.prefill_tasks(prefill_id), task.to_bytes())
        chunks = []
        while not chunks or (chunks[-1].finish_reason is None and not chunks[-1].error):
            chunks.append(TokenChunk.from_bytes((await sub.next_msg(timeout=60)).data))
        return chunks
    finally:
        await nc.drain()


@pytest.mark.parametrize("two_nodes", KV_DTYPES, indirect=True)
async def test_prefix_held_only_on_another_nodes_ssd_is_pulled_from_there(two_nodes, tiny_in):
    cluster = two_nodes
    tokenizer, model = tiny_in(cluster.spec.dtype)
    prompt = text_of(400, seed=3)  # 25 blocks
    ids = tokenizer(prompt)["input_ids"]
    body = await complete(cluster, prompt)
    routed_to = await routed_prefill_node(cluster, body["id"])
    other = "node-p1" if routed_to == "node-p0" else "node-p0"
    keys = block_keys(ids[:-1], BLOCK)
    # another 25-block prompt on the same node pushes the first one's older blocks to the SSD tier
    filler = tokenizer(text_of(400, seed=33))["input_ids"]
    await run_prefill_task(cluster, dict(request_id="filler", prompt_token_ids=filler,
                                         sampling=SamplingParams(temperature=0, max_tokens=1),
                                         decode_id="decode-0", decode_node="node-d0"), prefill_id=prefill_on(routed_to))
    # the filler's blocks are stored after its first token is sent: wait for its demotions to reach the index

    async def demoted() -> bool:
        return (await index_entries(cluster, routed_to)).get(keys[0]) == "ssd"

    await until(demoted, "the index has the prompt's oldest block demoted to the SSD tier")
    held = await index_entries(cluster, routed_to)
    assert all(k in held for k in keys) and held[keys[-1]] == "dram"
    other_held = await index_entries(cluster, other)
    assert not any(k in other_held for k in keys)
    chunks = await run_prefill_task(cluster, dict(
        request_id="pull-test", prompt_token_ids=ids, sampling=SamplingParams(temperature=0, max_tokens=12),
        decode_id="decode-0", decode_node="node-d0", pull=PullSpec(routed_to, 0, len(keys))),
        prefill_id="prefill-1" if other == "node-p1" else "prefill-0")
    assert chunks[0].cached_tokens == len(keys) * BLOCK
    assert_greedy([t for c in chunks for t in c.token_ids], model, ids, 12)
    # the pulled blocks are kept: the other node now holds them too (hot-block replication)
    await until(lambda: _holds(cluster, other, keys), "the index holds the pulled blocks on the other node")


def prefill_on(node: str) -> str:
    return "prefill-" + node.removeprefix("node-p")


async def _holds(cluster, node, keys) -> bool:
    entries = await index_entries(cluster, node)
    return all(k in entries for k in keys)


async def routed_prefill_node(cluster, request_id: str) -> str:
    from nats.js.api import ConsumerConfig, DeliverPolicy

    nc = await bus.connect(cluster.spec.nats_url, "test-routed")
    try:
        sub = await nc.jetstream().subscribe(subjects.request_event("routed", request_id), ordered_consumer=True,
                                             config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL))
        return json.loads((await sub.next_msg(timeout=10)).data)["data"]["prefill_node"]
    finally:
        await nc.drain()


@pytest.mark.parametrize("two_nodes", [AUTO_DTYPE], indirect=True)
async def test_cache_index_restarted_mid_run_comes_back_exact(two_nodes):
    cluster = two_nodes
    await complete(cluster, text_of(300, seed=4))
    cluster.procs["cache_index"].popen.send_signal(signal.SIGKILL)
    cluster.procs["cache_index"].popen.wait(10)
    await complete(cluster, text_of(300, seed=5))  # served without the index: routed as a miss
    cluster.restart("cache_index")

    async def exact() -> bool:
        for node in ("node-p0", "node-p1", "node-d0"):
            try:
                if await index_entries(cluster, node) != await messenger_entries(cluster, node):
                    return False
            except Exception:
                return False
        return True

    await until(exact, "the restarted index matches every messenger")
    assert await index_entries(cluster, "node-d0")  # not trivially empty


@pytest.mark.parametrize("two_nodes", [AUTO_DTYPE], indirect=True)
async def test_corrupted_block_is_recomputed_and_reported(two_nodes, tiny):
    cluster = two_nodes
    tokenizer, model = tiny
    prompt = text_of(100, seed=6)  # 6 blocks: all stay in DRAM
    ids = tokenizer(prompt)["input_ids"]
    first = await complete(cluster, prompt)
    node = await routed_prefill_node(cluster, first["id"])
    [slab] = (cluster.shm_root / node).glob("slab-*")  # named after its messenger's epoch
    data = bytearray(slab.read_bytes())
    data[4096:] = bytes(len(data) - 4096)  # zero every slot: every checksum now fails
    slab.write_bytes(bytes(data))
    second = await complete(cluster, prompt)
    assert second["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    assert_greedy(first["choices"][0]["token_ids"], model, ids, 12)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

    async def reported() -> list[dict]:
        return [e for e in await kv_events(cluster, "corrupt") if e["data"].get("request_id") == second["id"]]

    [corrupt] = await until(reported, "the corrupt blocks are reported")

    async def evicted() -> bool:
        evictions = [e for e in await kv_events(cluster, "evicted") if e["data"]["node"] == node]
        return any(set(corrupt["data"]["keys"]) <= set(e["data"]["keys"]) for e in evictions)

    # the block left the pool and the index (an `evicted` event), so the recomputed one replaced it:
    # the third request reuses the prefix again, and its output is still right
    await until(evicted, "the corrupt blocks' eviction is stored")
    third = await complete(cluster, prompt)
    assert third["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert third["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]


async def kv_events(cluster, kind: str) -> list[dict]:
    """The `kind` KV events stored so far (those stored later may be missing: callers poll)."""
    from nats.js.api import ConsumerConfig, DeliverPolicy

    nc = await bus.connect(cluster.spec.nats_url, "test-kv-events")
    out = []
    try:
        sub = await nc.jetstream().subscribe(subjects.events_of_kind(kind), ordered_consumer=True,
                                             config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL))
        while True:
            try:
                out.append(json.loads((await sub.next_msg(timeout=2)).data))
            except asyncio.TimeoutError:
                return out
    finally:
        await nc.drain()


@pytest.mark.parametrize("two_nodes", [AUTO_DTYPE], indirect=True)
async def test_messenger_restart_drops_then_resyncs_its_blocks(two_nodes):
    cluster = two_nodes
    prompt = text_of(300, seed=7)
    body = await complete(cluster, prompt)
    node = await routed_prefill_node(cluster, body["id"])
    name = "messenger-p" + node[-1]
    assert await index_entries(cluster, node)
    cluster.restart(name)
    await until(lambda: _index_matches(cluster, node), "the index resyncs the restarted node")
    assert await index_entries(cluster, node) == {}  # its DRAM went with it; its SSD tier starts empty
    again = await complete(cluster, prompt)  # recomputed, then stored again
    assert again["choices"][0]["token_ids"] == body["choices"][0]["token_ids"]


async def _index_matches(cluster, node) -> bool:
    try:
        return await index_entries(cluster, node) == await messenger_entries(cluster, node)
    except Exception:
        return False
