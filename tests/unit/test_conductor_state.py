"""common.decide.cluster_state: the load every conductor (and the simulator) sees, from the instances'
reports plus its own dispatches that have not arrived yet."""

from __future__ import annotations

import pytest

from common.decide.cluster_state import RECOVERY_S, ClusterState, Refusal, Routed
from schemas.workers import Coming, DecodeReport, Joined, Layout, PrefillReport, WorkerInfo

LAYOUT = Layout("tiny-random", 16, 2048, "4x2x2x16 float32")


def prefill(iid="p0", node="n0", queue_s=0.0, coming=(), held=(), **kw) -> WorkerInfo:
    held = list(held) + [c.request_id for c in coming]
    return WorkerInfo(iid, "prefill", node, prefill=PrefillReport(queue_s, 0, 0, held, list(coming)), **kw)


def decode(iid="d0", node="n1", joined=(), kv_free=1000, **kw) -> WorkerInfo:
    joined = list(joined)
    return WorkerInfo(iid, "decode", node, decode=DecodeReport(len(joined), sum(j.tokens for j in joined), 0, kv_free,
                                                               0.01, joined), **kw)


def routed(rid, p="p0", d="d0", at=0.0, work=1.0, ttft=1.0, tokens=100, pull=("", 0), attempt=0) -> Routed:
    return Routed(rid, (p,) if isinstance(p, str) else p, d, "reply", tokens, at, work, ttft, pull[0], pull[1], attempt)


def cluster(now=0.0) -> ClusterState:
    state = ClusterState(timeout_s=3.0, lease_s=100.0)
    state.heard(prefill(), now)
    state.heard(decode(), now)
    return state


def test_instances_join_leave_expire_and_draining_ones_get_nothing_new():
    state = ClusterState(timeout_s=3.0, lease_s=100.0)
    assert state.heard(prefill(), 0.0) == "joined"
    assert state.heard(decode(), 0.0) == "joined"
    assert state.heard(prefill(), 2.0) is None
    assert [w.instance_id for w in state.expire(now=4.0)] == ["d0"]
    assert state.heard(decode("d1", draining=True), 4.0) == "joined"
    assert state.of_role("decode") == []
    state.refresh(now=10.0)  # our own broker connection was down until now
    assert state.expire(now=12.0) == []
    assert state.heard(prefill(leaving=True), 12.5) == "left"
    assert state.of_role("prefill") == []


def test_an_instance_that_disagrees_with_the_cluster_is_refused():
    state = ClusterState(3.0, 100.0, LAYOUT)
    ok = state.heard(prefill(layout=LAYOUT), 0.0)
    bad = state.heard(decode(layout=Layout("tiny-random", 32, 0, "4x2x2x16 float32")), 0.0)
    assert ok == "joined"
    assert isinstance(bad, Refusal) and bad.differences == ("block_tokens 32 (the cluster's is 16)",)
    assert state.get("d0") is None


def test_prefill_queue_is_the_report_aged_plus_our_requests_not_in_it_yet():
    state = cluster()
    state.heard(prefill(queue_s=2.0), now=10.0)
    assert state.prefill_queue_s("p0", now=10.5) == 1.5  # half a second of the reported work is done
    state.route(routed("a", at=10.5, work=0.7))
    assert state.prefill_queue_s("p0", now=10.5) == 2.2
    # p0 reports it (queued behind the rest): counted once, in the report
    state.heard(prefill(queue_s=2.2, coming=[Coming("a", "d0", 2.2, 100)]), now=10.5)
    assert state.prefill_queue_s("p0", now=10.5) == 2.2


