"""Storage backends: the shared-memory DRAM slab and the LMDB SSD store (services/messenger)."""

import multiprocessing
import os

import numpy as np
import pytest
import torch

from common.kv.blocks import ChecksumMismatch, KvLayout, checksum, pack_block
from common.kv.slab import DramSlab, SlabError
from services.messenger.ssd import PutStatus, SsdStore, map_size_for

LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=4, dtype="float32")


@pytest.fixture
def slab_path(tmp_path):
    # /dev/shm in production; a tmp dir keeps tests self-cleaning and works anywhere.
    return str(tmp_path / "node.slab")


def test_slab_round_trip_across_two_attachments(slab_path):
    owner = DramSlab.create(slab_path, num_slots=3, slot_nbytes=LAYOUT.block_nbytes)
    a = DramSlab.attach(slab_path)
    b = DramSlab.attach(slab_path)
    assert (a.num_slots, a.slot_nbytes, a.owner) == (3, LAYOUT.block_nbytes, False)
    slot = owner.alloc()
    assert slot == 0
    # a writes in place through a torch view; b and the owner see it with no copy
    block = torch.arange(LAYOUT.block_nbytes // 4, dtype=torch.float32).reshape(LAYOUT.block_shape)
    view_a = a.tensor(slot, LAYOUT)
    view_a.copy_(block)
    view_b = b.ndarray(slot, "float32", LAYOUT.block_shape)
    np.testing.assert_array_equal(view_b, block.numpy())
    assert owner.read(slot) == pack_block(block, LAYOUT)
    view_b[0, 0, 0, 0, 0] = -1.0
    assert view_a[0, 0, 0, 0, 0].item() == -1.0
    del view_a, view_b
    for s in (a, b):
        s.close()
    owner.close()
    owner.unlink()
    assert not os.path.exists(slab_path)


def _child_writes(path: str, slot: int) -> None:
    slab = DramSlab.attach(path)
    slab.write(slot, bytes([7]) * slab.slot_nbytes)
    slab.close()


def test_slab_shared_with_another_process(slab_path):
    owner = DramSlab.create(slab_path, num_slots=2, slot_nbytes=64)
    slot = owner.alloc()
    proc = multiprocessing.get_context("spawn").Process(target=_child_writes, args=(slab_path, slot))
    proc.start()
    proc.join()  # no wall-clock bound here: pytest-timeout ends a hang
    assert proc.exitcode == 0
    assert owner.read(slot) == bytes([7]) * 64
    out = bytearray(64)
    owner.read_into(slot, out)
    assert out == bytes([7]) * 64
    owner.close()
    owner.unlink()


def test_slab_allocation_and_roles(slab_path):
    owner = DramSlab.create(slab_path, num_slots=2, slot_nbytes=100)
    assert owner.stride == 128  # slots are 64-byte aligned
    assert [owner.alloc(), owner.alloc(), owner.alloc()] == [0, 1, None]
    owner.free(1)
    with pytest.raises(SlabError):
        owner.free(1)  # double free
    assert owner.alloc() == 1
    with pytest.raises(SlabError):
        owner.view(2)
    with pytest.raises(SlabError):
        owner.write(0, b"short")
    other = DramSlab.attach(slab_path)
    with pytest.raises(SlabError):
        other.alloc()
    other.close()
    owner.close()
    owner.unlink()
    with pytest.raises(SlabError):
        DramSlab.attach(slab_path)


def test_attach_rejects_a_foreign_file(tmp_path):
    path = tmp_path / "junk"
    path.write_bytes(b"x" * 8192)
    with pytest.raises(SlabError):
        DramSlab.attach(str(path))


def test_ssd_put_get_delete_keys(tmp_path):
    payload = os.urandom(LAYOUT.block_nbytes)
    with SsdStore(str(tmp_path / "db"), map_size_for(4, LAYOUT.block_nbytes)) as store:
        assert store.put(2**64 - 1, payload, checksum(payload)) is PutStatus.OK
        assert store.put(5, payload) is PutStatus.OK
        assert store.get(2**64 - 1) == payload
        assert store.get(6) is None
        assert list(store.keys()) == [5, 2**64 - 1] and len(store) == 2 and 5 in store
        assert store.delete(5) and not store.delete(5)
        assert list(store.keys()) == [2**64 - 1]


def test_ssd_full_is_a_typed_result_not_a_crash(tmp_path):
    payload = os.urandom(64 * 1024)
    with SsdStore(str(tmp_path / "db"), map_size=1 << 20) as store:
        statuses = [store.put(k, payload) for k in range(40)]
        assert PutStatus.FULL in statuses
        first_full = statuses.index(PutStatus.FULL)
        assert first_full > 0 and len(store) == first_full
        # evicting makes room again and the store still works
        store.delete(0)
        store.delete(1)
        assert store.put(1000, payload) is PutStatus.OK
        assert store.get(1000) == payload


def test_ssd_checksum_mismatch_is_detected(tmp_path):
    payload = os.urandom(4096)
    with SsdStore(str(tmp_path / "db"), map_size=1 << 20) as store:
        store.put(9, payload)
        with store._env.begin(write=True) as txn:  # corrupt one payload byte behind its back
            value = bytearray(txn.get((9).to_bytes(8, "big")))
            value[8 + 100] ^= 0xFF
            txn.put((9).to_bytes(8, "big"), bytes(value))
        with pytest.raises(ChecksumMismatch) as info:
            store.get(9)
        assert info.value.key == 9 and info.value.expected == checksum(payload)
        # a wrong checksum given at put time is caught on read too
        store.put(10, payload, checksum=checksum(payload) ^ 1)
        with pytest.raises(ChecksumMismatch):
            store.get(10)
