"""The plain single-sequence forward (transformers' own cache): the reference that the batched
decode engine and the layer-wise prefill are tested against, and the benchmarks' baseline.

KV tensors travel as [num_layers, 2 (K, V), num_kv_heads, num_tokens, head_dim] (batch 1);
inside a worker they live in a transformers DynamicCache.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


def kv_from_cache(cache: DynamicCache) -> torch.Tensor:
    """DynamicCache (batch 1) -> [L, 2, H, S, D]."""
    return torch.stack([torch.stack((layer.keys[0], layer.values[0])) for layer in cache.layers])


def cache_from_kv(kv: torch.Tensor) -> DynamicCache:
    """[L, 2, H, S, D] -> DynamicCache (batch 1) that owns its tensors."""
    cache = DynamicCache()
    for layer_idx in range(kv.shape[0]):
        cache.update(kv[layer_idx, 0].unsqueeze(0).clone(), kv[layer_idx, 1].unsqueeze(0).clone(), layer_idx)
    return cache


@torch.inference_mode()
def prefill(model, token_ids: list[int], prefix_kv: torch.Tensor | None = None) -> tuple[DynamicCache, torch.Tensor]:
    """Run the prompt; returns the KV of all of it and the logits of the last position.

    With `prefix_kv` ([L, 2, H, p, D], the KV of token_ids[:p]) only token_ids[p:] is computed.
    """
    done = 0 if prefix_kv is None else prefix_kv.shape[3]
    if done >= len(token_ids):
        raise ValueError(f"a prefix of {done} tokens leaves nothing to compute in a {len(token_ids)}-token prompt")
    cache = DynamicCache() if prefix_kv is None else cache_from_kv(prefix_kv)
    out = model(torch.tensor([token_ids[done:]]), past_key_values=cache, use_cache=True, logits_to_keep=1)
    return cache, out.logits[0, -1]


@torch.inference_mode()
def decode_step(model, token_id: int, cache: DynamicCache) -> torch.Tensor:
    """Feed one token; the cache grows by one; returns next-token logits."""
    out = model(torch.tensor([[token_id]]), past_key_values=cache, use_cache=True)
    return out.logits[0, -1]