def test_a_decode_instance_counts_what_is_coming_to_it_exactly_once():
    state = cluster()
    # x has generated 5 of at most 25 tokens; steps take 0.01 s (its report, no profile here)
    state.heard(decode(joined=[Joined("x", 2.0, 50, 5, 25)]), now=1.0)
    state.route(routed("a", at=1.0, ttft=3.0, tokens=100))  # on the bus
    [d] = state.decode_candidates(now=1.0)
    assert (d.num_running, d.context_tokens, d.kv_free_tokens) == (2, 150, 900)
    state.heard(prefill(coming=[Coming("a", "d0", 2.5, 100, 11)]), now=1.5)  # queued at p0, at most 11 tokens
    [d] = state.decode_candidates(now=1.5)
    assert (d.num_running, d.context_tokens) == (2, 150)
    load = state.decode_load("d0")
    # x leaves after its 20 tokens still to come; a joins when its prefill ends, leaves after 10 more
    assert (load.leaves, load.leave_context) == (pytest.approx((1.2,)), (50,))
    assert (load.joins, load.join_leaves, load.join_context) == ((4.0,), pytest.approx((4.1,)), (100,))
    state.prefilled("a", attempt=0)
    state.heard(prefill(), now=4.0)  # p0 handed it off: it is in transfer, ours, still counted
    assert state.decode_candidates(now=4.0)[0].num_running == 2
    state.heard(decode(joined=[Joined("x", 5.0, 50), Joined("a", 0.0, 100)]), now=4.1)  # d0 holds it
    [d] = state.decode_candidates(now=4.1)
    assert (d.num_running, d.context_tokens) == (2, 150)


def test_after_our_broker_came_back_the_loads_count_from_then():
    state = cluster()
    # x has generated 5 of at most 25 tokens; steps take 0.01 s: it leaves 0.2 s after its report
    state.heard(decode(joined=[Joined("x", 2.0, 50, 5, 25)]), now=1.0)
    assert state.decode_load("d0").leaves == pytest.approx((1.2,))
    state.refresh(now=10.0)  # our own broker connection was down until now: every report counts as new
    assert state.decode_load("d0").leaves == pytest.approx((10.2,))


def test_after_our_broker_came_back_what_is_coming_counts_from_then():
    state = cluster()
    state.heard(prefill(coming=[Coming("a", "d0", 0.5, 100)]), now=1.0)  # a's prefill ends 0.5 s after the report
    assert [c[0] for c in state.coming_to("d0")] == pytest.approx([1.5])
    state.refresh(now=10.0)
    assert [c[0] for c in state.coming_to("d0")] == pytest.approx([10.5])


def test_two_conductors_see_the_same_load_once_the_instance_reports():
    mine, theirs = cluster(), cluster()
    mine.route(routed("a", at=0.0, work=1.0, ttft=1.0))
    assert mine.prefill_queue_s("p0", 0.0) == 1.0 and theirs.prefill_queue_s("p0", 0.0) == 0.0
    report = prefill(queue_s=1.0, coming=[Coming("a", "d0", 1.0, 100)])
    for state in (mine, theirs):
        state.heard(report, now=0.1)
    assert mine.prefill_queue_s("p0", 0.6) == theirs.prefill_queue_s("p0", 0.6) == 0.5
    assert mine.decode_candidates(0.1) == theirs.decode_candidates(0.1)


def test_every_pipeline_stage_is_charged():
    state = cluster()
    state.heard(prefill("p1", "n2"), 0.0)
    state.route(routed("long", p=("p0", "p1"), work=2.0))
    assert state.prefill_queue_s("p0", 0.0) == state.prefill_queue_s("p1", 0.0) == 2.0


def test_a_lost_instance_hands_back_only_the_requests_that_need_it():
    state = cluster()
    state.route(routed("in-prefill", p="p0", d="d0"))
    state.route(routed("decoding", p="p0", d="d1"))
    state.prefilled("decoding", attempt=0)
    assert [r.request_id for r in state.lost_with("p0")] == ["in-prefill"]
    assert [r.request_id for r in state.lost_with("d1")] == ["decoding"]
    assert state.routed == {}


def test_pulls_count_as_sender_congestion_until_prefilled():
    state = cluster()
    state.route(routed("a", pull=("n3", 1000)))
    state.route(routed("b", pull=("n3", 500)))
    assert state.sender_queued_bytes() == {"n3": 1500}
    state.prefilled("a", attempt=0)
    assert state.sender_queued_bytes() == {"n3": 500}


