"""Block keys, layout, payload packing and checksums (common/kv/blocks.py)."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from common.kv.blocks import (
    ChecksumMismatch,
    KvLayout,
    LayoutMismatch,
    assemble_blocks,
    block_keys,
    block_keys_from_hash_ids,
    checksum,
    pack_block,
    split_blocks,
    unpack_block,
    verify,
)


def make_layout(**overrides) -> KvLayout:
    fields = dict(num_layers=2, num_kv_heads=3, head_dim=4, block_tokens=5, dtype="float32")
    return KvLayout(**(fields | overrides))


# --- keys -------------------------------------------------------------------------------------


def test_known_key_values_never_change():
    # A change here means every stored block key in every deployment changes: do it on purpose.
    assert block_keys(list(range(8)), 4) == [17724182554405238087, 18158546241820043086]
    assert block_keys_from_hash_ids([0, 1, 2]) == [10281467495222676304, 12106086165715689555, 4786583004785042745]


def test_keys_are_stable_across_processes():
    code = "from common.kv.blocks import block_keys; print(block_keys(list(range(8)), 4))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123"}, cwd=Path(__file__).parents[2])
    assert out.stdout.strip() == "[17724182554405238087, 18158546241820043086]"


def test_same_prefix_same_keys_and_partial_block_ignored():
    a = block_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], 3)
    b = block_keys([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], 3)
    assert len(a) == 3 and len(b) == 3
    assert a == b
    assert block_keys([1, 2], 3) == []
    assert all(0 <= k < 2**64 for k in a)


def test_one_token_change_changes_that_block_and_all_later():
    tokens = list(range(100, 112))
    base = block_keys(tokens, 3)
    changed = tokens.copy()
    changed[7] += 1  # block 2
    keys = block_keys(changed, 3)
    assert keys[:2] == base[:2]
    assert all(k != b for k, b in zip(keys[2:], base[2:]))


def test_same_block_tokens_under_different_prefix_get_different_keys():
    assert block_keys([1, 2, 9, 9], 2)[1] != block_keys([3, 4, 9, 9], 2)[1]


def test_seed_changes_keys():
    assert block_keys([1, 2, 3], 3, seed=1) != block_keys([1, 2, 3], 3, seed=2)


def test_hash_id_chains():
    a = block_keys_from_hash_ids([0, 1, 2, 3])
    b = block_keys_from_hash_ids([0, 1, 7, 3])
    assert a[:2] == b[:2] and a[2] != b[2] and a[3] != b[3]
    assert block_keys_from_hash_ids([]) == []


def test_block_tokens_must_be_positive():
    with pytest.raises(ValueError):
        block_keys([1, 2], 0)


# --- layout ------------------------------------------------------------------------------------


def test_layout_sizes():
    layout = KvLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_tokens=16, dtype="float32")
    assert layout.bytes_per_token == 30 * 2 * 3 * 64 * 4 == 46080
    assert layout.block_nbytes == 46080 * 16
    assert layout.block_shape == (30, 2, 3, 16, 64)
    assert make_layout(dtype="bfloat16").itemsize == 2


@pytest.mark.parametrize("bad", [dict(num_layers=0), dict(head_dim=-1), dict(block_tokens=1.5), dict(dtype="int8")])
def test_layout_validation(bad):
    with pytest.raises(ValueError):
        make_layout(**bad)


# --- payloads ----------------------------------------------------------------------------------


def test_pack_unpack_numpy_round_trip_with_checksum():
    layout = make_layout()
    block = np.arange(np.prod(layout.block_shape), dtype=np.float32).reshape(layout.block_shape)
    buf = pack_block(block, layout)
    assert len(buf) == layout.block_nbytes
    out = unpack_block(buf, layout, expected_checksum=checksum(buf))
    assert out.shape == layout.block_shape
    np.testing.assert_array_equal(out, block)


def test_pack_unpack_torch_bfloat16_round_trip():
    layout = make_layout(dtype="bfloat16")
    block = torch.randn(layout.block_shape).to(torch.bfloat16)
    buf = bytearray(pack_block(block, layout))
    out = unpack_block(buf, layout, as_torch=True)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, block)
    with pytest.raises(LayoutMismatch):
        unpack_block(buf, layout)  # numpy has no bfloat16


def test_shape_and_size_are_checked():
    layout = make_layout()
    with pytest.raises(LayoutMismatch):
        pack_block(np.zeros((2, 2, 3, 4, 4), dtype=np.float32), layout)
    with pytest.raises(LayoutMismatch):
        pack_block(torch.zeros(layout.block_shape, dtype=torch.float16), layout)
    with pytest.raises(LayoutMismatch):
        unpack_block(b"\0" * (layout.block_nbytes - 4), layout)


def test_checksum_mismatch():
    layout = make_layout()
    buf = bytearray(pack_block(np.ones(layout.block_shape, dtype=np.float32), layout))
    good = checksum(buf)
    buf[10] ^= 1
    with pytest.raises(ChecksumMismatch) as info:
        unpack_block(buf, layout, expected_checksum=good)
    assert info.value.expected == good and info.value.actual == checksum(buf)
    with pytest.raises(ChecksumMismatch):
        verify(buf, good, key=7)


def test_split_and_assemble():
    layout = make_layout(block_tokens=4)
    kv = torch.randn(layout.request_shape(11))
    blocks = split_blocks(kv, layout)
    assert len(blocks) == 2  # 11 tokens: two full blocks, the last 3 tokens are not a block
    assert all(b.shape == layout.block_shape and b.is_contiguous() for b in blocks)
    assert torch.equal(blocks[1], kv[:, :, :, 4:8, :])
    joined = assemble_blocks(blocks)
    assert torch.equal(joined, kv[:, :, :, :8, :])
    # through bytes and back, as a block travels
    again = [unpack_block(bytearray(pack_block(b, layout)), layout, as_torch=True) for b in blocks]
    assert torch.equal(assemble_blocks(again), joined)


def test_split_rejects_wrong_layout():
    with pytest.raises(LayoutMismatch):
        split_blocks(torch.zeros(2, 2, 5, 8, 4), make_layout())
