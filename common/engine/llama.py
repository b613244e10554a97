"""LLaMA-family models (llama, mistral, qwen2) as the workers run them: weights read straight from
a checkpoint's safetensors, and a decoder layer in a dozen torch ops.

Why not transformers' modules: their layer machinery (hooks, keyword plumbing, cache and mask
handling) cost about 1.5 ms per layer per decode step here, so a batch-1 step of SmolLM2-135M
took 59 ms where reading its bf16 weights once takes about 14 ms; and importing transformers
costs each worker seconds (minutes under the RDMA VM's emulation). The engines (batch.py,
layerwise.py) walk the layers themselves and call `Llama.layer` for each, writing K and V into
their own caches.

The math is transformers' LlamaDecoderLayer, kept equal where it matters for greedy outputs:
- RMSNorm in float32 (x * rsqrt(mean(x^2) + eps)), then `weight * x` in the model dtype;
- rotary tables from float32 (position * inv_freq, cos, sin), cast to the model dtype; q and k
  rotated in the model dtype;
- attention by torch's scaled_dot_product_attention (GQA by head groups), the SiLU-gated MLP,
  residual adds in the model dtype; lm_head on the last position, logits in float32.
What differs: q, k, v come out of one matmul (their weights joined), gate and up out of another;
each output element is still one dot product over the hidden size. Tests compare greedy tokens
with transformers' generate() in the same dtype (tests/unit/test_batch_decode.py, test_layerwise_prefill.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from common import machine
from common.engine import kernels

SUPPORTED = ("llama", "mistral", "qwen2")
PREFILL_ATTENTION = ("auto", "kernel", "sdpa")
PACK_ROWS = 64  # the rows oneDNN's packed layout is chosen for (a decode batch; 1-64 ran alike here)


class UnsupportedModel(ValueError):
    """Raised by `Llama.load` / `from_hf` for a checkpoint outside the LLaMA family this file covers."""


class KvWriter:
    """An engine's cache as a layer sees it: `attend` stores the new K, V ([B, H, n, D]) of layer
    `idx` and returns the attention of q over what each row may see ([B, Hq, n, D])."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, idx: int, model: "Llama") -> torch.Tensor:
        raise NotImplementedError

    def attend_projected(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, idx: int,
                         model: "Llama") -> torch.Tensor | None:
        """The same from the joined projection qkv [B, n, (Hq + 2 Hkv) D] before the rotary
        embedding, in one call -> [B, n, Hq * D]; None where this cache has no such call (the
        layer then rotates and splits the heads itself and calls `attend`)."""
        return None