def test_a_cancelled_attempt_ends_only_itself_and_older_ones():
    state = cluster()
    state.route(routed("r", attempt=2))
    assert state.end("r", up_to_attempt=1) is None  # a late cancel of an abandoned attempt
    state.prefilled("r", attempt=1)  # an old attempt's progress says nothing
    assert state.routed["r"].prefilled is False
    assert state.end("r", up_to_attempt=2).attempt == 2 and state.routed == {}


def test_leases_release_what_never_ended():
    state = cluster()
    state.route(routed("old", at=0.0))
    state.route(routed("new", at=50.0))
    assert [r.request_id for r in state.expire_leases(now=120.0)] == ["old"]
    assert list(state.routed) == ["new"]


def test_a_one_token_request_is_charged_to_prefill_only():
    state = cluster()
    state.route(Routed("one", ("p0",), "d0", "reply", 100, 0.0, 1.0, 1.0, joins_decode=False))
    assert state.decode_candidates(0.0)[0].num_running == 0
    assert state.prefill_queue_s("p0", 0.0) == 1.0
    state.heard(prefill(queue_s=1.0, held=["one"]), 0.0)  # held, not coming to decode
    assert state.prefill_queue_s("p0", 0.0) == 1.0 and state.decode_candidates(0.0)[0].num_running == 0


def test_workers_of_a_node_whose_messenger_was_lost_get_nothing_new_until_it_returns():
    state = ClusterState(timeout_s=3.0, lease_s=100.0)
    state.heard(decode("d0", node="n1"), 0.0)
    state.heard(decode("d1", node="n2"), 0.0)
    state.heard(WorkerInfo("m1", "messenger", "n1"), 0.0)
    state.heard(decode("d0", node="n1"), 4.0)  # d0 still heartbeats; its messenger does not
    state.heard(decode("d1", node="n2"), 4.0)
    assert [i.instance_id for i in state.expire(4.0)] == ["m1"]
    assert [d.instance_id for d in state.decode_candidates(4.0)] == ["d1"]
    state.heard(WorkerInfo("m1b", "messenger", "n1"), 5.0)  # restarted
    assert [d.instance_id for d in state.decode_candidates(5.0)] == ["d0", "d1"]


def test_a_retried_request_goes_elsewhere_where_there_is_an_elsewhere():
    state = ClusterState(timeout_s=3.0, lease_s=100.0)
    for info in (prefill("p0"), decode("d0"), decode("d1")):
        state.heard(info, 0.0)
    assert [d.instance_id for d in state.decode_candidates(0.0, avoid={"d1", "p0"})] == ["d0"]
    assert [p.instance_id for p in state.prefill_candidates(0.0, avoid={"d1", "p0"})] == ["p0"]  # the only one


def test_a_busy_instance_whose_reports_are_late_is_not_taken_for_dead():
    state = ClusterState(timeout_s=3.0, lease_s=100.0)
    state.heard(decode(incarnation="i1"), now=0.0)
    for t in (1.0, 2.0, 3.0, 4.0, 5.0, 6.0):  # no report for 6 s, but its beacon says it lives
        state.alive("d0", "i1", now=t)
        assert state.expire(now=t + 0.4) == []
    state.alive("d0", "another-process", now=7.0)  # a beacon of another incarnation proves nothing
    assert state.expire(now=9.5) == []  # beacons came every second: 4 s of silence is its deadline
    assert [i.instance_id for i in state.expire(now=10.5)] == ["d0"]


def test_an_irregular_instance_gets_a_longer_deadline():
    state = ClusterState(timeout_s=3.0, lease_s=100.0)
    for t in (0.0, 2.0, 4.0, 6.0):  # reports 2 s apart: a silence of 4 x 2 s is the deadline
        state.heard(decode(), now=t)
    assert state.expire(now=12.0) == []
    assert [i.instance_id for i in state.expire(now=14.5)] == ["d0"]


def test_an_exited_process_is_dead_at_once():
    state = cluster()
    state.route(routed("a"))
    assert [i.instance_id for i in state.dead("d0", now=0.0)] == ["d0"]
    assert [r.request_id for r in state.lost_with("d0")] == ["a"]
    assert state.dead("d0", now=0.0) == [] and state.dead("nobody", now=0.0) == []


