"""What a driver does to run the planner's targets: which instances to start, serve again, cancel or drain.

The planner (common/decide/planner.py) says how many instances of each role the load needs; a
driver makes it so. The drivers: `moonbus up --autoscale` (tools/moonbus/cluster/autoscale.py:
worker processes of its own), a Docker swarm (tools/swarm/autoscale.py: `docker service scale`),
and the simulator (tools/sim/autoscale.py). They share this module, so that they follow the
planner and choose the same way.

Following the planner (`Follower`): the targets are those of the newest `planned` event heard
(one is published each time a target changes, and each time a role lost instances); an older one
heard late is ignored, and a target beyond what the driver can run is cut to its bound, saying
so. `lost_*` are no scale change: whoever restarts processes (the supervisor, the swarm's restart
policy) replaces a lost instance, and a driver that counts the one being restarted among its
members (starting) does nothing for it.

The steps, per role, with target T and the role's members (`steps`):

    have = serving + starting              (draining ones finish what they hold, then leave)
    T > have   the newest draining ones serve again (they are up already: the cheapest), then
               the rest are started
    T < have   the newest starting ones are cancelled (they serve nobody yet), then the serving
               ones that hold least drain (they finish what they hold, taking nothing new;
               among equals the newest first)

Pure: the drivers pass what they see and act on what comes back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

from schemas.events import PLANNED, Event, Planned

ROLES = ("prefill", "decode")
STARTING, SERVING, DRAINING = "starting", "serving", "draining"


@dataclass(frozen=True)
class Member:
    """One instance of a role as its driver sees it."""

    name: str
    state: str  # STARTING (asked for, not serving yet: a restart too), SERVING, or DRAINING (can serve again)
    held: int = 0  # requests it holds (queued and running): the one holding least drains first
    order: float = 0  # when it was started (the driver's clock or count): the newest is cancelled, drained or resumed first

    def __post_init__(self) -> None:
        if self.state not in (STARTING, SERVING, DRAINING):
            raise ValueError(f"a member is starting, serving or draining; got {self.state!r}")


@dataclass(frozen=True)
class Steps:
    """What to do to one role: start this many, and the named members to resume, cancel or drain."""

    start: int = 0
    resume: tuple[str, ...] = ()  # draining: serve again
    cancel: tuple[str, ...] = ()  # starting: stop before they serve
    drain: tuple[str, ...] = ()  # serving: finish what they hold, take nothing new, leave

    @property
    def none(self) -> bool:
        return not (self.start or self.resume or self.cancel or self.drain)


def steps(target: int, members: Iterable[Member]) -> Steps:
    """The steps that bring a role's members to `target` taking work (see the module's docstring)."""
    members = list(members)
    of = {state: [m for m in members if m.state == state] for state in (STARTING, SERVING, DRAINING)}
    have = len(of[SERVING]) + len(of[STARTING])
    if target > have:
        resume = sorted(of[DRAINING], key=lambda m: -m.order)[:target - have]
        return Steps(start=target - have - len(resume), resume=tuple(m.name for m in resume))
    if target < have:
        excess = have - target
        cancel = sorted(of[STARTING], key=lambda m: -m.order)[:excess]
        drain = sorted(of[SERVING], key=lambda m: (m.held, -m.order))[:excess - len(cancel)]
        return Steps(cancel=tuple(m.name for m in cancel), drain=tuple(m.name for m in drain))
    return Steps()


@dataclass(frozen=True)
class Targets:
    """The planner's targets a driver runs, and the decision they came from."""

    prefill: int
    decode: int
    at: float  # the planned event's time (its publisher's wall clock)
    source: str  # the conductor that decided
    reasons: tuple[str, ...] = ()
    cut: tuple[str, ...] = ()  # what the driver's own bounds changed

    def of(self, role: str) -> int:
        return self.prefill if role == "prefill" else self.decode

    def describe(self) -> str:
        why = "; ".join(self.reasons + self.cut) or "no reason given"
        return f"{self.prefill} prefill, {self.decode} decode ({self.source}: {why})"


class Follower:
    """The newest planned targets, cut to the driver's bounds (role -> (min, max); none: as decided)."""

    def __init__(self, bounds: Mapping[str, tuple[int, int]] | None = None) -> None:
        self.bounds = dict(bounds or {})
        self.targets: Targets | None = None

    def heard(self, event: Event) -> Targets | None:
        """The targets after this event when they changed (None: an older event, another kind, or
        the same targets again, as after a loss: the restarts are not the driver's)."""
        if event.kind != PLANNED or (self.targets is not None and event.ts < self.targets.at):
            return None
        planned = Planned.from_dict(event.data)
        counts, cut = {}, []
        for role in ROLES:
            want = planned.prefill if role == "prefill" else planned.decode
            lo, hi = self.bounds.get(role, (0, want))
            counts[role] = min(hi, max(lo, want))
            if counts[role] != want:
                cut.append(f"{role} {want} is beyond this driver's bounds {lo}..{hi}: {counts[role]}")
        before = self.targets
        self.targets = Targets(counts["prefill"], counts["decode"], event.ts, event.instance_id,
                               tuple(planned.reasons), tuple(cut))
        if before is not None and (before.prefill, before.decode) == (self.targets.prefill, self.targets.decode):
            return None
        return self.targets
