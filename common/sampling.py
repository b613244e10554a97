"""Token sampling shared by prefill (first token) and decode (the rest).

Seeded requests are reproducible across processes: the generator for step i is seeded from
(seed, i), so prefill can sample token 0 and decode token 1.. without sharing RNG state.
"""

from __future__ import annotations

import torch

from schemas.route import SamplingParams

_SEED_STRIDE = 1_000_003


def step_generator(seed: int | None, step: int) -> torch.Generator | None:
    if seed is None:
        return None
    return torch.Generator().manual_seed((seed * _SEED_STRIDE + step) % (2**63))


def sample(logits: torch.Tensor, params: SamplingParams, step: int) -> int:
    """Pick the next token from one row of logits ([vocab])."""
    if params.temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < params.top_p  # always keeps the top token
        sorted_probs = sorted_probs * keep
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=step_generator(params.seed, step)))
