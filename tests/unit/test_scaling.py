"""common.decide.scaling: what a driver does to run the planner's targets, and which planned event it follows."""

from __future__ import annotations

import pytest

from common.decide.scaling import DRAINING, SERVING, STARTING, Follower, Member, Steps, steps
from schemas.events import PLANNED, Event


def make_member(name: str, state: str = SERVING, held: int = 0) -> Member:
    return Member(name, state, held, order=int(name.rsplit("-", 1)[1]))


def make_planned(prefill: int, decode: int, ts: float, lost: tuple[int, int] = (0, 0), reasons=("why",),
                 kind: str = PLANNED) -> Event:
    return Event(kind, ts, "conductor", "conductor", data={
        "prefill": prefill, "decode": decode, "previous_prefill": 1, "previous_decode": 1, "reasons": list(reasons),
        "lost_prefill": lost[0], "lost_decode": lost[1]})


def test_at_the_target_nothing_is_done():
    assert steps(2, [make_member("d-0"), make_member("d-1", STARTING)]) == Steps()
    assert steps(2, [make_member("d-0"), make_member("d-1", STARTING)]).none


def test_more_starts_the_difference():
    assert steps(3, [make_member("p-0")]) == Steps(start=2)
    assert steps(1, []) == Steps(start=1)


def test_more_resumes_the_newest_draining_ones_before_starting_any():
    members = [make_member("d-0"), make_member("d-1", DRAINING), make_member("d-2", DRAINING)]
    assert steps(2, members) == Steps(resume=("d-2",))
    assert steps(4, members) == Steps(start=1, resume=("d-2", "d-1"))


def test_fewer_cancels_the_newest_starting_ones_first():
    members = [make_member("p-0"), make_member("p-1", STARTING), make_member("p-2", STARTING)]
    assert steps(2, members) == Steps(cancel=("p-2",))
    assert steps(1, members) == Steps(cancel=("p-2", "p-1"))


def test_fewer_drains_the_serving_ones_that_hold_least_newest_first_among_equals():
    members = [make_member("d-0", held=3), make_member("d-1", held=0), make_member("d-2", held=5),
               make_member("d-3", held=0)]
    assert steps(3, members) == Steps(drain=("d-3",))
    assert steps(2, members) == Steps(drain=("d-3", "d-1"))
    assert steps(1, members) == Steps(drain=("d-3", "d-1", "d-0"))


def test_fewer_cancels_then_drains_and_draining_ones_do_not_count():
    members = [make_member("p-0", held=2), make_member("p-1", held=1), make_member("p-2", STARTING),
               make_member("p-3", DRAINING)]
    assert steps(1, members) == Steps(cancel=("p-2",), drain=("p-1",))


def test_a_member_in_no_known_state_is_refused():
    with pytest.raises(ValueError, match="starting, serving or draining"):
        Member("p-0", "gone")


def test_the_follower_takes_each_change_and_ignores_older_events_and_losses():
    follower = Follower()
    first = follower.heard(make_planned(2, 1, ts=10.0, reasons=("prefill 1 -> 2: demand",)))
    assert (first.prefill, first.decode, first.source, first.reasons) == (2, 1, "conductor", ("prefill 1 -> 2: demand",))
    assert follower.heard(make_planned(1, 1, ts=5.0)) is None  # older than what it follows
    assert follower.heard(make_planned(2, 1, ts=12.0, lost=(1, 0))) is None  # a loss: the restarts are not its
    assert follower.heard(make_planned(2, 2, ts=14.0, kind="joined")) is None  # not a planned event
    second = follower.heard(make_planned(1, 2, ts=20.0))
    assert (second.prefill, second.decode, second.at) == (1, 2, 20.0)
    assert follower.targets == second


def test_the_follower_cuts_targets_to_its_own_bounds_and_says_so():
    follower = Follower({"prefill": (1, 2), "decode": (1, 3)})
    targets = follower.heard(make_planned(5, 0, ts=1.0))
    assert (targets.prefill, targets.decode) == (2, 1)
    assert targets.cut == ("prefill 5 is beyond this driver's bounds 1..2: 2", "decode 0 is beyond this driver's bounds 1..3: 1")
    assert "prefill 5 is beyond" in targets.describe()
    assert follower.heard(make_planned(4, 0, ts=2.0)) is None  # cut to the same targets: nothing to do
