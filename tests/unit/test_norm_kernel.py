"""The engine's RMSNorm kernel (common/engine/kernels/norm.cpp) against transformers' LlamaRMSNorm.

In bfloat16, what the decode step runs it for, the norm is computed in float32 and rounded, so
the float32 sum's own order reaches an output only where it moves the rounding: an element may
differ from transformers' by one bfloat16 step, and almost none do (none over the cases below;
a prefill of tiny-random's 300 tokens met one, which is why prefill keeps torch's norm and its
exact comparison). In float32 it agrees to a last-bit step.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from common.engine import kernels
from tests.required import missing


@pytest.fixture(scope="module")
def rms_norm():
    if not kernels.load():
        missing("kernel", f"the kernels are not built for this CPU: {kernels.why_unavailable()}")
    return torch.ops.moonbus.rms_norm


def transformers_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    norm = LlamaRMSNorm(weight.shape[0], eps).to(weight.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
        return norm(x)


@pytest.mark.parametrize("shape", [(1, 1, 576), (16, 1, 576), (4, 3, 576), (300, 576), (2, 7, 64), (5, 16)])
@pytest.mark.parametrize("seed", [0, 1])
def test_bfloat16_agrees_with_transformers_to_a_step_and_nearly_always_exactly(rms_norm, shape, seed):
    g = torch.Generator().manual_seed(seed)
    x = (4 * torch.randn(*shape, generator=g)).to(torch.bfloat16)
    weight = torch.randn(shape[-1], generator=g).to(torch.bfloat16)
    got, want = rms_norm(x, weight, 1e-5), transformers_norm(x, weight, 1e-5)
    assert got.shape == x.shape and got.dtype == torch.bfloat16
    step = torch.finfo(torch.bfloat16).eps * want.float().abs()  # one bfloat16 step of each value
    assert bool(((got.float() - want.float()).abs() <= step).all())
    assert int((got != want).sum()) <= max(1, got.numel() // 1000)


def test_float32_agrees_to_a_last_bit_step(rms_norm):
    g = torch.Generator().manual_seed(2)
    x, weight = 4 * torch.randn(8, 3, 576, generator=g), torch.randn(576, generator=g)
    want = transformers_norm(x, weight, 1e-6)
    assert torch.allclose(rms_norm(x, weight, 1e-6), want, rtol=4 * torch.finfo(torch.float32).eps, atol=0)


def test_strided_rows_read_as_their_values(rms_norm):
    x = torch.randn(3, 5, 576).to(torch.bfloat16)
    last = x[:, -1]  # the last position of every row: a strided view, as the logits take it
    weight = torch.ones(576, dtype=torch.bfloat16)
    assert torch.equal(rms_norm(last, weight, 1e-5), rms_norm(last.contiguous(), weight, 1e-5))


def test_mismatched_inputs_are_refused_with_a_reason(rms_norm):
    with pytest.raises(RuntimeError, match="share a dtype"):
        rms_norm(torch.randn(2, 8), torch.ones(8, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(RuntimeError, match="weight \\[d\\]"):
        rms_norm(torch.randn(2, 8), torch.ones(4), 1e-5)
