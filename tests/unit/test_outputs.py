"""How many tokens a request will still generate (common/decide/outputs.py)."""

import pytest

from common.decide.outputs import OutputLengths


def test_without_completions_the_cap_is_assumed():
    assert OutputLengths().remaining(10, 100) == 90


def test_a_hint_is_taken_within_the_cap():
    lengths = OutputLengths()
    assert lengths.remaining(1, 100, hint=20) == 19
    assert lengths.remaining(1, 10, hint=50) == 9  # never past max_tokens
    assert lengths.remaining(30, 100, hint=20) == 1  # past its hint: at least one more


def test_learned_lengths_give_the_expected_rest_given_what_was_generated():
    lengths = OutputLengths()
    for n in (10, 20, 30, 400):
        lengths.observe(n)
    # of those longer than 5: 10, 20, 30 and 400 capped at 100 -> mean 40, minus the 5 generated
    assert lengths.remaining(5, 100) == pytest.approx(35.0)
    # of those longer than 25: 30 and 100 (capped) -> mean 65, minus 25
    assert lengths.remaining(25, 100) == pytest.approx(40.0)
    # longer than every completion seen: only the cap is known
    assert lengths.remaining(500, 1000) == 500


def test_the_estimate_shrinks_as_a_request_generates_and_old_lengths_are_forgotten():
    lengths = OutputLengths(keep=3)
    for n in (50, 50, 50):
        lengths.observe(n)
    assert lengths.remaining(10, 100) > lengths.remaining(40, 100)
    for n in (5, 5, 5):  # the three 50s are forgotten
        lengths.observe(n)
    assert lengths.samples == 3 and lengths.remaining(1, 100) == pytest.approx(4.0)