def test_a_role_that_lost_an_instance_is_recovering_for_a_while():
    state = cluster()
    assert not state.recovering("decode", now=0.0)  # never lost one: with none, the cluster lacks the role
    state.dead("d0", now=10.0)
    assert state.recovering("decode", now=10.0 + RECOVERY_S) and not state.recovering("prefill", now=10.0)
    assert not state.recovering("decode", now=10.1 + RECOVERY_S)


def test_a_role_whose_node_lost_its_messenger_is_recovering_until_the_messenger_is_back():
    """Its instances are alive but cannot move KV: lost capacity, coming back with the messenger
    (a 429 with a Retry-After), not a cluster without the role (503). Found by a soak that killed
    a prefill node's messenger: the requests of the next second got 503s."""
    state = cluster()
    state.heard(WorkerInfo("m0", "messenger", "n0"), 0.0)
    state.dead("m0", now=10.0)
    assert state.prefill_candidates(10.0) == ()  # p0 is cut off
    assert state.recovering("prefill", now=10.0 + RECOVERY_S) and not state.recovering("decode", now=10.0)
    assert not state.recovering("prefill", now=10.1 + RECOVERY_S)  # not back for that long: gone for good
    state.heard(WorkerInfo("m0", "messenger", "n0"), 11.0)  # its supervisor brought it back
    assert not state.recovering("prefill", now=11.0)
    assert [c.instance_id for c in state.prefill_candidates(11.0)] == ["p0"]


def test_a_lost_instance_that_came_back_or_left_cleanly_is_not_recovering():
    state = cluster()
    state.dead("d0", now=10.0)
    assert state.recovering("decode", now=11.0)
    state.heard(decode(), now=12.0)  # its supervisor brought it back
    assert not state.recovering("decode", now=12.0)
    state.heard(decode(leaving=True), now=21.0)  # an operator's clean stop: no supervisor saw an exit
    assert not state.recovering("decode", now=21.0)


def test_a_goodbye_that_comes_after_the_exit_was_seen_leaves_the_role_recovering():
    """A drained instance's leaving heartbeat and its supervisor's Exited come on different
    connections: in either order, its role is recovering (429) until it is heard again."""
    state = cluster()
    state.heard(decode(draining=True), now=1.0)
    state.dead("d0", now=2.0)  # the exit, seen first
    assert state.recovering("decode", now=2.0)
    assert state.heard(decode(leaving=True), now=2.1) is None  # the goodbye, late: nothing to forget
    assert state.recovering("decode", now=2.1) and state.get("d0") is None
    state.heard(decode(), now=3.0)  # restarted
    assert not state.recovering("decode", now=3.0) and [d.instance_id for d in state.of_role("decode")] == ["d0"]


def test_a_draining_instance_or_one_whose_clean_exit_a_supervisor_saw_is_recovering():
    """A rolling restart of the only instance of a role: while it drains, and from its exit (the
    supervisor's Exited) until it is heard again, its role is recovering (429), not absent (503)."""
    state = cluster()
    state.heard(decode(), now=1.0)
    assert not state.recovering("decode", now=1.0)  # it takes work
    state.heard(decode(draining=True), now=2.0)  # SIGTERM: it finishes what it holds, gets nothing new
    assert state.of_role("decode") == [] and state.recovering("decode", now=2.0)
    state.heard(decode(leaving=True), now=3.0)  # done: it leaves
    assert not state.recovering("decode", now=3.0)  # nobody said it comes back (an operator's stop)
    state.dead("d0", now=3.5)  # its supervisor saw the exit, and restarts it
    assert state.recovering("decode", now=3.5) and not state.recovering("decode", now=3.6 + RECOVERY_S)
    state.heard(decode(), now=5.0)  # back
    assert not state.recovering("decode", now=5.0) and [d.instance_id for d in state.of_role("decode")] == ["d0"]


