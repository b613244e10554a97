"""Token sampling shared by prefill (first token) and decode (the rest), vectorised over rows.

`sample_rows(logits [B, vocab], params, steps)` picks every row's next token in one pass: greedy
rows by one batched argmax; the sampled rows scaled by their temperatures, cut to their top-k and
top-p, and drawn by inverse transform (one uniform per row against the row's cumulative
distribution). `sample` is one row of it, so prefill's first token and decode's later ones come
from the same code.

Seeded requests are reproducible across processes: the uniform of step i is drawn from a
generator seeded from (seed, i), so prefill can sample token 0 and decode token 1.. without
sharing RNG state, whatever batch the row is in.

Top-p over a vocabulary of tens of thousands would sort every row; the rows' top CANDIDATES
logits are taken first (torch.topk), and a row is sorted whole only when those do not already
hold its top-p mass (a flat distribution), so the result is exact either way.

Never NaN: a temperature below MIN_TEMPERATURE is greedy (dividing by 1e-40 overflows every
logit to inf, and softmax of inf is NaN); NaN logits count as impossible; +inf logits (a model
that overflowed) are the only candidates, with equal weight; and a row with no finite candidate
at all is that row's error (`SamplingError` from `sample`), which fails that request alone.
"""

from __future__ import annotations

import torch

from schemas.route import SamplingParams

_SEED_STRIDE = 1_000_003
# NOTE: at 1e-4, logits of a float32 model (|x| < 1e4 in practice) divided by T stay below 1e8,
# far from float32's 3.4e38; the distribution is then one-hot anyway.
MIN_TEMPERATURE = 1e-4
CANDIDATES = 256  # logits a sampled row is cut to before top-p, when they hold its top-p mass


class SamplingError(ValueError):
    """Raised by `sample` when a row of logits has no finite value to sample from (the model output
    is broken)."""


def step_generator(seed: int | None, step: int) -> torch.Generator | None:
    if seed is None:
        return None
    return torch.Generator().manual_seed((seed * _SEED_STRIDE + step) % (2**63))


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature < MIN_TEMPERATURE


def sample(logits: torch.Tensor, params: SamplingParams, step: int) -> int:
    """Pick the next token from one row of logits ([vocab])."""
    [token] = sample_rows(logits[None], [params], [step])
    if isinstance(token, str):
        raise SamplingError(token)
    return token


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], steps: list[int]) -> list[int | str]:
    """Each row's token, or why the row has none (its logits have no finite value)."""
    logits = logits.float()
    out: list[int | str] = [0] * len(params)
    finite = torch.isfinite(logits.sum(dim=-1)).tolist()  # NaN and inf carry through a sum: one pass
    broken = [i for i, ok in enumerate(finite) if not ok]
    if broken:  # rare: sanitize those rows alone
        logits = logits.clone()
        for i in broken:
            row = _sanitized(logits[i])
            if row is None:
                out[i] = "the model produced no finite logit"
            else:
                logits[i] = row
    live = [i for i in range(len(params)) if not isinstance(out[i], str)]
    greedy = [i for i in live if is_greedy(params[i])]
    if len(greedy) == len(params):  # the common case: one argmax, no copy of the rows
        return torch.argmax(logits, dim=-1).tolist()
    if greedy:
        for i, token in zip(greedy, torch.argmax(logits[greedy], dim=-1).tolist()):
            out[i] = token
    drawn = [i for i in live if not is_greedy(params[i])]
    if drawn:
        for i, token in zip(drawn, _draw(logits[drawn], [params[i] for i in drawn], [steps[i] for i in drawn])):
            out[i] = token
    return out