@dataclass(frozen=True)
class Config:
    """What the forward needs of config.json."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_context: int
    rms_eps: float
    rope_theta: float
    tie_embeddings: bool

    @classmethod
    def from_json(cls, cfg: dict) -> "Config":
        model_type = cfg.get("model_type", "")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        checks = {f"model_type {model_type!r}": model_type not in SUPPORTED,
                  f"hidden_act {cfg.get('hidden_act')!r}": cfg.get("hidden_act", "silu") != "silu",
                  "mlp_bias": bool(cfg.get("mlp_bias")),
                  f"rope_type {rope.get('rope_type')!r}": rope.get("rope_type", "default") != "default",
                  "sliding_window": bool(cfg.get("sliding_window") and cfg.get("use_sliding_window", True))}
        why = [what for what, unsupported in checks.items() if unsupported]
        if why:
            raise UnsupportedModel(f"moonbus runs LLaMA-family checkpoints ({', '.join(SUPPORTED)}); this one has "
                                   + ", ".join(why))
        heads, d = cfg["num_attention_heads"], cfg["hidden_size"]
        return cls(cfg["vocab_size"], d, cfg["num_hidden_layers"], heads, cfg.get("num_key_value_heads") or heads,
                   cfg.get("head_dim") or d // heads, cfg["max_position_embeddings"], float(cfg.get("rms_norm_eps", 1e-6)),
                   float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))), bool(cfg.get("tie_word_embeddings")))


@dataclass(frozen=True)
class PackedLayer:
    """A layer's projections in oneDNN's blocked layout (`Llama.packed`); None: the dense weight."""

    qkv: torch.Tensor | None
    o: torch.Tensor | None
    gate_up: torch.Tensor | None
    down: torch.Tensor | None


DENSE = PackedLayer(None, None, None, None)


@dataclass(frozen=True)
class Packed:
    layers: list[PackedLayer]
    lm_head: torch.Tensor


@dataclass
class Layer:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [q + k + v rows, hidden]
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor


class Llama:
    """One model's weights (in one dtype) and its forward pieces; shared by every engine of a process."""

    def __init__(self, config: Config, weights: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        self.config = config
        self.dtype, self.device = dtype, weights["model.embed_tokens.weight"].device
        self.num_layers, self.num_heads = config.num_layers, config.num_heads
        self.num_kv_heads, self.head_dim = config.num_kv_heads, config.head_dim
        self.max_context = config.max_context
        w = {name: t.to(dtype) for name, t in weights.items()}
        self.embed = w["model.embed_tokens.weight"]
        self.norm = w["model.norm.weight"]
        self.lm_head = self.embed if config.tie_embeddings or "lm_head.weight" not in w else w["lm_head.weight"]
        self.layers = [self._layer(w, f"model.layers.{i}.") for i in range(config.num_layers)]
        self.q_size, self.kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.scale = config.head_dim ** -0.5
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, config.head_dim, 2, dtype=torch.int64).float()
                                                / config.head_dim))
        freqs = torch.arange(config.max_context, dtype=torch.float32)[:, None] * inv_freq[None, :]
        # [max_context, head_dim / 2]: a rotary table's two halves are equal, so one is kept
        self.cos, self.sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
        self._packed: Packed | None | bool = False  # False: not tried yet

    @staticmethod
    def _layer(w: dict[str, torch.Tensor], p: str) -> Layer:
        a, m = p + "self_attn.", p + "mlp."
        bias = [w.get(f"{a}{x}_proj.bias") for x in "qkv"]
        return Layer(w[p + "input_layernorm.weight"],
                     torch.cat([w[f"{a}{x}_proj.weight"] for x in "qkv"]).contiguous(),
                     torch.cat(bias) if bias[0] is not None else None,
                     w[a + "o_proj.weight"], w.get(a + "o_proj.bias"), w[p + "post_attention_layernorm.weight"],
                     torch.cat((w[m + "gate_proj.weight"], w[m + "up_proj.weight"])).contiguous(), w[m + "down_proj.weight"])

    # --- construction ---------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path, dtype: str = "float32") -> "Llama":
        """From a Hugging Face checkpoint directory (config.json and *.safetensors)."""
        from safetensors.torch import load_file

        path = Path(path)
        config = Config.from_json(json.loads((path / "config.json").read_text()))
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise UnsupportedModel(f"no .safetensors weights in {path}")
        weights: dict[str, torch.Tensor] = {}
        for f in files:
            weights.update(load_file(str(f)))
        return cls(config, weights, getattr(torch, dtype))

    @classmethod
    def from_hf(cls, model) -> "Llama":
        """The same weights as a loaded transformers model (for tests and benchmarks against it)."""
        config = Config.from_json(model.config.to_dict())
        param = next(model.parameters())
        return cls(config, {k: v.detach() for k, v in model.state_dict().items()}, param.dtype)

    def packed(self) -> Packed | None:
        """The projections packed for oneDNN's matmul, made once per process; None where it does
        not apply (this torch has no oneDNN, or oneDNN cannot pack this dtype on this CPU).

        What a decode step multiplies is a few rows by every weight. MKL's dense path, which
        `F.linear` takes in float32, runs such a product on one thread, and 2 rows cost it twice
        what 1 does (docs/benchmarks.md has the measurements);
        oneDNN over weights packed once uses every thread and reads each weight once per step.
        Its rows also do not depend on the batch (a row's result is the same at 1 row or 64,
        which MKL's is not at 1-2 rows). It costs a second copy of the projections' weights in
        the processes that decode. bfloat16 packs where the CPU computes it natively (AVX-512
        BF16 or AMX: `machine.has_bf16`); measured here (AVX-512 BF16, SmolLM2's shapes, one
        thread) a step's matmuls took 11.0 ms packed against 18.3 ms dense at batch 1, 45.8 against
        62.0 ms at batch 32. On an AVX2 CPU oneDNN refuses to pack bfloat16: the dense path stays."""
        if self._packed is False:
            wanted = self.dtype == torch.float32 or (self.dtype == torch.bfloat16 and machine.has_bf16())
            self._packed = _pack(self) if wanted and torch.backends.mkldnn.is_available() else None
        return self._packed

    # --- the forward, in pieces the engines call ----------------------------------------------------
    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, n, D / 2] (a rotary table's half) for position ids [B, n]."""
        return self.cos[positions], self.sin[positions]

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.embed)

    def logits(self, hidden: torch.Tensor, packed: Packed | None = None, norm_kernel: bool = False) -> torch.Tensor:
        """Float32 logits of the last position of every row: hidden [B, n, d] -> [B, vocab]."""
        normed = _rms_norm(hidden[:, -1], self.norm, self.config.rms_eps, norm_kernel)
        return _linear(normed, self.lm_head, None, packed.lm_head if packed else None).float()

    def attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                  mask: torch.Tensor | None = None) -> torch.Tensor:
        """q [B, Hq, n, D] over keys, values [B, Hkv, k, D]; mask None: causal when n > 1 (n == k), all when 1."""
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=mask is None and q.shape[2] > 1,
                                              scale=self.scale, enable_gqa=self.num_kv_heads != self.num_heads)

    def causal_attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                         mask: torch.Tensor | None, kernel: bool) -> torch.Tensor:
        """A prompt chunk's attention: q [1, Hq, n, D] at positions start .. start + n - 1 over
        keys, values [Hkv, start + n, D] (the prefix's, then the chunk's own); `mask` as
        `attention` takes it (None for a first chunk). `kernel` (`prefill_kernel`): the engine's
        C++ flash attention (float32 on the CPU's float32 vectors, bfloat16 on its bfloat16 dot
        products), else torch's SDPA."""
        if kernel:
            return torch.ops.moonbus.prefill_attention(q[0].transpose(0, 1), keys, values, start,
                                                       self.scale).transpose(0, 1)[None]
        return self.attention(q, keys[None], values[None], mask)

    def norm_kernel(self) -> bool:
        """Whether the decode step normalises on the engine's kernel (kernels/norm.cpp): in
        bfloat16 where the kernels are built (in float32 torch's norm is one fused op already)."""
        return self.dtype == torch.bfloat16 and kernels.provides("rms_norm")

    def prefill_kernel(self, choice: str = "auto") -> bool:
        """Whether a prefill attends with the C++ kernel (common/engine/kernels/prefill_attention.cpp):
        `choice` auto (where it applies: a head size that is a multiple of 16, the kernels built or
        buildable, and float32 weights on a CPU with AVX2 and FMA or AVX-512, or bfloat16 weights on
        one with AVX-512 BF16), kernel (it must apply: raises kernels.KernelUnavailable where it
        cannot) or sdpa (torch's, as before the kernel). Measured side by side in `moonbus bench
        engine` (its floors rows)."""
        if choice not in PREFILL_ATTENTION:
            raise ValueError(f"prefill attention {choice!r} is not one of {PREFILL_ATTENTION}")
        if choice == "sdpa":
            return False
        fits = self.head_dim % 16 == 0 and (machine.has_bf16() if self.dtype == torch.bfloat16
                                            else self.dtype == torch.float32 and machine.has_float_vectors())
        if choice == "kernel":
            kernels.require()
            if not (fits and kernels.provides("prefill_attention")):
                raise kernels.KernelUnavailable("the prefill attention kernel runs a head size that is a multiple of 16, "
                                                "float32 weights on a CPU with AVX2 and FMA or AVX-512, bfloat16 "
                                                "weights on one with AVX-512 BF16")
            return True
        return fits and kernels.provides("prefill_attention")

    def layer(self, idx: int, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KvWriter,
              packed: Packed | None = None, norm_kernel: bool = False) -> torch.Tensor:
        """One decoder layer over hidden [B, n, d], at positions whose cos, sin [B, n, D] are given;
        the cache stores the new K, V and attends (`KvWriter.attend`). With `packed` (`Llama.packed`)
        the projections run on the packed weights; `norm_kernel` (`norm_kernel()`): the norms on
        the engine's kernel."""
        w, eps = self.layers[idx], self.config.rms_eps
        p = packed.layers[idx] if packed else DENSE
        batch, n, _ = hidden.shape
        qkv = _linear(_rms_norm(hidden, w.input_norm, eps, norm_kernel), w.qkv, w.qkv_bias, p.qkv)
        out = cache.attend_projected(qkv, cos, sin, idx, self)
        if out is None:
            qk = _rotate(qkv[..., : self.q_size + self.kv_size], cos, sin, self.head_dim)
            q = qk[:, :, : self.num_heads].transpose(1, 2)
            k = qk[:, :, self.num_heads :].transpose(1, 2)
            v = qkv[..., self.q_size + self.kv_size :].view(batch, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
            out = cache.attend(q, k, v, idx, self).transpose(1, 2).reshape(batch, n, self.q_size)
        # NOTE: in place where a tensor is this layer's own (the projections' outputs): at prefill's
        # sizes every fresh tensor costs page faults, more than the operation itself
        hidden = _linear(out, w.o, w.o_bias, p.o).add_(hidden)
        gate, up = _linear(_rms_norm(hidden, w.post_norm, eps, norm_kernel), w.gate_up, None, p.gate_up).chunk(2, dim=-1)
        return _linear(F.silu(gate, inplace=True).mul_(up), w.down, None, p.down).add_(hidden)


def _pack(model: Llama) -> Packed | None:
    reorder = torch.ops.mkldnn._reorder_linear_weight
    try:
        layers = [PackedLayer(*(reorder(t, PACK_ROWS) for t in (w.qkv, w.o, w.gate_up, w.down))) for w in model.layers]
        return Packed(layers, reorder(model.lm_head, PACK_ROWS))
    except RuntimeError:  # a oneDNN without this dtype's packing on this CPU: the dense path stays
        return None


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            packed: torch.Tensor | None) -> torch.Tensor:
    if packed is None:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, kernel: bool = False) -> torch.Tensor:
    """transformers' LlamaRMSNorm bit for bit: normalised in float32, rounded to x's dtype, then
    scaled by the weight (torch's fused kernel; in float32 the scaling fuses too). `kernel`
    (bfloat16, the decode step): the engine's one-pass kernel (kernels/norm.cpp: 3 us a call
    against torch's 15-18 us at a decode step's rows, 7-8% of a SmolLM2 step), whose float32 sum
    runs in its own order, so an output can differ from torch's by a bfloat16 step, rarely
    (tests/unit/test_norm_kernel.py)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    if kernel:
        return torch.ops.moonbus.rms_norm(x, weight, eps)
    return weight * F.rms_norm(x, weight.shape, None, eps)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The rotary embedding of heads x [B, n, H * D] (a view of the projection's output) at the
    positions of cos, sin [B, n, D / 2] -> [B, n, H, D], contiguous: per head, halves x1, x2 become
    x1 cos - x2 sin, x2 cos + x1 sin, which is transformers' `x * cos + rotate_half(x) * sin` to the
    bit without the concatenations."""
    batch, n, _ = x.shape
    half = head_dim // 2
    x = x.view(batch, n, -1, 2, half)
    x1, x2 = x[..., 0, :], x[..., 1, :]
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    o1, o2 = out[..., 0, :], out[..., 1, :]
    torch.mul(x1, cos, out=o1)
    o1.sub_(x2 * sin)
    torch.mul(x2, cos, out=o2)
    o2.add_(x1 * sin)
    return out.view(batch, n, -1, head_dim)
