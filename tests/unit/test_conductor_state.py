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
