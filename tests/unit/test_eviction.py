"""Eviction policies (common/decide/eviction.py): exact victims on hand-made access sequences."""

import pytest

from common.decide.eviction import NotPinned, UnknownBlock, make_policy


def drain(policy) -> list[int]:
    """Evict everything evictable, in order."""
    order = []
    while (key := policy.victim()) is not None:
        order.append(key)
        policy.remove(key)
    return order


def make(name, keys_depths):
    policy = make_policy(name)
    for key, depth in keys_depths:
        policy.insert(key, depth)
    return policy


def test_lru_order():
    p = make("lru", [(1, 0), (2, 1), (3, 2), (4, 3)])
    p.touch(1)
    p.touch(3)
    p.insert(2, 1)  # re-insert = touch
    assert len(p) == 4 and 3 in p and 9 not in p
    assert drain(p) == [4, 1, 3, 2]
    assert p.victim() is None and len(p) == 0


def test_lfu_order_ties_by_least_recent():
    p = make("lfu", [(1, 0), (2, 0), (3, 0), (4, 0)])
    p.touch(3)
    p.touch(3)  # 3: 3 uses
    p.touch(1)  # 1: 2 uses
    p.touch(4)  # 4: 2 uses, more recent than 1
    # 2 has 1 use; then 1 and 4 tie at 2 uses (1 older); then 3
    assert drain(p) == [2, 1, 4, 3]


def test_length_aware_deepest_first_ties_by_lru():
    p = make("length-aware", [(10, 0), (11, 1), (12, 2), (20, 0), (21, 1), (22, 2)])
    p.touch(12)  # 12 and 22 tie on depth 2; 22 is now the least recent
    assert drain(p) == [22, 12, 11, 21, 10, 20]


@pytest.mark.parametrize("name", ["lru", "lfu", "length-aware"])
def test_pins_are_counted_and_never_evicted(name):
    p = make(name, [(1, 0), (2, 0), (3, 0)])
    p.pin(1)
    p.pin(1)
    p.pin(2)
    assert p.pin_count(1) == 2
    assert p.victim() == 3
    p.remove(3)
    assert p.victim() is None  # everything left is pinned
    p.unpin(1)
    assert p.victim() is None  # 1 still has one pin
    p.unpin(2)
    assert p.victim() == 2
    p.unpin(1)
    assert drain(p) == [2, 1]
    with pytest.raises(UnknownBlock):
        p.unpin(1)


@pytest.mark.parametrize("name", ["lru", "lfu", "length-aware"])
def test_unpin_without_pin_and_unknown_keys(name):
    p = make(name, [(1, 0)])
    with pytest.raises(NotPinned):
        p.unpin(1)
    with pytest.raises(UnknownBlock):
        p.touch(2)
    with pytest.raises(UnknownBlock):
        p.pin(2)
    with pytest.raises(UnknownBlock):
        p.remove(2)


def test_lru_unpin_counts_as_a_fresh_use():
    p = make("lru", [(1, 0), (2, 0), (3, 0)])
    p.pin(1)
    p.unpin(1)
    assert drain(p) == [2, 3, 1]


def test_lfu_touch_while_pinned_still_counts():
    p = make("lfu", [(1, 0), (2, 0)])
    p.pin(1)
    p.touch(1)
    p.touch(1)
    p.unpin(1)
    p.touch(2)
    assert drain(p) == [2, 1]  # 1 has 3 uses, 2 has 2


def test_pinned_key_can_be_removed():
    p = make("length-aware", [(1, 5), (2, 1)])
    p.pin(1)
    p.remove(1)
    assert 1 not in p and p.pin_count(1) == 0
    assert drain(p) == [2]


def test_heap_compaction_keeps_order():
    p = make("lfu", [(k, 0) for k in range(10)])
    for _ in range(500):  # many stale heap entries
        for k in range(1, 10):
            p.touch(k)
    assert len(p._heap) <= max(1024, 2 * len(p))
    assert drain(p) == list(range(10))


def test_make_policy_unknown_name_lists_valid_ones():
    with pytest.raises(ValueError, match="lru, lfu, length-aware"):
        make_policy("fifo")
    assert make_policy().name == "lru"
