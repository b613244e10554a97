"""common.sampling never returns NaN-derived tokens and never raises on overflowing logits."""

import pytest
import torch

from common.sampling import SamplingError, sample
from schemas.route import SamplingParams


def test_temperature_near_zero_is_greedy():
    logits = torch.tensor([1.0, 3.0, 2.0])
    for t in (0.0, 1e-40, 1e-6):
        assert sample(logits, SamplingParams(temperature=t, seed=1), step=0) == 1


def test_overflowing_logits_pick_among_the_infinite_ones():
    logits = torch.tensor([float("inf"), 1.0, float("nan"), float("inf"), -float("inf")])
    seen = {sample(logits, SamplingParams(temperature=1.0, seed=s), step=0) for s in range(40)}
    assert seen == {0, 3}
    assert sample(logits, SamplingParams(temperature=0.0), step=0) in (0, 3)


def test_nan_logits_are_impossible_tokens():
    logits = torch.tensor([float("nan"), 0.5, float("nan"), 0.1])
    for s in range(20):
        assert sample(logits, SamplingParams(temperature=1.0, top_p=0.5, seed=s), step=s) == 1


def test_no_finite_logit_is_a_sampling_error():
    with pytest.raises(SamplingError):
        sample(torch.full((5,), float("nan")), SamplingParams(temperature=0.7, seed=3), step=0)


def test_large_finite_logits_at_tiny_temperature_stay_finite():
    logits = torch.tensor([3.0e4, 2.9e4, -1.0e4])
    assert sample(logits, SamplingParams(temperature=1.1e-4, seed=5), step=0) == 0


def test_a_vanishing_top_p_keeps_the_top_token():
    logits = torch.tensor([0.1, 2.0, 0.3])
    for top_p in (5e-324, 1e-97, 1e-46):
        assert sample(logits, SamplingParams(temperature=1.0, top_p=top_p, seed=1), step=0) == 1


# --- the vectorised pass over a batch's rows ---------------------------------------------------

from common.sampling import CANDIDATES, sample_rows  # noqa: E402


def make_logits(rows: int, vocab: int = 1000, seed: int = 0, spread: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * spread


def test_a_row_samples_the_same_token_in_any_batch():
    logits = make_logits(6)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=1),
              SamplingParams(temperature=1.0, top_p=0.9, seed=2), SamplingParams(temperature=0.7, top_k=5, seed=3),
              SamplingParams(temperature=1.2, top_p=0.5, top_k=40, seed=4), SamplingParams(temperature=0.5, seed=5)]
    together = sample_rows(logits, params, [3] * 6)
    alone = [sample(logits[i], p, step=3) for i, p in enumerate(params)]
    assert together == alone
    assert together[0] == int(torch.argmax(logits[0]))


def test_top_k_draws_only_among_the_k_most_likely():
    logits = make_logits(1)[0]
    allowed = set(torch.topk(logits, 5).indices.tolist())
    drawn = {sample(logits, SamplingParams(temperature=5.0, top_k=5, seed=s), step=0) for s in range(200)}
    assert drawn <= allowed and len(drawn) > 1


def test_top_p_keeps_the_smallest_set_that_holds_its_mass():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    drawn = {sample(logits, SamplingParams(temperature=1.0, top_p=0.8, seed=s), step=0) for s in range(300)}
    assert drawn == {0, 1}  # 0.5 + 0.3 reach 0.8: the rest are cut
    drawn = {sample(logits, SamplingParams(temperature=1.0, top_p=0.81, seed=s), step=0) for s in range(300)}
    assert drawn == {0, 1, 2}


def test_a_flat_row_past_the_candidates_is_cut_as_a_full_sort_would():
    """A distribution so flat that CANDIDATES tokens do not hold its top-p mass is sorted whole:
    its draws come from beyond the candidates, with the same frequencies as a full sort gives."""
    vocab = 4 * CANDIDATES
    logits = torch.zeros(vocab)
    logits[: CANDIDATES // 2] = 0.01  # a few slightly ahead; every token nearly equally likely
    drawn = [sample(logits, SamplingParams(temperature=1.0, top_p=0.95, seed=s), step=0) for s in range(400)]
    assert max(drawn) >= CANDIDATES  # the kept set reaches past the first CANDIDATES tokens
    assert len(set(drawn)) > CANDIDATES // 2


def test_a_flat_row_in_a_batch_of_peaked_ones_is_sorted_alone_and_every_row_draws_as_it_would_alone():
    """Only the flat row is sorted whole; the peaked rows keep their candidates' cut, and each
    row's token is the one it draws alone, wherever the flat row sits in the batch."""
    vocab = 4 * CANDIDATES
    flat = torch.zeros(vocab)
    flat[: CANDIDATES // 2] = 0.01
    peaked = make_logits(3, vocab=vocab) * 8.0
    for at in range(4):
        rows = list(peaked)
        rows.insert(at, flat)
        logits = torch.stack(rows)
        for seed in range(25):
            params = [SamplingParams(temperature=1.0, top_p=0.9 if i != at else 0.95, seed=seed * 10 + i)
                      for i in range(4)]
            together = sample_rows(logits, params, [2] * 4)
            assert together == [sample(logits[i], p, step=2) for i, p in enumerate(params)]
    drawn = [sample_rows(torch.stack([flat, peaked[0]]), [SamplingParams(top_p=0.95, seed=s), SamplingParams(top_p=0.9, seed=s)],
                         [0, 0])[0] for s in range(200)]
    assert max(drawn) >= CANDIDATES  # the flat row's kept set still reaches past the candidates


def test_seeded_draws_repeat_and_unseeded_ones_vary():
    logits = make_logits(1, spread=0.5)[0]
    seeded = SamplingParams(temperature=1.0, seed=11)
    assert len({sample(logits, seeded, step=4) for _ in range(5)}) == 1
    assert len({sample(logits, SamplingParams(temperature=1.0), step=4) for _ in range(40)}) > 1


def test_a_broken_row_fails_alone_in_a_batch():
    logits = make_logits(3)
    logits[1] = float("nan")
    out = sample_rows(logits, [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=1),
                               SamplingParams(temperature=0.9, seed=2)], [0, 0, 0])
    assert isinstance(out[1], str) and "no finite logit" in out[1]
    assert isinstance(out[0], int) and isinstance(out[2], int)
