"""The conductor's routing policy on hand-built snapshots, with exact expected choices.

Numbers are chosen so each term is easy to check by hand:
  prefill: 1 ms per computed token (no fixed cost)   -> 10 ms per recomputed block
  KV:      10 tokens/block * 100 B/token = 1000 B/block over a 1e6 B/s link -> 1 ms per block
  decode:  step = 0.01 + 0.001*batch + 1e-5*context_tokens
"""

import orjson
import pytest

from common.decide.perf import DecodeModel, PrefillModel, Profile
from common.decide.policy import (
    ClusterSnapshot,
    DecodeCandidate,
    DecodeCost,
    Decision,
    NoInstances,
    PolicySettings,
    PrefillCandidate,
    PrefillCost,
    PullPlan,
    RequestInfo,
    decide,
)

PERF = Profile(PrefillModel((0.0, 0.001, 0.0, 0.0)), DecodeModel((0.01, 0.001, 1e-5)))


def make_settings(policy: str = "kvcache-centric", threshold: float = 1.25) -> PolicySettings:
    return PolicySettings(policy, threshold, link_bytes_s=1e6, block_tokens=10, kv_bytes_per_token=100)


def make_request(tokens: int = 100) -> RequestInfo:
    return RequestInfo("r1", tokens, tokens // 10)


def make_prefill(instance: str, node: str, queue_s: float = 0.0, prefix: int = 0) -> tuple[PrefillCandidate, int]:
    """A candidate and the leading blocks of the request held on its node."""
    return PrefillCandidate(instance, node, queue_s), prefix


def make_decode(instance: str = "d0", running: int = 0, context: int = 0, free: int | None = None) -> DecodeCandidate:
    return DecodeCandidate(instance, f"node-{instance}", running, context, free)


def make_snapshot(prefill, decode=None, holders=None, queued=None, draw: float = 0.0) -> ClusterSnapshot:
    """`holders` adds nodes that hold a prefix but run no prefill instance."""
    held = {c.node: prefix for c, prefix in prefill if prefix} | (holders or {})
    return ClusterSnapshot(0.0, tuple(c for c, _ in prefill), tuple(decode or [make_decode()]), held, queued or {}, draw)


def route(snapshot, policy="kvcache-centric", threshold=1.25, tokens=100) -> Decision:
    decision = decide(make_request(tokens), snapshot, make_settings(policy, threshold), PERF)
    assert isinstance(decision, Decision), decision
    return decision


def test_cache_aware_longer_local_prefix_wins_when_queues_equal():
    snap = make_snapshot([make_prefill("pA", "n1", prefix=2), make_prefill("pB", "n2", prefix=5)])
    d = route(snap, "cache-aware")
    assert d.prefill_id == "pB"
    assert d.prefix_blocks == 5 and d.pull is None
    assert d.ttft_s == pytest.approx(0.05)  # 50 tokens left to compute
    assert [c.ttft_s for c in d.prefill_costs] == pytest.approx([0.08, 0.05])


def test_cache_aware_never_transfers():
    snap = make_snapshot([make_prefill("pA", "n1", queue_s=1.0, prefix=8), make_prefill("pB", "n2")])
    d = route(snap, "cache-aware")
    assert d.prefill_id == "pB" and d.pull is None and d.transfer_s == 0.0
    assert d.ttft_s == pytest.approx(0.1)


def test_kvcache_centric_pulls_remote_prefix_to_idle_instance_over_long_queue():
    snap = make_snapshot([make_prefill("pA", "n1", queue_s=1.0, prefix=8), make_prefill("pB", "n2")])
    d = route(snap)
    assert d.prefill_id == "pB"
    assert d.pull == PullPlan("n1", first_block=0, num_blocks=8, nbytes=8000)
    assert d.prefix_blocks == 8 and d.best_len == 8 and d.best_holder == "n1"
    # 8 blocks over the link (8 ms) + 20 tokens computed (20 ms)
    assert (d.queue_s, d.transfer_s, d.prefill_s) == pytest.approx((0.0, 0.008, 0.02))
    assert d.ttft_s == pytest.approx(0.028)
    a, b = d.prefill_costs
    assert (a.instance_id, a.pull_blocks, a.ttft_s) == ("pA", 0, pytest.approx(1.02))
    assert (b.local_blocks, b.prefix_blocks, b.pull_blocks) == (0, 8, 8)
    assert "pulls 8 blocks from n1" in d.reason


def test_recompute_under_threshold_does_not_pull():
    # best_len 9 (on n9, no prefill there) is not > 8 * 1.25: pA recomputes the 9th block.
    snap = make_snapshot([make_prefill("pA", "n1", prefix=8)], holders={"n9": 9, "n1": 8})
    d = route(snap)
    assert d.prefill_id == "pA" and d.pull is None
    assert d.prefix_blocks == 8 and d.best_len == 9 and d.best_holder == "n9"
    assert d.ttft_s == pytest.approx(0.02)
    assert "recomputes 1 blocks" in d.reason


def test_threshold_one_pulls_the_same_gap():
    snap = make_snapshot([make_prefill("pA", "n1", prefix=8)], holders={"n9": 9, "n1": 8})
    d = route(snap, threshold=1.0)
    assert d.pull == PullPlan("n9", first_block=8, num_blocks=1, nbytes=1000)
    assert d.ttft_s == pytest.approx(0.001 + 0.01)


def test_least_congested_replica_is_the_source():
    snap = make_snapshot(
        [make_prefill("pA", "n1", queue_s=1.0, prefix=8), make_prefill("pB", "n2", queue_s=1.0, prefix=8),
         make_prefill("pC", "n4")],
        holders={"n1": 8, "n2": 8, "n3": 5},
        queued={"n1": 50_000, "n2": 2_000},
    )
    d = route(snap)
    assert d.prefill_id == "pC" and d.best_holder == "n2"
    assert d.pull == PullPlan("n2", 0, 8, 8000)
    assert d.transfer_s == pytest.approx((2_000 + 8_000) / 1e6)  # queued bytes slow the sender


def test_replica_tie_broken_by_node_name():
    snap = make_snapshot([make_prefill("pC", "n4")], holders={"n7": 8, "n2": 8}, queued={"n7": 0, "n2": 0})
    assert route(snap).pull.source_node == "n2"


def test_congested_holder_makes_recompute_instance_win():
    # pB would pull 8 blocks but 1 MB is queued at n1 (1 s); pA holds 8 locally behind a 0.5 s queue.
    snap = make_snapshot([make_prefill("pA", "n1", queue_s=0.5, prefix=8), make_prefill("pB", "n2")],
                         queued={"n1": 1_000_000})
    d = route(snap)
    assert d.prefill_id == "pA" and d.pull is None and d.ttft_s == pytest.approx(0.52)


def test_ttft_tie_broken_by_instance_id():
    snap = make_snapshot([make_prefill("p2", "n2"), make_prefill("p1", "n1")])
    assert route(snap).prefill_id == "p1"


def test_decode_lowest_predicted_tbt():
    decode = [make_decode("d1", 4, 4000), make_decode("d2", 1, 5000), make_decode("d3", 2, 1000)]
    d = route(make_snapshot([make_prefill("p", "n")], decode))
    assert d.decode_id == "d3"
    # with the 100-token request added: 0.01 + 0.001*(b+1) + 1e-5*(c+100)
    assert [c.tbt_s for c in d.decode_costs] == pytest.approx([0.056, 0.063, 0.024])
    assert d.tbt_s == pytest.approx(0.024)


def test_decode_without_kv_room_is_skipped():
    decode = [make_decode("d1", 4, 4000), make_decode("d3", 2, 1000, free=50)]
    d = route(make_snapshot([make_prefill("p", "n")], decode))
    assert d.decode_id == "d1"
    assert [c.fits for c in d.decode_costs] == [True, False]


@pytest.mark.parametrize("draw, prefill_id, decode_id", [(0.0, "p0", "d0"), (0.3, "p1", "d0"), (0.9, "p3", "d1")])
def test_random_policy_uses_the_draw(draw, prefill_id, decode_id):
    # floor(draw*4) picks the prefill; frac(draw*4)*2 picks the decode; snapshot order is irrelevant
    prefill = [make_prefill(f"p{i}", f"n{i}", prefix=9 if i == 2 else 0) for i in (3, 1, 2, 0)]
    snap = make_snapshot(prefill, [make_decode("d1"), make_decode("d0")], draw=draw)
    d = route(snap, "random")
    assert (d.prefill_id, d.decode_id) == (prefill_id, decode_id)
    assert d.pull is None


def test_load_balancing_takes_least_queue_despite_cache():
    snap = make_snapshot([make_prefill("pA", "n1", queue_s=0.2, prefix=9), make_prefill("pB", "n2", queue_s=0.1)])
    d = route(snap, "load-balancing")
    assert d.prefill_id == "pB" and d.pull is None
    assert d.ttft_s == pytest.approx(0.1 + 0.1)


def test_whole_prompt_cached_still_computes_last_token():
    snap = make_snapshot([make_prefill("pA", "n1", prefix=10)])
    d = route(snap)
    assert d.prefix_blocks == 10 and d.prefill_s == pytest.approx(0.001)


def test_no_instances_is_a_result_not_an_exception():
    req, settings = make_request(), make_settings()
    assert decide(req, make_snapshot([]), settings, PERF) == NoInstances("r1", "no prefill instance", role="prefill")
    no_room = make_snapshot([make_prefill("p", "n")], [make_decode("d", free=10)])
    # instances exist but their KV room is taken: an overload (429), not an outage (503)
    assert decide(req, no_room, settings, PERF) == NoInstances("r1", "no decode instance has KV room for the prompt",
                                                                overloaded=True)
    no_decode = ClusterSnapshot(0.0, (PrefillCandidate("p", "n", 0.0),), ())
    assert decide(req, no_decode, settings, PERF) == NoInstances("r1", "no decode instance", overloaded=False,
                                                                role="decode")


def test_decision_event_is_json_with_every_candidate():
    snap = make_snapshot([make_prefill("pA", "n1", queue_s=1.0, prefix=8), make_prefill("pB", "n2")])
    event = orjson.loads(orjson.dumps(route(snap).to_event()))
    assert event["prefill_id"] == "pB" and event["pull"]["source_node"] == "n1"
    assert [c["instance_id"] for c in event["prefill_costs"]] == ["pA", "pB"]
    assert set(event["prefill_costs"][0]) == {"instance_id", "node", "queue_s", "local_blocks", "prefix_blocks",
                                               "pull_blocks", "prefill_s", "transfer_s", "ttft_s"}
    assert event["reason"]
    decision = route(snap)  # every cost as its _asdict() gives it, fields in order
    assert decision.to_event()["prefill_costs"] == [c._asdict() for c in decision.prefill_costs]
    assert decision.to_event()["decode_costs"] == [c._asdict() for c in decision.decode_costs]
    assert [list(c) for c in decision.to_event()["decode_costs"]] == [list(DecodeCost._fields)] * len(decision.decode_costs)
    assert [list(c) for c in decision.to_event()["prefill_costs"]] == [list(PrefillCost._fields)] * 2


@pytest.mark.parametrize("kwargs", [{"policy": "round-robin"}, {"kvcache_balancing_threshold": 0.9},
                                    {"link_bytes_s": 0}, {"block_tokens": 0}])
def test_settings_are_validated(kwargs):
    with pytest.raises(ValueError):
        PolicySettings(**kwargs)


def test_random_draw_is_validated():
    with pytest.raises(ValueError):
        make_snapshot([], draw=1.0)


# --- colocate (coupled instances): the decode instance is the one on the prefill instance's node


def make_colocated():
    """Two coupled instances c0 and c1: one prefill and one decode candidate on each node."""
    prefill = [make_prefill("c0-prefill", "node-c0", queue_s=0.5), make_prefill("c1-prefill", "node-c1")]
    decode = [DecodeCandidate("c0-decode", "node-c0", 0, 0), DecodeCandidate("c1-decode", "node-c1", 8, 8000)]
    return prefill, decode


def route_colocated(snapshot, policy="kvcache-centric") -> Decision:
    settings = PolicySettings(policy, 1.25, link_bytes_s=1e6, block_tokens=10, kv_bytes_per_token=100, colocate=True)
    decision = decide(make_request(), snapshot, settings, PERF)
    assert isinstance(decision, Decision), decision
    return decision


def test_colocate_takes_the_decode_on_the_chosen_prefill_node_over_a_lower_tbt():
    prefill, decode = make_colocated()
    d = route_colocated(make_snapshot(prefill, decode))
    # c1 has no queue (ttft 0.1 vs 0.6); its decode is busier (tbt 0.100 vs 0.012) but it is the one there
    assert (d.prefill_id, d.decode_id) == ("c1-prefill", "c1-decode")
    assert d.decode_node == d.prefill_node == "node-c1"
    assert d.tbt_s == pytest.approx(0.01 + 0.001 * 9 + 1e-5 * 8100)
    assert d.reason.endswith("decode c1-decode: colocated on node-c1, tbt 0.1000s")
    assert route(make_snapshot(prefill, decode)).decode_id == "c0-decode"  # without colocate: lowest tbt


def test_colocate_skips_a_node_whose_decode_has_no_kv_room():
    prefill, _ = make_colocated()
    decode = [DecodeCandidate("c0-decode", "node-c0", 0, 0), DecodeCandidate("c1-decode", "node-c1", 0, 0, 50)]
    d = route_colocated(make_snapshot(prefill, decode))
    assert (d.prefill_id, d.decode_id) == ("c0-prefill", "c0-decode")
    assert [c.instance_id for c in d.prefill_costs] == ["c0-prefill", "c1-prefill"]  # every candidate still priced
    assert d.ttft_s == pytest.approx(0.6)


def test_colocate_pull_goes_to_the_colocated_pair():
    prefill = [make_prefill("c0-prefill", "node-c0", queue_s=1.0, prefix=8), make_prefill("c1-prefill", "node-c1")]
    _, decode = make_colocated()
    d = route_colocated(make_snapshot(prefill, decode))
    assert (d.prefill_id, d.decode_id) == ("c1-prefill", "c1-decode")
    assert d.pull == PullPlan("node-c0", first_block=0, num_blocks=8, nbytes=8000)


@pytest.mark.parametrize("draw, instance", [(0.2, "c0"), (0.7, "c1")])
def test_colocate_random_keeps_the_pair_on_one_node(draw, instance):
    prefill, decode = make_colocated()
    d = route_colocated(make_snapshot(prefill, decode, draw=draw), "random")
    assert (d.prefill_id, d.decode_id) == (f"{instance}-prefill", f"{instance}-decode")


def test_colocate_without_a_shared_node_is_no_instances():
    req = make_request()
    settings = PolicySettings(block_tokens=10, kv_bytes_per_token=100, colocate=True)
    snapshot = make_snapshot([make_prefill("p0", "node-p0")], [make_decode("d0")])
    assert decide(req, snapshot, settings, PERF) == NoInstances(
        "r1", "no prefill instance shares a node with a decode instance with KV room")


def test_best_holder_is_least_queued_then_name_among_longest():
    import random

    from common.decide.policy import best_prefix

    rng = random.Random(5)
    for _ in range(500):
        nodes = [f"n{i}" for i in rng.sample(range(20), rng.randrange(0, 8))]
        held = {n: rng.randrange(0, 4) for n in nodes}
        queued = {n: rng.choice([0, 0, 5, 7]) for n in nodes if rng.random() < 0.7}
        snap = ClusterSnapshot(0.0, (), (), held, queued)
        best = max(held.values(), default=0)
        expected = (0, None) if best <= 0 else (best, min((n for n in held if held[n] == best), key=lambda n: (queued.get(n, 0), n)))
        assert best_prefix(snap) == expected


def test_decode_instances_that_tie_on_tbt_share_the_load():
    flat = Profile(PrefillModel((0.01, 0.001, 0.0, 0.0)), DecodeModel((0.02, 0.0, 0.0)))  # batch costs nothing
    decode = (make_decode("d0", running=5), make_decode("d1", running=2), make_decode("d2", running=3))
    decision = decide(make_request(), make_snapshot([make_prefill("p0", "n0")], decode), make_settings(), flat)
    assert decision.decode_id == "d1"


def test_decode_tbts_within_the_tie_count_as_equal_and_the_emptier_instance_wins():
    from common.decide.policy import DecodeCost, lightest

    a = DecodeCost("d0", "n0", 5, 500, 0.050, True)
    b = DecodeCost("d1", "n1", 2, 200, 0.053, True)  # 6% slower by its learned factor: a tie
    c = DecodeCost("d2", "n2", 0, 0, 0.080, True)  # clearly slower
    assert lightest([a, b, c]).instance_id == "d1"
    assert lightest([a, c]).instance_id == "d0"
    # far below a TBT SLO of 1 s, 30 ms of learned difference is noise: the emptiest wins
    assert lightest([a, c], tie_s=0.1 * 1.0).instance_id == "d2"
    assert lightest([a, c], tie_s=0.1 * 0.2).instance_id == "d0"  # a tight SLO feels it


def test_the_tbt_slo_sets_the_decode_tie_band_of_a_decision():
    flat = Profile(PrefillModel((0.01, 0.001, 0.0, 0.0)), DecodeModel((0.02, 0.0, 0.0)))
    decode = (DecodeCandidate("d0", "n0", 1, 100, None, step_factor=1.5),  # measured 1.5x slower
              DecodeCandidate("d1", "n1", 4, 400, None, step_factor=1.0))
    loose = PolicySettings(block_tokens=10, kv_bytes_per_token=100, tbt_slo_s=1.0)
    tight = PolicySettings(block_tokens=10, kv_bytes_per_token=100, tbt_slo_s=0.05)
    snapshot = make_snapshot([make_prefill("p0", "n0")], decode)
    assert decide(make_request(), snapshot, loose, flat).decode_id == "d0"  # 10 ms apart, far under 1 s: emptier
    assert decide(make_request(), snapshot, tight, flat).decode_id == "d1"
