"""The prefill attention kernel (common/engine/kernels/prefill_attention.cpp) against attention
computed plainly in float32 (or float64), and the engine's choice of it.

Each case is a chunk of queries at positions start .. start + n - 1 over the keys of its prefix
and itself, with GQA groups of 1 to 4, head sizes 16 to 128, queries taken as the strided view of
a joined q/k/v projection (as the engine passes them) and K read through a view longer than the
tokens. In bfloat16 the kernel rounds as torch's bfloat16 attention does (weights to bfloat16
before they multiply V, the output once), so its error against float32 is held to torch's own
bfloat16 error on the same case, with room for a rounding step of its own order of sums; in
float32 its error against float64 is held to torch's float32 SDPA's, with room for a few float32
rounding steps of its own order of sums.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common import machine
from common.engine import kernels
from common.engine.llama import Llama
from tests.required import missing

# (queries, start, query heads, kv heads, head size)
CASES = [(1, 0, 9, 3, 64), (5, 0, 9, 3, 64), (17, 0, 9, 3, 64), (100, 0, 9, 3, 64), (64, 64, 9, 3, 64),
         (33, 200, 9, 3, 64), (1, 500, 9, 3, 64), (513, 0, 9, 3, 64), (300, 0, 8, 8, 128), (37, 1000, 4, 1, 32),
         (300, 0, 4, 2, 16), (70, 230, 4, 2, 16), (90, 0, 2, 1, 48)]


@pytest.fixture(scope="module")
def built():
    if not kernels.load():
        missing("kernel", f"the kernels are not built for this CPU: {kernels.why_unavailable()}")
    return torch.ops.moonbus.prefill_attention


@pytest.fixture(scope="module")
def kernel(built):
    """The bfloat16 kernel; on a CPU without AVX-512 BF16, where the build leaves that path out
    (checked here), what the engine runs there instead: torch's bfloat16 SDPA with the causal mask."""
    if machine.has_bf16():
        return built
    q, k, v = case(4, 0, 2, 1, 16)
    with pytest.raises(RuntimeError, match="bfloat16 needs AVX-512 BF16"):
        built(q, k, v, 0, 0.25)
    return lambda q, k, v, start, scale: plain(q, k, v, start, torch.bfloat16).to(torch.bfloat16).contiguous()


def case(n: int, start: int, heads: int, kv_heads: int, dim: int, seed: int = 0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    total = start + n
    joined = torch.randn(n, heads + 2 * kv_heads, dim, generator=g).to(dtype)
    q = joined[:, :heads]  # [n, Hq, D], rows strided as the projection's output
    k = (2 * torch.randn(kv_heads, total + 7, dim, generator=g)).to(dtype)[:, :total]
    v = torch.randn(kv_heads, total, dim, generator=g).to(dtype)
    return q, k, v


def plain(q, k, v, start: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    n, total = q.shape[0], k.shape[1]
    seen = torch.arange(total)[None, :] <= torch.arange(start, start + n)[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None].to(dtype), k[None].to(dtype), v[None].to(dtype),
                                         attn_mask=seen[None, None], scale=q.shape[-1] ** -0.5, enable_gqa=True)
    return out[0].transpose(0, 1).to(torch.float64 if dtype == torch.float64 else torch.float32)


@pytest.mark.parametrize("n,start,heads,kv_heads,dim", CASES)
def test_the_kernel_agrees_with_float32_attention_as_torchs_bfloat16_does(kernel, n, start, heads, kv_heads, dim):
    q, k, v = case(n, start, heads, kv_heads, dim)
    got = kernel(q, k, v, start, dim ** -0.5)
    assert got.shape == (n, heads, dim) and got.dtype == torch.bfloat16 and got.is_contiguous()
    want = plain(q, k, v, start)
    torch_error = float((plain(q, k, v, start, torch.bfloat16) - want).abs().max())
    error = float((got.float() - want).abs().max())
    step = torch.finfo(torch.bfloat16).eps * float(want.abs().max())
    assert error <= torch_error + step, f"off by {error:.4g}; torch's bfloat16 attention by {torch_error:.4g}"


@pytest.mark.parametrize("n,start,heads,kv_heads,dim", CASES)
def test_in_float32_the_kernel_agrees_with_float64_attention_as_torchs_float32_does(built, n, start, heads,
                                                                                     kv_heads, dim):
    q, k, v = case(n, start, heads, kv_heads, dim, dtype=torch.float32)
    got = built(q, k, v, start, dim ** -0.5)
    assert got.shape == (n, heads, dim) and got.dtype == torch.float32 and got.is_contiguous()
    want = plain(q, k, v, start, torch.float64)
    torch_error = float((plain(q, k, v, start) - want).abs().max())
    error = float((got.double() - want).abs().max())
    step = torch.finfo(torch.float32).eps * float(want.abs().max())
    assert error <= torch_error + 8 * step, f"off by {error:.4g}; torch's float32 attention by {torch_error:.4g}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_query_sees_no_key_after_its_own_position(kernel, built, dtype):
    attend = kernel if dtype == torch.bfloat16 else built
    q, k, v = case(40, 24, 4, 2, 64, dtype=dtype)
    changed = v.clone()
    changed[:, 40:] = 100.0  # the values of positions 40..63: only queries at positions >= 40 see them
    a, b = attend(q, k, v, 24, 0.125), attend(q, k, changed, 24, 0.125)
    assert torch.equal(a[:16], b[:16])  # queries at positions 24..39
    assert not torch.equal(a[16:], b[16:])


def test_bad_shapes_and_dtypes_are_refused_with_a_reason(built):
    q, k, v = case(8, 0, 4, 2, 64, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="one dtype"):
        built(q, k.to(torch.bfloat16), v, 0, 0.125)
    with pytest.raises(RuntimeError, match="float32 or bfloat16|float32 only"):
        built(q.double(), k.double(), v.double(), 0, 0.125)
    with pytest.raises(RuntimeError, match="start \\+ n tokens"):
        built(q, k, v, 3, 0.125)
    with pytest.raises(RuntimeError, match="multiple of kv heads"):
        built(q[:, :3], k, v, 0, 0.125)


def test_the_engine_takes_the_kernel_only_where_it_applies(tmp_path):
    from common import models

    ref = models.prepare("tiny-random", tmp_path)
    bf16, fp32 = Llama.load(ref.path, "bfloat16"), Llama.load(ref.path, "float32")
    assert not bf16.prefill_kernel("sdpa") and not fp32.prefill_kernel("sdpa")
    with pytest.raises(ValueError, match="not one of"):
        bf16.prefill_kernel("flash")
    if not kernels.load():
        missing("kernel", f"the kernels are not built for this CPU: {kernels.why_unavailable()}")
    if machine.has_bf16():
        assert bf16.prefill_kernel() and bf16.prefill_kernel("kernel")
    else:
        assert not bf16.prefill_kernel()
        with pytest.raises(kernels.KernelUnavailable):
            bf16.prefill_kernel("kernel")
    if machine.has_float_vectors():
        assert fp32.prefill_kernel() and fp32.prefill_kernel("kernel")
    else:
        assert not fp32.prefill_kernel()
        with pytest.raises(kernels.KernelUnavailable):
            fp32.prefill_kernel("kernel")
