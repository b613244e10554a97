"""Token sampling shared by prefill (first token) and decode (the rest).

Seeded requests are reproducible across processes: the generator for step i is seeded from
(seed, i), so prefill can sample token 0 and decode token 1.. without sharing RNG state.

Never NaN: a temperature below MIN_TEMPERATURE is greedy (dividing by 1e-40 overflows every
logit to inf, and softmax of inf is NaN); NaN logits count as impossible; +inf logits (a model
that overflowed) are the only candidates, with equal weight; and a row with no finite candidate
at all raises `SamplingError`, which fails that request alone.
"""

from __future__ import annotations

import torch

from schemas.route import SamplingParams

_SEED_STRIDE = 1_000_003
# NOTE: at 1e-4, logits of a float32 model (|x| < 1e4 in practice) divided by T stay below 1e8,
# far from float32's 3.4e38; the distribution is then one-hot anyway.
MIN_TEMPERATURE = 1e-4


class SamplingError(ValueError):
    """Raised when a row of logits has no finite value to sample from (the model output is broken)."""


def step_generator(seed: int | None, step: int) -> torch.Generator | None:
    if seed is None:
        return None
    return torch.Generator().manual_seed((seed * _SEED_STRIDE + step) % (2**63))


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature < MIN_TEMPERATURE


def sample(logits: torch.Tensor, params: SamplingParams, step: int) -> int:
    """Pick the next token from one row of logits ([vocab])."""
    logits = _sanitized(logits)
    if is_greedy(params):
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < params.top_p
        keep[0] = True  # the top token always stays (a top_p below float32's smallest value would drop it)
        sorted_probs = sorted_probs * keep
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=step_generator(params.seed, step)))


def _sanitized(logits: torch.Tensor) -> torch.Tensor:
    """float32 logits with NaN -> -inf and, if any +inf, those alone kept (as 0, the rest -inf)."""
    logits = logits.float()
    if bool(torch.isfinite(logits).all()):
        return logits
    logits = torch.nan_to_num(logits, nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    top = torch.isposinf(logits)
    if bool(top.any()):
        return torch.zeros_like(logits).masked_fill(~top, float("-inf"))
    if not bool(torch.isfinite(logits).any()):
        raise SamplingError("the model produced no finite logit")
    return logits
