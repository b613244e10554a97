"""`moonbus up --autoscale`'s driver: the planner's targets, run as this machine's worker processes.

The first conductor runs the planner (--planner, services/conductor/planner_loop.py), which
publishes a `planned` event each time a target changes. The supervisor (up.supervise) follows
them on its own NATS connection, as the supervisor user (which may read the planned events and
the prefill and decode heartbeats: tools/moonbus/cluster/security.py), and on each pass of its
loop brings each role to its target with common.decide.scaling (the steps every driver takes):

    members   the role's worker processes: starting (spawned, or being restarted after it died,
              and not heard since), serving (its heartbeat heard since it was spawned, with what
              it holds); not those draining (told to leave: a process cannot be told to serve
              again) nor one left down as crash-looping
    start     worker <role>-<i> on a node of its own (node-p<i> / node-d<i>) with its messenger,
              i the lowest index free below the role's maximum
    drain     SIGTERM, the workers' own drain (no new work; what it holds it finishes, and after
              its grace hands back, to be resumed elsewhere); it is not restarted when it exits,
              and its node's messenger follows it (Cluster.retire)
    cancel    a starting one: the same

A lost instance is the supervisor's to restart, as ever: the planner does not move a target for
it, and the process being restarted stays a member (starting). Every step is printed and
published as an instance event of the supervisor: scaled_up, scaled_down (with what it held) and,
once its process is gone, retired.

NATS users: nats.conf is written once, at the start, with a user for each process; so an
autoscaled cluster makes them for every worker and messenger up to each role's maximum
(ClusterSpec.max_prefill, max_decode), and this driver never runs more than that.
"""

from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass

from common.decide.scaling import ROLES, SERVING, STARTING, Follower, Member, Steps, steps
from schemas import subjects
from schemas.events import PLANNED_ALL, Event
from schemas.workers import own_heartbeat
from tools.moonbus.cluster.processes import Cluster
from tools.moonbus.cluster.supervisor import SupervisorEvents

log = logging.getLogger(__name__)

HEARTBEATS = tuple(subjects.worker_heartbeat(role, "*") for role in ROLES)


@dataclass(frozen=True)
class Heard:
    """A worker's latest heartbeat, as the driver keeps it."""

    at: float  # monotonic, when it came
    held: int  # requests queued and running there
    leaving: bool


class LocalScaler:
    """Follows the planner and starts or drains this cluster's workers (see the module's docstring)."""

    def __init__(self, cluster: Cluster, events: SupervisorEvents, say) -> None:
        self.cluster = cluster
        self.events = events
        self.say = say
        self.follower = Follower({role: (1, cluster.most(role)) for role in ROLES})
        self.heard: dict[str, Heard] = {}  # instance id -> its latest heartbeat
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()  # (planned?, subject, data), from the events thread
        self.stuck: dict[str, int] = {}  # role -> instances it could not start (no index free), said once
        # on the events thread each message is only handed over, tagged by the subscription it came on
        self.on = events.listen(PLANNED_ALL, lambda subject, data: self.inbox.put((True, subject, data))) and all(
            events.listen(heartbeats, lambda subject, data: self.inbox.put((False, subject, data)))
            for heartbeats in HEARTBEATS)
        if not self.on:
            say("moonbus up: --autoscale is off: the supervisor has no NATS connection to follow the planner")

    def take(self) -> None:
        """What arrived since the last pass: heartbeats, and the planner's decisions."""
        while True:
            try:
                planned, subject, data = self.inbox.get_nowait()
            except queue.Empty:
                return
            try:
                if planned:
                    self._planned(Event.from_bytes(data))
                else:
                    self._heartbeat(subject, data)
            except Exception:  # one bad message is dropped, never the supervisor
                log.exception("autoscale: dropped a message on %s", subject)

    def _heartbeat(self, subject: str, data: bytes) -> None:
        info = own_heartbeat(subject, data)
        if info is not None:
            self.heard[info.instance_id] = Heard(time.monotonic(), info.num_queued + info.num_running, info.leaving)

    def _planned(self, event: Event) -> None:
        targets = self.follower.heard(event)
        if targets is not None:
            self.say(f"moonbus up: autoscale: the planner asks for {targets.describe()}")

    def act(self) -> None:
        """One pass: take what arrived, then bring each role to its target."""
        self.take()
        targets = self.follower.targets
        if targets is None:
            return
        for role in ROLES:
            todo = steps(targets.of(role), self.members(role))
            if not todo.none:
                self.apply(role, targets.of(role), todo)

    def members(self, role: str) -> list[Member]:
        members = []
        for proc in self.cluster.procs.values():
            if proc.kind != role or proc.retiring or proc.restarts.gave_up:
                continue
            heard = self.heard.get(proc.name)
            serving = heard is not None and heard.at > proc.started_at and not heard.leaving \
                and proc.popen.poll() is None
            members.append(Member(proc.name, SERVING if serving else STARTING, heard.held if heard else 0,
                                  order=proc.started_at))
        return members

    def apply(self, role: str, target: int, todo: Steps) -> None:
        for _ in range(todo.start):
            index = self.free_index(role)
            if index is None:
                if self.stuck.get(role) != target:
                    self.stuck[role] = target
                    self.say(f"moonbus up: autoscale: cannot start another {role} instance: all "
                             f"{self.cluster.most(role)} this cluster has users for are taken")
                break
            worker = self.cluster.start_worker(role, index)
            self.say(f"moonbus up: autoscale: started {worker.name} on {worker.node} (target {target} {role})")
            self.events.instance("scaled_up", worker.name, role=role, node=worker.node, target=target)
        for name in todo.cancel + todo.drain:
            held = self.heard[name].held if name in self.heard else 0
            self.cluster.retire(name)
            how = "cancelled (not serving yet)" if name in todo.cancel else f"draining (holds {held})"
            self.say(f"moonbus up: autoscale: {name} {how} (target {target} {role})")
            self.events.instance("scaled_down", name, role=role, target=target, held=held,
                                 serving=name in todo.drain)

    def free_index(self, role: str) -> int | None:
        """The lowest index whose worker and messenger are both gone, below the role's maximum."""
        for index in range(self.cluster.most(role)):
            if not any(p.name in self.cluster.procs for p in self.cluster.plan_node(role, index)):
                return index
        return None