def _draw(logits: torch.Tensor, params: list[SamplingParams], steps: list[int]) -> list[int]:
    """Sampled rows: temperature, top-k, top-p, then one uniform each against the kept mass."""
    vocab = logits.shape[1]
    scaled = logits / torch.tensor([p.temperature for p in params])[:, None]
    uniform = _uniforms(params, steps)
    tokens = [0] * len(params)
    whole = [i for i, p in enumerate(params) if p.top_p >= 1.0 and not 0 < p.top_k < vocab]
    if whole:  # no cut: the row's distribution as it is, in vocabulary order
        probs = torch.softmax(scaled[whole], dim=-1)
        for i, token in zip(whole, _pick(probs, uniform[whole]).tolist()):
            tokens[i] = token
    uncut = set(whole)
    cut = [i for i in range(len(params)) if i not in uncut]
    if cut:
        top_k = torch.tensor([params[i].top_k if 0 < params[i].top_k < vocab else vocab for i in cut])[:, None]
        top_p = torch.tensor([params[i].top_p for i in cut])[:, None]
        rows, uniform = scaled[cut], uniform[cut]
        width = min(vocab, max([CANDIDATES] + [k for k in top_k[:, 0].tolist() if k < vocab]))
        full = torch.softmax(rows, dim=-1)
        order = torch.topk(rows, width, dim=-1).indices  # sorted, descending
        probs = full.gather(1, order)
        # the top-p cut is exact only where the candidates hold the row's top-p mass (or its top-k):
        # the rows where they do not (flat ones) are sorted whole, those rows alone (a sort of the
        # vocabulary costs 1.8 ms a row here: the whole batch's, 118 ms at 64 rows)
        flat = ((probs.sum(dim=-1, keepdim=True) < top_p) & (top_k > width))[:, 0] if width < vocab else None
        if flat is None or not bool(flat.any()):
            picked = _nucleus(order, probs, top_k, top_p, uniform)
        else:
            picked, peaked = torch.empty(len(cut), dtype=torch.long), ~flat
            if bool(peaked.any()):
                picked[peaked] = _nucleus(order[peaked], probs[peaked], top_k[peaked], top_p[peaked],
                                          uniform[peaked])
            whole_order = torch.sort(rows[flat], dim=-1, descending=True).indices
            picked[flat] = _nucleus(whole_order, full[flat].gather(1, whole_order), top_k[flat], top_p[flat],
                                    uniform[flat])
        for i, token in zip(cut, picked.tolist()):
            tokens[i] = token
    return tokens


def _nucleus(order: torch.Tensor, probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
             uniform: torch.Tensor) -> torch.Tensor:
    """Per row, the token drawn among its top-k and top-p: `order` its token ids by probability,
    descending, `probs` their probabilities (a row's leading part, holding its cut)."""
    keep = torch.arange(order.shape[1])[None, :] < top_k
    keep &= torch.cumsum(probs, dim=-1) - probs < top_p
    keep[:, 0] = True  # the top token always stays (a top_p below float32's smallest value would drop it)
    return order.gather(1, _pick(probs * keep, uniform)[:, None])[:, 0]


def _uniforms(params: list[SamplingParams], steps: list[int]) -> torch.Tensor:
    """One uniform in [0, 1) per row: a seeded row's from its (seed, step) generator."""
    uniform = torch.rand(len(params))
    for i, p in enumerate(params):
        if p.seed is not None:
            uniform[i] = torch.rand(1, generator=step_generator(p.seed, steps[i]))
    return uniform


def _pick(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose cumulative weight passes uniform * the row's total: an index
    of positive weight (the cumulative sum rises there)."""
    cdf = torch.cumsum(weights, dim=-1)
    return torch.searchsorted(cdf, uniform[:, None] * cdf[:, -1:], right=True)[:, 0].clamp_(max=weights.shape[1] - 1)


def _sanitized(logits: torch.Tensor) -> torch.Tensor | None:
    """A float32 row with NaN -> -inf and, if any +inf, those alone kept (as 0, the rest -inf);
    None when no finite value is left."""
    logits = torch.nan_to_num(logits, nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    top = torch.isposinf(logits)
    if bool(top.any()):
        return torch.zeros_like(logits).masked_fill(~top, float("-inf"))
    if not bool(torch.isfinite(logits).any()):
        return None
    return logits
