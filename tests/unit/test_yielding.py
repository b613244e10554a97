"""When a decode instance leaves the cores to prefill requests waiting beside it (common/decide/yielding.py)."""

import pytest

from common.decide.yielding import YIELD_KV_SHARE, most_urgent, yield_due, yield_pause


def test_while_a_prefill_queue_calls_for_it_decode_steps_once_per_its_share_of_the_tbt_slo():
    # a step began at t=10.0; with a TBT SLO of 1 s and a share of 0.25 the next may begin at 10.25
    assert yield_pause(10.05, 10.0, True, 1.0, 0.25) == pytest.approx(0.20)
    assert yield_pause(10.2, 10.0, True, 1.0, 0.25) == pytest.approx(0.05)
    assert yield_pause(10.3, 10.0, True, 1.0, 0.25) == 0.0  # a step that took longer goes on at once


def test_with_no_call_no_first_step_or_a_share_of_0_decode_never_waits():
    assert yield_pause(10.05, 10.0, False, 1.0, 0.25) == 0.0
    assert yield_pause(10.05, None, True, 1.0, 0.25) == 0.0
    assert yield_pause(10.05, 10.0, True, 1.0, 0.0) == 0.0


def test_the_pause_scales_with_the_tbt_slo():
    assert yield_pause(0.0, 0.0, True, 0.2, 0.5) == pytest.approx(0.1)
    assert yield_pause(0.0, 0.0, True, 4.0, 0.5) == pytest.approx(2.0)


def test_a_batch_holding_more_than_its_share_of_the_kv_room_does_not_yield():
    """A yield holds every request's KV longer: past YIELD_KV_SHARE of the room that would turn
    arrivals away and read as decode demand to the planner."""
    assert yield_pause(10.05, 10.0, True, 1.0, 0.25, kv_held=YIELD_KV_SHARE) == pytest.approx(0.20)
    assert yield_pause(10.05, 10.0, True, 1.0, 0.25, kv_held=YIELD_KV_SHARE + 0.01) == 0.0


def test_the_most_urgent_waiting_request_is_the_one_whose_deadline_comes_first():
    assert most_urgent([(100.0, 130.0), (90.0, 120.0), (95.0, 125.0)]) == (90.0, 120.0)
    assert most_urgent([(80.0, 0.0), (95.0, 125.0)]) == (95.0, 125.0)  # no deadline: admission off, a pipeline stage
    assert most_urgent([(80.0, 0.0)]) == (0.0, 0.0)
    assert most_urgent([]) == (0.0, 0.0)


def test_decode_yields_once_a_waiting_request_has_used_its_share_of_the_ttft_budget():
    # arrived at 100 with a 30 s TTFT SLO: half its budget is used at 115
    assert yield_due([(100.0, 130.0)], 0.5) == pytest.approx(115.0)
    assert yield_due([(100.0, 130.0)], 0.0) == pytest.approx(100.0)  # 0: as soon as it waits
    assert yield_due([(100.0, 130.0)], 1.0) == pytest.approx(130.0)
    # two prefill queues on the machine: the first to call for it
    assert yield_due([(100.0, 130.0), (104.0, 110.0)], 0.5) == pytest.approx(107.0)


def test_queues_with_no_deadline_never_call_for_a_yield():
    assert yield_due([], 0.5) is None
    assert yield_due([(0.0, 0.0)], 0.0) is None
    assert yield_due([(0.0, 0.0), (100.0, 130.0)], 0.5) == pytest.approx(115.0)
