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
