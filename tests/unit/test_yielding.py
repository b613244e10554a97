"""When a decode instance leaves the cores to prefill requests waiting beside it (common/decide/yielding.py)."""

import pytest

from common.decide.yielding import YIELD_KV_SHARE, yield_pause


def test_while_prefill_requests_wait_decode_steps_once_per_its_share_of_the_tbt_slo():
    # a step began at t=10.0; with a TBT SLO of 1 s and a share of 0.25 the next may begin at 10.25
    assert yield_pause(10.05, 10.0, 2, 1.0, 0.25) == pytest.approx(0.20)
    assert yield_pause(10.2, 10.0, 1, 1.0, 0.25) == pytest.approx(0.05)
    assert yield_pause(10.3, 10.0, 1, 1.0, 0.25) == 0.0  # a step that took longer goes on at once


def test_with_no_prefill_queue_no_first_step_or_a_share_of_0_decode_never_waits():
    assert yield_pause(10.05, 10.0, 0, 1.0, 0.25) == 0.0
    assert yield_pause(10.05, None, 3, 1.0, 0.25) == 0.0
    assert yield_pause(10.05, 10.0, 3, 1.0, 0.0) == 0.0


def test_the_pause_scales_with_the_tbt_slo():
    assert yield_pause(0.0, 0.0, 1, 0.2, 0.5) == pytest.approx(0.1)
    assert yield_pause(0.0, 0.0, 1, 4.0, 0.5) == pytest.approx(2.0)


def test_a_batch_holding_more_than_its_share_of_the_kv_room_does_not_yield():
    """A yield holds every request's KV longer: past YIELD_KV_SHARE of the room that would turn
    arrivals away and read as decode demand to the planner."""
    assert yield_pause(10.05, 10.0, 2, 1.0, 0.25, kv_held=YIELD_KV_SHARE) == pytest.approx(0.20)
    assert yield_pause(10.05, 10.0, 2, 1.0, 0.25, kv_held=YIELD_KV_SHARE + 0.01) == 0.0
