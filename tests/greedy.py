"""Greedy output against transformers' own, as every test compares them.

The engine's decode attention sums in its own order (common/engine/kernels), so its logits
agree with transformers' to rounding, not bit for bit: in float32 to ~1e-4, in bfloat16 by a
bfloat16 step now and then (torch's attention rounds its weights to bfloat16 before they multiply
V, so a last-bit difference in a score can move a weight by a step; tiny-random's random weights
amplify that through the layers: up to 0.8 over 20 steps of a ragged batch, seen on an AVX-512 BF16
CPU and with torch held to AVX2). Two greedy sequences are therefore the same up to a near-tie:
equal until the first step where they differ, and there the reference's best two logits must
be within the dtype's tolerance of each other (after it the sequences may legitimately part).

A sequence that parts where the reference was sure (a margin above the tolerance) is a bug.
"""

from __future__ import annotations

from dataclasses import dataclass

# the logits' drift allowed against transformers', by dtype (tiny-random's logits reach ~16)
LOGIT_TOL = {"float32": 1e-3, "bfloat16": 1.0}


@dataclass(frozen=True)
class Greedy:
    """A reference greedy decoding: its tokens and, per step, the gap between its best two logits."""

    tokens: list[int]
    margins: list[float]


def reference(model, prompt_ids: list[int], max_tokens: int, ignore_eos: bool = False) -> Greedy:
    """transformers' own greedy decoding, one step at a time (the forward generate() runs), with
    each step's margin; stops at EOS unless `ignore_eos`."""
    import torch

    from common.engine import reference as single

    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos]) if eos is not None and not ignore_eos else set()
    with torch.inference_mode():
        cache, logits = single.prefill(model, prompt_ids)
        tokens, margins = [], []
        while len(tokens) < max_tokens:
            top = torch.topk(logits.float(), 2)
            tokens.append(int(top.indices[0]))
            margins.append(float(top.values[0] - top.values[1]))
            if tokens[-1] in eos or len(tokens) == max_tokens:
                break
            logits = single.decode_step(model, tokens[-1], cache)
    return Greedy(tokens, margins)


def mismatch(got: list[int], want: Greedy, tol: float) -> str:
    """'' when `got` is `want` up to a near-tie, else why not."""
    for step, (a, b, margin) in enumerate(zip(got, want.tokens, want.margins)):
        if a != b:
            if margin <= tol:
                return ""
            return (f"step {step} gave token {a} where the reference gave {b}, whose lead over the next was "
                    f"{margin:.4f} (a near-tie is <= {tol})")
    if len(got) != len(want.tokens):
        return f"{len(got)} tokens where the reference has {len(want.tokens)}"
    return ""


def assert_matches(got: list[int], want: Greedy, dtype: str, what: str = "") -> None:
    why = mismatch(got, want, LOGIT_TOL[dtype])
    assert not why, f"{what}: {why}\n  got  {got}\n  want {want.tokens}"
