"""The conductor's bookkeeping: live instances and the load of dispatched requests."""

from __future__ import annotations

from schemas.workers import WorkerInfo
from services.conductor.inflight import InFlight, InFlightTable
from services.conductor.registry import Registry


def make_request(rid, prefill="p0", decode="d0", at=0.0, work=1.0, ttft=1.0, tokens=100, pull=("", 0)):
    return InFlight(rid, prefill, decode, "reply", tokens, at, predicted_prefill_s=work, predicted_ttft_s=ttft,
                    pull_source=pull[0], pull_bytes=pull[1])


def test_registry_forgets_silent_and_leaving_instances():
    registry = Registry(timeout_s=3.0)
    assert registry.update(WorkerInfo("p0", "prefill", "n0"), now=0.0) is True
    assert registry.update(WorkerInfo("d0", "decode", "n1"), now=0.0) is True
    assert registry.update(WorkerInfo("p0", "prefill", "n0"), now=2.0) is False
    assert [w.instance_id for w in registry.expire(now=4.0)] == ["d0"]
    registry.update(WorkerInfo("p0", "prefill", "n0", leaving=True), now=4.5)
    assert registry.of_role("prefill") == []


def test_prefill_queue_counts_what_is_left_of_the_running_request():
    table = InFlightTable(lease_s=100)
    table.add(make_request("a", at=0.0, work=2.0, ttft=2.0))
    table.add(make_request("b", at=0.5, work=1.0, ttft=2.5))
    assert table.prefill_queue_s("p0", now=1.5) == 1.5  # 0.5 s left of a, all of b
    table.mark_prefilled("a", now=2.0)
    assert table.prefill_queue_s("p0", now=2.0) == 1.0
    assert table.decode_batch("d0") == (1, 100)


def test_decode_load_lists_who_decodes_and_who_will_join():
    table = InFlightTable(lease_s=100)
    table.add(make_request("a", at=0.0, ttft=1.0, tokens=10))
    table.add(make_request("b", at=0.0, ttft=3.0, tokens=20))
    table.mark_prefilled("a", now=1.2)
    load = table.decode_load("d0")
    assert (load.decoding_starts, load.decoding_context) == ((1.2,), (10,))
    assert (load.prefill_finishes, load.prefill_context) == ((3.0,), (20,))


def test_lost_instance_fails_only_the_requests_that_need_it():
    table = InFlightTable(lease_s=100)
    table.add(make_request("in-prefill", prefill="p0", decode="d0"))
    table.add(make_request("decoding", prefill="p0", decode="d1"))
    table.mark_prefilled("decoding", now=1.0)
    assert [r.request_id for r in table.lost_with("p0")] == ["in-prefill"]
    assert [r.request_id for r in table.lost_with("d1")] == ["decoding"]
    assert table.requests == {}


def test_pull_bytes_count_as_sender_congestion_until_prefilled():
    table = InFlightTable(lease_s=100)
    table.add(make_request("a", pull=("n3", 1000)))
    table.add(make_request("b", pull=("n3", 500)))
    assert table.sender_queued_bytes() == {"n3": 1500}
    table.mark_prefilled("a", now=1.0)
    assert table.sender_queued_bytes() == {"n3": 500}


def test_leases_release_load_whose_end_was_lost():
    table = InFlightTable(lease_s=10)
    table.add(make_request("old", at=0.0))
    table.add(make_request("new", at=5.0))
    assert [r.request_id for r in table.expire(now=12.0)] == ["old"]
    assert list(table.requests) == ["new"]


def test_draining_instances_get_no_new_work_and_an_outage_forgives_silence():
    registry = Registry(timeout_s=3.0)
    registry.update(WorkerInfo("d0", "decode", "n0"), now=0.0)
    registry.update(WorkerInfo("d1", "decode", "n1", draining=True), now=0.0)
    assert [w.instance_id for w in registry.of_role("decode")] == ["d0"]
    registry.refresh(now=10.0)  # the conductor's own connection was down until now
    assert registry.expire(now=12.0) == []
    assert [w.instance_id for w in registry.expire(now=13.5)] == ["d0", "d1"]


def test_a_cancelled_attempt_ends_only_itself_and_older_ones():
    table = InFlightTable(lease_s=100)
    resumed = make_request("r")
    resumed.attempt = 2
    table.add(resumed)
    assert table.finish("r", up_to_attempt=1) is None  # a late cancel of an abandoned attempt
    assert "r" in table.requests
    table.mark_prefilled("r", now=1.0, attempt=1)  # an old attempt's prefill says nothing
    assert table.requests["r"].phase == "prefill"
    table.mark_prefilled("r", now=1.0, attempt=2)
    assert table.requests["r"].phase == "decode"
    assert table.finish("r", up_to_attempt=2) is resumed and table.requests == {}
