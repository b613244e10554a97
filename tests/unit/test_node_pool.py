"""The messenger's node pool: TieredPool decisions carried out on a real slab and LMDB store."""

from __future__ import annotations

import pytest

from common.kv import blocks as kvblocks
from common.kv.blocks import KvLayout
from schemas.pool import SlotRef
from services.messenger.node_pool import NodePool

LAYOUT = KvLayout(num_layers=2, num_kv_heads=1, head_dim=4, block_tokens=2)


def make_pool(tmp_path, dram=2, ssd=2, policy="lru") -> NodePool:
    return NodePool("n1", LAYOUT, tmp_path / "slab", dram, tmp_path / "ssd", ssd, policy)


def payload(i: int) -> bytes:
    return bytes([i]) * LAYOUT.block_nbytes


def store(pool: NodePool, rid: str, keys: list[int]) -> list:
    slots, events = pool.reserve(rid, keys, 0)
    written = []
    for ref in slots:
        pool.slab.write(ref.slot, payload(ref.key))
        written.append(SlotRef(ref.key, ref.slot, kvblocks.checksum(payload(ref.key))))
    events += pool.commit(rid, written)
    pool.release(rid)
    return events


def kinds(events) -> list[tuple[str, str, list[int], int]]:
    return [(e.kind, e.data.tier, e.data.keys, e.data.seq) for e in events]


@pytest.fixture
def pool(tmp_path):
    p = make_pool(tmp_path)
    yield p
    p.close()


def test_reserved_blocks_are_invisible_until_committed(pool):
    slots, events = pool.reserve("r1", [1, 2], 0)
    assert [s.key for s in slots] == [1, 2] and events == []
    assert pool.lookup("r2", [1, 2])[0] == []
    for ref in slots:
        pool.slab.write(ref.slot, payload(ref.key))
    events = pool.commit("r1", [SlotRef(r.key, r.slot, kvblocks.checksum(payload(r.key))) for r in slots])
    assert kinds(events) == [("stored", "dram", [1, 2], 1)]
    found, _ = pool.lookup("r2", [1, 2, 3])
    assert [f.key for f in found] == [1, 2]
    assert bytes(pool.slab.view(found[1].slot)) == payload(2)


def test_dram_eviction_demotes_and_an_ssd_hit_promotes(pool):
    store(pool, "a", [1, 2])
    events = store(pool, "b", [3])
    assert kinds(events) == [("demoted", "ssd", [1], 2), ("stored", "dram", [3], 3)]
    found, events = pool.lookup("c", [1])
    assert [f.key for f in found] == [1]
    assert bytes(pool.slab.view(found[0].slot)) == payload(1)  # read back from LMDB
    assert kinds(events) == [("demoted", "ssd", [2], 4), ("promoted", "dram", [1], 5)]
    assert pool.snapshot() == (5, {1: "dram", 3: "dram", 2: "ssd"})


def test_pinned_blocks_are_never_evicted(tmp_path):
    pool = make_pool(tmp_path, dram=2, ssd=0)
    store(pool, "a", [1, 2])
    pool.lookup("reader", [1, 2])  # pins both
    slots, events = pool.reserve("b", [3], 0)
    assert slots == [] and events == []  # no room: nothing stored, nothing evicted
    pool.release("reader")
    assert [s.key for s in pool.reserve("b", [3], 0)[0]] == [3]
    pool.close()


def test_released_reservation_is_dropped_quietly(pool):
    slots, _ = pool.reserve("r", [7], 0)
    assert pool.release("r") == []
    assert 7 not in pool.pool and pool.slab.num_free == 2


def test_corrupt_block_is_dropped_and_reported(pool):
    store(pool, "a", [1])
    pool.slab.write(pool.slots[1], payload(9))  # bytes no longer match the checksum
    assert pool.read_block(1) is None
    assert 1 not in pool.pool
    assert pool.lookup("r", [1])[0] == []


def test_holds_of_one_request_by_two_holders_do_not_release_each_other(pool):
    store(pool, "p:1/seed", [1, 2])
    pool.lookup("prefill-0:aa/r", [1, 2])
    pool.lookup("decode-0:bb/r", [1])
    assert pool.holders() == {"prefill-0:aa/r": 2, "decode-0:bb/r": 1}
    pool.release("decode-0:bb/r")  # the decode side is done: the prefill's pins stay
    assert pool.holders() == {"prefill-0:aa/r": 2} and pool.num_pinned == 2
    pool.release("prefill-0:aa/r")
    assert pool.holders() == {} and pool.num_pinned == 0


def test_a_dead_holder_releases_everything_it_pinned_and_reserved(pool):
    store(pool, "p:1/seed", [1])
    pool.lookup("decode-0:old/r1", [1])
    slots, _ = pool.reserve("decode-0:old/r2", [5], 0)  # reserved, never written
    assert slots and pool.num_pinned == 2
    pool.release_holder("decode-0:old")
    assert pool.holders() == {} and pool.num_pinned == 0
    assert 5 not in pool.pool and pool.slab.num_free == pool.slab.num_slots - 1  # only block 1 holds a slot


def test_a_block_found_corrupt_by_a_reader_leaves_the_pool_with_events(pool):
    store(pool, "p:1/seed", [1, 2])
    pool.lookup("prefill-0:aa/r9", [1, 2])
    events = pool.release("prefill-0:aa/r9", corrupt=[2])
    assert 2 not in pool.pool and 1 in pool.pool
    corrupt = [e for e in events if e.kind == "corrupt"]
    evicted = [e for e in events if e.kind == "evicted"]
    assert [e.data.keys for e in corrupt] == [[2]] and corrupt[0].data.request_id == "r9"
    assert [e.data.keys for e in evicted] == [[2]] and evicted[0].data.seq > 0  # the index applies it


def test_a_corrupt_block_found_while_serving_a_fetch_keeps_its_events(pool):
    store(pool, "p:1/seed", [1])
    pool.slab.write(pool.slots[1], payload(99))  # rot in memory
    assert pool.read_block(1) is None
    kinds_seen = [e.kind for e in pool.take_events()]
    assert kinds_seen == ["corrupt", "evicted"] and 1 not in pool.pool


def test_a_failing_ssd_write_frees_the_slot_of_the_demoted_block(tmp_path, monkeypatch):
    pool = make_pool(tmp_path, dram=1, ssd=2)
    try:
        store(pool, "p:1/a", [1])

        def broken(*args, **kwargs):
            raise OSError("disk gone")

        monkeypatch.setattr(pool.ssd, "put", broken)
        store(pool, "p:1/b", [2])  # demotes block 1: the write fails, the block is dropped
        assert 1 not in pool.pool and 2 in pool.pool
        assert pool.slab.num_free == 0 and len(pool.slots) == 1  # one slot, held by block 2
    finally:
        pool.close()


def test_the_slab_is_named_after_the_epoch_and_stale_ones_are_removed(tmp_path):
    (tmp_path / "shm").mkdir()
    (tmp_path / "shm" / "slab-deadbeef").write_bytes(b"x")
    pool = NodePool("n1", LAYOUT, tmp_path / "shm", 2, None, 0, "lru")
    try:
        assert pool.slab_path.name == f"slab-{pool.epoch}"
        assert sorted(p.name for p in (tmp_path / "shm").iterdir()) == [pool.slab_path.name]
    finally:
        pool.close()
