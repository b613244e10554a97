"""Two-tier pool accounting (common/decide/pool.py): exact actions for demotion, promotion, pins."""

import pytest

from common.kv.blocks import KvLayout
from common.decide.eviction import NotPinned, UnknownBlock
from common.decide.pool import Demoted, Evicted, NoRoom, Promoted, Stored, TieredPool, capacity_in_blocks


def put(pool, *keys, depth=0):
    return pool.put((k, depth) for k in keys)


def test_put_fills_dram_then_evicts_without_ssd():
    pool = TieredPool(2, 0)
    assert put(pool, 1, 2) == [Stored(1, "dram"), Stored(2, "dram")]
    assert put(pool, 1) == []  # held: touch only, 2 becomes the LRU
    assert put(pool, 3) == [Evicted(2, "dram"), Stored(3, "dram")]
    assert pool.snapshot() == {1: "dram", 3: "dram"}


def test_demotion_to_ssd_and_ssd_eviction():
    pool = TieredPool(2, 2)
    put(pool, 1, 2)
    assert put(pool, 3) == [Demoted(1), Stored(3, "dram")]
    assert put(pool, 4) == [Demoted(2), Stored(4, "dram")]
    assert put(pool, 5) == [Evicted(1, "ssd"), Demoted(3), Stored(5, "dram")]
    assert pool.snapshot() == {4: "dram", 5: "dram", 2: "ssd", 3: "ssd"}
    assert (pool.num_dram, pool.num_ssd, len(pool)) == (2, 2, 4)


def test_ssd_hit_promotes_with_demotion_first():
    pool = TieredPool(2, 2)
    put(pool, 1, 2, 3)  # 1 demoted
    assert pool.tier_of(1) == "ssd"
    # SSD is not full (1 of 2): demote 2 (DRAM LRU), then promote 1.
    assert put(pool, 1) == [Demoted(2), Promoted(1)]
    assert pool.snapshot() == {3: "dram", 1: "dram", 2: "ssd"}
    put(pool, 4)  # demotes 3 -> SSD full {2, 3}
    # Promotion with a full SSD needs no SSD eviction: the promoted block leaves it.
    assert pool.promote(2) == [Demoted(1), Promoted(2)]
    assert pool.snapshot() == {4: "dram", 2: "dram", 3: "ssd", 1: "ssd"}
    assert pool.promote(2) == []  # already in DRAM
    with pytest.raises(UnknownBlock):
        pool.promote(99)


def test_lookup_prefix_stops_at_first_miss_and_reports_tiers():
    pool = TieredPool(2, 2)
    put(pool, 1, 2, 3)  # DRAM {2, 3}, SSD {1}
    found = pool.lookup_prefix([1, 2, 7, 3])
    assert found.num_hits == 2 and found.tiers == ["ssd", "dram"]
    assert (found.num_dram, found.num_ssd) == (1, 1)
    assert pool.lookup_prefix([7, 1]).num_hits == 0


def test_pinned_blocks_are_never_evicted_and_full_pinned_dram_is_no_room():
    pool = TieredPool(2, 0)
    put(pool, 1, 2)
    pool.pin([1, 2])
    pool.pin([1])
    assert put(pool, 3) == [NoRoom(3)]
    assert 3 not in pool and pool.snapshot() == {1: "dram", 2: "dram"}
    pool.unpin([2])
    assert put(pool, 3) == [Evicted(2, "dram"), Stored(3, "dram")]
    pool.unpin([1])
    assert pool.pin_count(1) == 1
    assert put(pool, 4) == [Evicted(3, "dram"), Stored(4, "dram")]  # 1 is still pinned
    assert pool.snapshot() == {1: "dram", 4: "dram"}


def test_pin_is_all_or_nothing_and_unpin_checks():
    pool = TieredPool(2, 0)
    put(pool, 1)
    with pytest.raises(UnknownBlock):
        pool.pin([1, 9])
    assert pool.pin_count(1) == 0
    with pytest.raises(NotPinned):
        pool.unpin([1])


def test_pins_follow_a_block_across_tiers():
    pool = TieredPool(1, 2)
    put(pool, 1, 2)  # 1 demoted
    pool.pin([1])  # pinned on SSD (being read by a request)
    assert put(pool, 3) == [Demoted(2), Stored(3, "dram")]
    assert put(pool, 4) == [Evicted(2, "ssd"), Demoted(3), Stored(4, "dram")]  # 1 is pinned
    assert pool.promote(1) == [Demoted(4), Promoted(1)]
    assert pool.pin_count(1) == 1
    assert put(pool, 5) == [NoRoom(5)]  # DRAM's only block is pinned
    pool.unpin([1])
    assert put(pool, 5) == [Evicted(3, "ssd"), Demoted(1), Stored(5, "dram")]


def test_full_pinned_ssd_drops_the_dram_victim():
    pool = TieredPool(1, 1)
    put(pool, 1, 2)  # 1 on SSD
    pool.pin([1])
    assert put(pool, 3) == [Evicted(2, "dram"), Stored(3, "dram")]


def test_discard_and_touch():
    pool = TieredPool(2, 2)
    put(pool, 1, 2, 3)
    assert pool.discard([1, 3, 42]) == [Evicted(1, "ssd"), Evicted(3, "dram")]
    pool.touch([2, 42])
    assert pool.snapshot() == {2: "dram"}


def test_length_aware_pool_demotes_deepest_first():
    pool = TieredPool(3, 0, policy="length-aware")
    pool.put([(10, 0), (11, 1), (12, 2)])
    assert pool.put([(20, 0)]) == [Evicted(12, "dram"), Stored(20, "dram")]


def test_capacity_helpers_and_validation():
    layout = KvLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_tokens=16)
    assert capacity_in_blocks(10 * layout.block_nbytes + 5, layout) == 10
    with pytest.raises(ValueError):
        TieredPool(-1, 0)
    with pytest.raises(ValueError):
        TieredPool(1, 0, policy="nope")
