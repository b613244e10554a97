"""One request's stages beside their predictions, from its events (tools/moonbus/observe/timeline.py)."""

import pytest

from tools.moonbus.observe import timeline


def ev(kind, ts, **data):
    return {"kind": kind, "ts": ts, "data": data}


def test_every_stage_of_a_request_with_its_prediction():
    events = [
        ev("received", 100.0),
        ev("routed", 100.01, attempt=0, queue_s=0.5, prefill_s=1.0, transfer_s=0.2, ttft_s=1.7, predicted_tbt_s=0.05),
        ev("prefilled", 102.0, attempt=0, queued_s=0.8, seconds=1.1, cached_tokens=16, prompt_tokens=100),
        ev("first_token", 102.05, attempt=0, ttft_s=2.05, predicted_ttft_s=1.7),
        ev("kv_transferred", 102.06, attempt=0, tail_s=0.004, bytes=4096, src_node="p", dest_node="d", transport="tcp"),
        ev("decode_joined", 102.1, attempt=0, waited_s=0.03, batch=3),
        ev("decode_finished", 103.0, attempt=0, tokens=11, seconds=0.6, finish_reason="length"),
        ev("completed", 103.01),
    ]
    rows = {s.name: s for s in timeline.stages(events)}
    assert rows["route"].actual_s == pytest.approx(0.01)
    assert (rows["queue"].actual_s, rows["queue"].predicted_s) == (0.8, 0.5)
    assert rows["prefill"].predicted_s == pytest.approx(1.2) and rows["prefill"].error == pytest.approx(1.1 / 1.2)
    assert rows["ttft"].error == pytest.approx(2.05 / 1.7)
    assert rows["decode per token"].actual_s == pytest.approx(0.06) and rows["decode per token"].predicted_s == 0.05
    assert [s.name for s in timeline.stages(events)] == ["route", "queue", "prefill", "handoff tail", "decode wait",
                                                         "ttft", "decode per token"]
    assert "ttft" in timeline.format_stages(timeline.stages(events))


def test_a_resumed_request_shows_each_attempt():
    events = [ev("received", 0.0), ev("routed", 0.1, attempt=0, ttft_s=1.0), ev("first_token", 1.0, attempt=0, ttft_s=1.0),
              ev("routed", 5.0, attempt=1, ttft_s=0.5), ev("prefilled", 5.6, attempt=1, seconds=0.4, queued_s=0.1)]
    assert [(s.attempt, s.name) for s in timeline.stages(events)] == [(0, "route"), (0, "ttft"), (1, "queue"), (1, "prefill")]