def test_departed_instances_are_remembered_up_to_a_bound_the_oldest_forgotten_first(monkeypatch):
    from common.decide import cluster_state

    monkeypatch.setattr(cluster_state, "DEPARTED_KEPT", 2)
    state = cluster()
    for i in range(3):
        state.heard(decode(f"x{i}"), now=1.0)
    state.dead("x0", now=2.0)
    state.dead("x1", now=2.0)
    state.heard(decode("x2", leaving=True), now=2.0)
    assert list(state.departed) == ["x1", "x2"]
    state.dead("x2", now=2.5)  # its exit after its goodbye: lost now, and the newest departure
    assert list(state.departed) == ["x1", "x2"] and state.departed["x2"].lost


def test_a_new_process_under_a_known_id_means_its_predecessor_died():
    state = ClusterState(timeout_s=3.0, lease_s=100.0)
    assert state.heard(decode(incarnation="old"), now=0.0) == "joined"
    assert state.heard(decode(incarnation="old"), now=0.2) is None
    assert state.heard(decode(incarnation="new"), now=1.0) == "restarted"  # well before any timeout


def test_a_request_no_instance_holds_any_more_ends_after_a_while():
    """Its end message was lost (a broker restart): the instance that last held it stopped
    reporting it, and no other took it, so it ended; its load goes, without waiting for the lease."""
    from common.decide.cluster_state import UNHELD_S

    state = cluster()
    state.route(routed("a"))
    state.route(routed("b"))
    state.heard(prefill(held=["a", "b"]), now=1.0)
    state.heard(prefill(held=["b"]), now=2.0)  # a's prefill is done ...
    state.heard(decode(joined=[Joined("a", 0.1, 100)]), now=3.0)  # ... and it is decoding: held again
    state.heard(prefill(held=[]), now=4.0)  # b's prefill is done and its message was lost
    state.heard(decode(joined=[]), now=5.0)  # a finished and its message was lost
    assert state.expire_unheld(now=4.0 + UNHELD_S - 0.1) == []
    assert [r.request_id for r in state.expire_unheld(now=5.0 + UNHELD_S)] == ["b", "a"]
    assert state.routed == {}


def test_a_request_held_again_or_routed_again_is_not_taken_for_ended():
    from common.decide.cluster_state import UNHELD_S

    state = cluster()
    state.route(routed("a"))
    state.heard(prefill(held=["a"]), now=1.0)
    state.heard(prefill(held=[]), now=2.0)
    state.route(routed("a", attempt=1))  # dispatched again
    assert state.expire_unheld(now=2.0 + UNHELD_S) == [] and "a" in state.routed
    state.heard(decode(joined=[Joined("a", 0.1, 100)]), now=3.0)
    state.heard(decode(joined=[Joined("a", 0.1, 100)]), now=3.0 + UNHELD_S)
    assert state.expire_unheld(now=3.0 + 2 * UNHELD_S) == [] and "a" in state.routed


