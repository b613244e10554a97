"""The decode attention kernel (common/engine/kernels) against attention computed plainly.

Each case fills a paged pool with random K and V, scatters the rows' blocks over it, and compares
the kernel's output (and the new K and V it wrote) with scaled_dot_product_attention over each
row's own tokens in float32, in both dtypes, for GQA groups of 1 and 3 and rows split into spans.
The torch fallbacks of common/engine/attention.py are held to the same reference.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.engine import kernels
from common.engine.attention import PagedAttention
from common.engine.paged import BLOCK, KvPool
from tests.required import missing

# float32: the sums' order alone; bfloat16: the output rounded once, and the weights rounded to
# bfloat16 before they multiply V (as torch's own attention does), a step of 2^-8 of a weight
LENGTHS = (1, 17, 300, 1023, 64)


@pytest.fixture(scope="module")
def kernel():
    if not kernels.load():
        missing("kernel", f"the decode attention kernel is not built for this CPU: {kernels.why_unavailable()}")
    return torch.ops.moonbus.decode_attention


def make_case(dtype: torch.dtype, heads: int, kv_heads: int, dim: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    blocks = [KvPool.blocks_for(n) for n in LENGTHS]
    pool = KvPool(1, kv_heads, dim, sum(blocks) + 3, dtype)
    with torch.inference_mode():
        pool.k.copy_(torch.randn(pool.k.shape, generator=g))
        pool.v.copy_(torch.randn(pool.v.shape, generator=g))
    order = torch.randperm(pool.num_blocks, generator=g).int()  # rows' blocks scattered over the pool
    tables = torch.zeros(len(LENGTHS), max(blocks), dtype=torch.int32)
    used = 0
    for row, n in enumerate(blocks):
        tables[row, :n] = order[used: used + n]
        used += n
    positions = torch.tensor([n - 1 for n in LENGTHS])
    q = torch.randn(len(LENGTHS), heads, dim, generator=g).to(dtype)
    k = torch.randn(len(LENGTHS), kv_heads, dim, generator=g).to(dtype)
    v = torch.randn(len(LENGTHS), kv_heads, dim, generator=g).to(dtype)
    return pool, tables, positions, q, k, v


def reference(pool: KvPool, tables, positions, q) -> torch.Tensor:
    out = []
    for row, pos in enumerate(positions.tolist()):
        n = pos + 1
        ids = tables[row, : KvPool.blocks_for(n)].long()
        keys = pool.k[0][ids].permute(1, 0, 3, 2).flatten(1, 2)[:, :n].float()  # [H, n, D]
        values = pool.v[0][ids].permute(1, 0, 2, 3).flatten(1, 2)[:, :n].float()
        out.append(F.scaled_dot_product_attention(q[row: row + 1, :, None].float(), keys[None], values[None],
                                                  scale=q.shape[-1] ** -0.5, enable_gqa=True)[0, :, 0])
    return torch.stack(out)


TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (9, 3), (20, 2)])  # groups of 1, 3 and one no case covers (10)
@pytest.mark.parametrize("span", [BLOCK, 512])
def test_the_kernel_attends_each_row_over_its_own_tokens(kernel, dtype, heads, kv_heads, span):
    pool, tables, positions, q, k, v = make_case(dtype, heads, kv_heads)
    out = kernel(q, k, v, pool.k[0], pool.v[0], tables, positions, q.shape[-1] ** -0.5, span)
    for row, pos in enumerate(positions.tolist()):  # the new K and V landed at each row's position
        block, slot = tables[row, pos // BLOCK], pos % BLOCK
        assert torch.equal(pool.k[0][block, :, :, slot], k[row]) and torch.equal(pool.v[0][block, :, slot], v[row])
    torch.testing.assert_close(out.float(), reference(pool, tables, positions, q), rtol=0,
                               atol=TOLERANCE[dtype])


@pytest.mark.parametrize("backend", ["padded", "rows"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_torch_fallbacks_attend_alike(backend, dtype):
    pool, tables, positions, q, k, v = make_case(dtype, 9, 3, seed=1)
    cache = PagedAttention(pool, tables, positions, backend)
    with torch.inference_mode():
        out = cache.attend_rows(q, k, v, 0, q.shape[-1] ** -0.5)
    torch.testing.assert_close(out.float(), reference(pool, tables, positions, q), rtol=0, atol=TOLERANCE[dtype])


def test_a_position_past_its_table_or_a_block_outside_the_pool_is_refused(kernel):
    pool, tables, positions, q, k, v = make_case(torch.float32, 4, 4)
    with pytest.raises(RuntimeError, match="past its row's block table"):
        kernel(q, k, v, pool.k[0], pool.v[0], tables, positions + 10_000, 0.125, 512)
    bad = tables.clone()
    bad[0, 0] = pool.num_blocks
    with pytest.raises(RuntimeError, match="outside the pool"):
        kernel(q, k, v, pool.k[0], pool.v[0], bad, positions, 0.125, 512)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (9, 3)])
def test_the_step_from_the_joined_projection_equals_rotating_and_attending_apart(kernel, dtype, heads, kv_heads):
    """decode_attention_qkv (what the decode step calls): the rotary embedding of q and k as
    llama.py's `_rotate` rounds it, the new K and V written, the attention: bit for bit the
    rotation in torch followed by decode_attention."""
    from common.engine.llama import _rotate

    pool, tables, positions, _, _, _ = make_case(dtype, heads, kv_heads, seed=2)
    apart = KvPool(1, kv_heads, pool.head_dim, pool.num_blocks, dtype)
    with torch.inference_mode():
        apart.k.copy_(pool.k)
        apart.v.copy_(pool.v)
    g = torch.Generator().manual_seed(3)
    dim, batch = pool.head_dim, len(positions)
    qkv = torch.randn(batch, 1, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    angles = positions[:, None, None].float() * torch.rand(1, 1, dim // 2, generator=g)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)  # [B, 1, D / 2], as Llama.rope gives them
    got = torch.ops.moonbus.decode_attention_qkv(qkv[:, 0], cos[:, 0], sin[:, 0], pool.k[0], pool.v[0], tables,
                                                 positions, dim ** -0.5, 512, heads)
    qk = _rotate(qkv[..., : (heads + kv_heads) * dim], cos, sin, dim)[:, 0]
    v = qkv[:, 0, (heads + kv_heads) * dim:].reshape(batch, kv_heads, dim)
    want = kernel(qk[:, :heads].contiguous(), qk[:, heads:].contiguous(), v.contiguous(), apart.k[0], apart.v[0],
                  tables, positions, dim ** -0.5, 512)
    assert torch.equal(got, want)
    assert torch.equal(pool.k, apart.k) and torch.equal(pool.v, apart.v)
    with pytest.raises(RuntimeError, match="width"):
        torch.ops.moonbus.decode_attention_qkv(qkv[:, 0], cos[:, 0], sin[:, 0], pool.k[0], pool.v[0], tables,
                                               positions, dim ** -0.5, 512, heads + 1)
