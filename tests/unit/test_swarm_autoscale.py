"""tools/swarm/autoscale.py: the docker commands the swarm driver runs for a sequence of planned
events (a fake runner stands in for docker, and only for it). Over a real nats-server:
tests/integration/test_swarm_autoscale.py."""

from __future__ import annotations

from schemas.events import PLANNED, Event
from tools.swarm.autoscale import SwarmScaler


def make_planned(prefill: int, decode: int, ts: float, lost: tuple[int, int] = (0, 0)) -> Event:
    return Event(PLANNED, ts, "conductor", "conductor", data={
        "prefill": prefill, "decode": decode, "previous_prefill": 1, "previous_decode": 1,
        "reasons": [f"to {prefill}P{decode}D"], "lost_prefill": lost[0], "lost_decode": lost[1]})


class FakeDocker:
    """Answers each command with the next exit code of `codes` (0 once they are used up)."""

    def __init__(self, codes=()) -> None:
        self.codes = list(codes)
        self.commands: list[list[str]] = []

    def __call__(self, command: list[str]) -> tuple[int, str]:
        self.commands.append(command)
        code = self.codes.pop(0) if self.codes else 0
        return code, "Error response from daemon: this node is not a swarm manager" if code else ""


def test_each_change_of_the_targets_is_one_scale_of_both_services():
    docker = FakeDocker()
    scaler = SwarmScaler("moonbus", docker)
    for event in (make_planned(2, 1, 10.0), make_planned(2, 1, 11.0, lost=(1, 0)),  # a loss: the swarm restarts
                  make_planned(3, 1, 5.0),  # older than what it follows
                  make_planned(2, 2, 20.0), make_planned(1, 2, 30.0)):
        scaler.heard(event, now=event.ts)
    assert docker.commands == [
        ["docker", "service", "scale", "--detach", "moonbus_prefill=2", "moonbus_decode=1"],
        ["docker", "service", "scale", "--detach", "moonbus_prefill=2", "moonbus_decode=2"],
        ["docker", "service", "scale", "--detach", "moonbus_prefill=1", "moonbus_decode=2"],
    ]
    assert scaler.pending is None


def test_the_services_may_be_named_otherwise():
    docker = FakeDocker()
    SwarmScaler("prod", docker, {"prefill": "pf", "decode": "dc"}).heard(make_planned(1, 3, 1.0), now=1.0)
    assert docker.commands == [["docker", "service", "scale", "--detach", "prod_pf=1", "prod_dc=3"]]


def test_a_failed_command_is_tried_again_after_the_retry_time_and_a_newer_decision_replaces_it():
    docker = FakeDocker(codes=[1, 1, 0])
    scaler = SwarmScaler("moonbus", docker, retry_s=10.0)
    scaler.heard(make_planned(2, 1, 100.0), now=0.0)  # fails
    scaler.tick(now=5.0)  # too soon to try again
    scaler.tick(now=10.0)  # fails again
    scaler.heard(make_planned(2, 2, 101.0), now=12.0)  # a newer decision: at once, and it runs
    scaler.tick(now=30.0)  # nothing left to run
    assert [c[-2:] for c in docker.commands] == [["moonbus_prefill=2", "moonbus_decode=1"],
                                                 ["moonbus_prefill=2", "moonbus_decode=1"],
                                                 ["moonbus_prefill=2", "moonbus_decode=2"]]
    assert scaler.pending is None