@pytest.mark.parametrize("seed", range(5))
def test_views_kept_between_changes_equal_views_built_afresh(seed):
    """A report or a request of ours drops only the views it concerns (a decode instance's
    admission view is rebuilt only when its own report, a prefill report naming it, or a request
    bound for it changed; the sums of what is coming and the largest KV room are kept up to date
    as reports come): after every step of a random run, every kept view equals one built from
    nothing."""
    import random

    rng = random.Random(seed)
    decodes, prefills = [f"d{i}" for i in range(4)], [f"p{i}" for i in range(3)]
    state, now, ours = cluster(), 0.0, []

    nodes = ("n0", "n1", "n2")

    def views():
        return ([state.decode_load(d) for d in decodes], state.decode_candidates(now),
                [state.prefill_queue_s(p, now) for p in prefills], {d: list(state.coming_to(d)) for d in decodes},
                state.prefill_candidates(now), dict(state.sender_queued_bytes()),
                [i.instance_id for i in state.of_role("prefill")], [i.instance_id for i in state.of_role("decode")],
                state.largest_decode_room())

    for step in range(1500):
        now += rng.uniform(0.0, 0.2)
        action = rng.random()
        if action < 0.35:
            coming = [Coming(f"r{rng.randint(0, 30)}", rng.choice(decodes), rng.uniform(0, 3), rng.randint(10, 900),
                             rng.randint(0, 64)) for _ in range(rng.randint(0, 4))]
            state.heard(prefill(rng.choice(prefills), node=rng.choice(nodes), queue_s=rng.uniform(0, 2), coming=coming,
                                held=[c.request_id for c in coming], draining=rng.random() < 0.1), now)
        elif action < 0.7:
            joined = [Joined(f"r{rng.randint(0, 30)}", rng.uniform(0, 5), rng.randint(10, 900), rng.randint(1, 20),
                             rng.randint(0, 64)) for _ in range(rng.randint(0, 5))]
            state.heard(decode(rng.choice(decodes), node=rng.choice(nodes), joined=joined,
                               kv_free=rng.choice((None, 500, 1000, 2000)), draining=rng.random() < 0.1), now)
        elif action < 0.76:
            state.heard(WorkerInfo(f"m{rng.randint(0, 2)}", "messenger", rng.choice(nodes)), now)
        elif action < 0.78:  # a node's messenger exits: its workers can move no KV
            state.dead(f"m{rng.randint(0, 2)}", now)
        elif action < 0.8:  # an instance leaves, or is lost with what it held
            gone = rng.choice(decodes + prefills)
            if rng.random() < 0.5:
                state.heard(WorkerInfo(gone, "decode" if gone in decodes else "prefill", "n0", leaving=True), now)
            else:
                state.lost_with(gone)
        elif action < 0.9:
            rid = f"r{rng.randint(0, 30)}"
            pulls = rng.random() < 0.5
            state.route(Routed(rid, (rng.choice(prefills),), rng.choice(decodes), "s", rng.randint(10, 900), now,
                               rng.uniform(0.1, 1), rng.uniform(0.1, 2), rng.choice(nodes) if pulls else "",
                               rng.randint(1, 10**6) if pulls else 0, max_tokens=rng.randint(0, 64)))
            ours.append(rid)
        elif ours:
            rid = rng.choice(ours)
            (state.prefilled(rid, 0) if rng.random() < 0.5 else state.end(rid))
        kept = views()
        state.changed()
        assert kept == views(), step


def _transit_walked(state: ClusterState) -> tuple[dict[str, float], dict[str, int]]:
    """Our work in transit and the bytes pulled per sender, summed over every request in flight in
    self.routed's order: what every route and report did before the sums were kept."""
    transit: dict[str, float] = {}
    queued: dict[str, int] = {}
    for r in state.routed.values():
        if not r.prefilled:
            for p in r.prefill_ids:
                if p not in r.seen_by:
                    transit[p] = transit.get(p, 0.0) + r.prefill_s
            if r.pull_bytes:
                queued[r.pull_source] = queued.get(r.pull_source, 0) + r.pull_bytes
    return transit, queued


