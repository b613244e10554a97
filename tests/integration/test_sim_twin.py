"""The simulator's bookkeeping against a live cluster's, driven through the same sequence.

The simulator does not keep copies of what live instances count: its pool node publishes KV events
through the live messenger's `change_of`/`runs`, over the same `TieredPool`, into the same
`PrefixIndex`. Here one sequence of prompts (new, repeated, sharing a prefix, overflowing DRAM into
the SSD tier and then the SSD tier itself) goes through a live prefill node and through the
simulator's pool node; the blocks each holds, and their tiers, must be the same in the live cache
index, in the live messenger's own snapshot and in the simulator's index.
"""

from __future__ import annotations

import random

import pytest

from common.decide.index import PrefixIndex
from common.kv.blocks import block_keys
from schemas.route import SamplingParams
from tests.integration.conftest import KV_DTYPES, start_cluster, tiny_kv_bytes_per_token
from tests.integration.test_kv_pool import BLOCK, index_entries, messenger_entries, run_prefill_task
from tests.wait import until
from tools.sim.instances import PoolNode

pytestmark = pytest.mark.integration
DRAM_BLOCKS, SSD_BLOCKS = 8, 12


@pytest.fixture(scope="module", params=KV_DTYPES)
def small_pool(request, tmp_path_factory, tiny_profile):
    """A prefill node whose tiers hold DRAM_BLOCKS and SSD_BLOCKS blocks in the KV dtype of the parameter."""
    block_nbytes = BLOCK * tiny_kv_bytes_per_token(request.param)
    cluster = start_cluster(tmp_path_factory.mktemp("twin"), prefill=1, dram_bytes=DRAM_BLOCKS * block_nbytes,
                            ssd_bytes=SSD_BLOCKS * block_nbytes, profile=tiny_profile, dtype=request.param)
    yield cluster
    cluster.stop()


def prompt(rng: random.Random, blocks: int, prefix: list[int] = ()) -> list[int]:
    """Whole blocks of token ids (the last token is not cached, so one more), after `prefix`."""
    return list(prefix) + [rng.randrange(10, 250) for _ in range(blocks * BLOCK + 1 - len(prefix))]


async def test_a_prompt_sequence_leaves_the_same_blocks_in_the_same_tiers_live_and_simulated(small_pool):
    cluster, rng = small_pool, random.Random(7)
    a = prompt(rng, 5)
    sequence = [a, prompt(rng, 4), a, prompt(rng, 7, prefix=a[:3 * BLOCK]), prompt(rng, 6), a, prompt(rng, 6)]
    index = PrefixIndex()
    simulated = PoolNode("node-p0", DRAM_BLOCKS, "lru", index, ssd_blocks=SSD_BLOCKS)
    for i, ids in enumerate(sequence):
        chunks = await run_prefill_task(cluster, dict(
            request_id=f"twin-{i}", prompt_token_ids=ids, sampling=SamplingParams(temperature=0, max_tokens=1),
            decode_id="decode-0", decode_node="node-d0"), prefill_id="prefill-0")
        assert not chunks[-1].error, chunks[-1]
        simulated.store(block_keys(ids[:-1], BLOCK))
    want = index.node_entries("node-p0")
    assert len(want) == DRAM_BLOCKS + SSD_BLOCKS  # the sequence filled both tiers and evicted from the SSD
    assert sorted(want.values()).count("dram") == DRAM_BLOCKS

    async def index_agrees() -> bool:
        return await index_entries(cluster, "node-p0") == want

    await until(index_agrees, "the live cache index holds what the simulator's index holds")
    assert await messenger_entries(cluster, "node-p0") == want