@pytest.mark.parametrize("seed", range(4))
def test_work_in_transit_kept_per_instance_is_the_same_floats_as_summing_every_request_again(seed):
    """Our work in transit is kept per prefill instance (a route adds its own, a request that left
    has its instances summed again over those left), not summed over every request in flight after
    each route and report: with hundreds in flight, pipelined ones, attempts routed again, reports
    that take some in and requests that end or are prefilled in any order, every sum is the same
    float, bit for bit, as the walk's, and a route walks no request but its own."""
    import random

    rng = random.Random(seed)
    prefills, decodes = [f"p{i}" for i in range(5)], [f"d{i}" for i in range(3)]
    state, now = ClusterState(timeout_s=1e9, lease_s=1e9), 0.0
    for p in prefills:
        state.heard(prefill(p, node=f"n{p}"), now)
    for d in decodes:
        state.heard(decode(d, node=f"n{d}"), now)
    walks, drops = [], 0  # the walks done, and the steps after which one is due
    walk = state._walk_routed
    state._walk_routed = lambda: (walks.append(len(state.routed)), walk())
    # works of very different sizes: summed in another order (or taken away) they give other floats
    works = [10.0 ** rng.randint(-9, 3) * rng.random() for _ in range(97)]
    for step in range(3000):
        now += 0.001
        action, rid = rng.random(), f"r{rng.randint(0, 400)}"
        if action < 0.45:
            stages = tuple(rng.sample(prefills, rng.choice((1, 1, 1, 2, 3))))
            pulls = rng.random() < 0.4
            again = rid in state.routed
            drops += again
            state.route(Routed(rid, stages, rng.choice(decodes), "s", 100, now, rng.choice(works), 1.0,
                               rng.choice(("n0", "n1", "n2")) if pulls else "", rng.randint(1, 10**9) if pulls else 0,
                               attempt=state.routed[rid].attempt + 1 if again else 0))
        elif action < 0.6:
            held = rng.sample(sorted(state.routed), min(len(state.routed), rng.randint(0, 6)))
            p = rng.choice(prefills)
            state.heard(prefill(p, node=f"n{p}", held=held), now)
        elif action < 0.7:
            state.prefilled(rid, state.routed[rid].attempt if rid in state.routed else 0)
        elif action < 0.85:
            state.end(rid)
        elif action < 0.86:
            state.changed()
            drops += 1
        transit, queued = _transit_walked(state)
        assert {p: state.prefill_queue_s(p, now) for p in prefills} == {p: transit.get(p, 0.0) for p in prefills}, step
        assert state._in_transit_s() == transit and state.sender_queued_bytes() == queued, step
    assert len(state.routed) > 100
    # walked again only after changed() and an attempt routed again, not per route or report
    assert 0 < len(walks) <= drops + 1 < 3000 / 3


def test_a_request_its_prefill_could_not_begin_in_time_ends_and_the_ttft_margin_learns_from_it():
    """Rejected at its prefill's start, a request leaves the loads, and the TTFT it would have had
    (its wait until then, plus its predicted work) is one of the margin's outcomes: otherwise the
    margin would learn only from requests fast enough to be served."""
    from common.decide.admission import AdmissionSettings

    state = ClusterState(3.0, 100.0, admission=AdmissionSettings("predictive", ttft_slo_s=20.0, tbt_slo_s=1.0))
    state.heard(prefill(), 0.0)
    state.heard(decode(), 0.0)
    for i in range(8):  # predicted 10 s (4 of queue, 6 of work); found at 14 s: it would have come at 20 s
        state.route(routed(f"r{i}", at=0.0, work=6.0, ttft=10.0))
        assert state.unstarted(f"r{i}", 0, 14.0) is not None
    assert not state.routed and state.decode_load("d0").joins == ()
    assert state.ttft_margin.value == 2.0
    state.route(routed("r9", at=0.0, attempt=1))
    assert state.unstarted("r9", 0, 14.0) is None and "r9" in state.routed  # another attempt's: not this one


def test_a_messenger_cannot_speak_for_a_node_another_messenger_holds():
    """A messenger's heartbeat names its node; the bus ties it to the messenger, not to the node.
    One that said another node's messenger was leaving once made the conductor forget that node."""
    state = ClusterState(timeout_s=3.0, lease_s=100.0)
    state.heard(decode("d0", node="n1"), 0.0)
    state.heard(WorkerInfo("m1", "messenger", "n1"), 0.0)
    state.heard(WorkerInfo("m2", "messenger", "n2"), 0.0)
    assert state.heard(WorkerInfo("m2", "messenger", "n1", leaving=True), 1.0) == "spoofed"
    assert state.heard(WorkerInfo("m2", "messenger", "n1"), 1.0) == "spoofed"
    assert "m1" in state.instances and "n1" not in state.lost_nodes
    assert [d.instance_id for d in state.decode_candidates(1.0)] == ["d0"]
    state.heard(WorkerInfo("m1", "messenger", "n1", leaving=True), 2.0)  # its own messenger leaves: the node is free
    assert state.heard(WorkerInfo("m3", "messenger", "n1"), 2.5) == "joined"
    state.dead("m3", 3.0)  # lost: free again
    assert state.heard(WorkerInfo("m4", "messenger", "n1"), 3.5) == "joined"
