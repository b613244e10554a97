"""The load of every instance, as any number of conductors (and the simulator) see it.

Instances are the source of truth: each reports what it holds in its heartbeats and at each
change of state (schemas.workers.PrefillReport / DecodeReport): a prefill instance its queue in
predicted seconds and, for every request it holds, the decode instance it goes to, when its
prefill should end and its context; a decode instance its batch, KV room and the requests it
holds. A conductor adds to the last report only its own dispatches that the instance has not
reported yet (routed, not arrived), so N conductors see the same load, up to the requests each
has in flight on the bus:

    prefill p   queue_s = report.queue_s - time since the report  +  own requests routed to p not in it
    decode d    batch   = report.running + waiting  +  requests held by any prefill that go to d
                          +  own requests routed to d that no report holds yet (on the bus, in transfer)

Every pipeline stage is charged the request's prefill work. The conductor also keeps, for the
requests it routed, who holds them (to hand them back when an instance is lost) until they end
or their lease runs out.

Reports also carry each instance's latest measured work (schemas.workers.Measured: a prefill's
seconds, a decode step's seconds); given the profile, every new measurement teaches the
instance's factor (common/decide/learn.py), and the candidates and decode loads carry it, so the
policy and admission price each instance at the speed it really runs.
Pure: the caller passes the clock; no I/O.
"""

from __future__ import annotations

from collections import deque
from itertools import accumulate
from dataclasses import dataclass, field, replace
from typing import Collection, Iterable

from schemas.workers import DecodeReport, Layout, PrefillReport, WorkerInfo
from common.decide.admission import AdmissionSettings, DecodeLoad
from common.decide.nodes import NodeHolders
from common.decide.learn import Learned, Threshold, TtftMargin
from common.decide.outputs import OutputLengths
from common.decide.perf import Profile
from common.decide.policy import DecodeCandidate, PolicySettings, PrefillCandidate

_new_row = tuple.__new__  # a NamedTuple built without its Python-level __new__ (the hot path's candidates)


GAPS_KEPT = 64  # an instance's recent gaps between signs of life
GAP_FACTOR = 4.0  # a silence this many times its longest recent gap (and past the timeout) is death
UNKNOWN_OUTPUT_TOKENS = 256  # a request whose max_tokens is not reported (an older instance)
DEFAULT_STEP_S = 0.05  # without a profile or a reported step time
RECOVERY_S = 60.0  # how long after losing an instance its role counts as recovering (ClusterState.recovering)
DEPARTED_KEPT = 10_000  # instances gone, remembered until heard again (a bound, the oldest forgotten first)
UNHELD_S = 30.0  # a request the instance that last held it has stopped reporting, for this long, has ended


@dataclass
class Routed:
    """One request this conductor routed, from dispatch until its end (or its lease)."""

    request_id: str
    prefill_ids: tuple[str, ...]  # every stage (one unless pipelined)
    decode_id: str
    reply_subject: str
    prompt_tokens: int
    routed_at: float
    prefill_s: float  # predicted work per stage: prefill + transfer
    ttft_s: float  # predicted queue + work: the prefill ends at routed_at + ttft_s
    pull_source: str = ""
    pull_bytes: int = 0
    attempt: int = 0
    joins_decode: bool = True  # False when the request ends with its first token (max_tokens 1)
    max_tokens: int = 0  # what it may generate (0: unknown)
    expected_tokens: int = 0  # the client's hint of its output length (0: none)
    prefilled: bool = False  # the prefill is done: it is in transfer or at decode
    seen_by: set[str] = field(default_factory=set)  # instances whose reports held it

    @property
    def predicted_prefill_end(self) -> float:
        return self.routed_at + self.ttft_s


@dataclass
class Instance:
    info: WorkerInfo
    seen_at: float  # its last report (the load in `info` is as of then)
    alive_at: float = 0.0  # its last sign of life: a report or a liveness beacon
    gaps: deque = field(default_factory=lambda: deque(maxlen=GAPS_KEPT))  # seconds between its signs of life

    def signal(self, now: float) -> None:
        if self.alive_at:
            self.gaps.append(now - self.alive_at)
        self.alive_at = max(self.alive_at, now)

    def deadline(self, timeout_s: float) -> float:
        """How long a silence means death: the configured timeout, or more for an instance whose
        signs of life have come that irregularly (GAP_FACTOR times its longest recent gap)."""
        return max(timeout_s, GAP_FACTOR * max(self.gaps, default=0.0))


@dataclass(frozen=True, slots=True)
class Departure:
    """How an instance that is no longer known went: `lost` (its process died, or it went silent:
    its capacity is gone, maybe coming back) or not (it left cleanly: a drain), its role, and when."""

    role: str
    lost: bool
    at: float


@dataclass(frozen=True)
class Refusal:
    """An instance that disagrees with the cluster's invariants (it is not used)."""

    info: WorkerInfo
    differences: tuple[str, ...]


class ClusterState:
    def __init__(self, timeout_s: float, lease_s: float, layout: Layout | None = None,
                 perf: Profile | None = None, balancing_threshold: float = 1.25,
                 admission: AdmissionSettings | None = None) -> None:
        self.timeout_s = timeout_s
        self.lease_s = lease_s
        self.layout = layout  # the cluster's invariants; None = not checked
        self.perf = perf  # the profile the measurements are judged against; None = nothing learned
        self.learned = Learned()
        self.threshold = Threshold(balancing_threshold)  # the policy's, learned from pulls' TTFT against recomputes'
        # predictive admission's: how much later than predicted first tokens come (none without settings)
        self.ttft_margin = TtftMargin(admission.ttft_slo_s / 4, admission.ttft_quantile) if admission is not None \
            else TtftMargin(quantile=0.0)
        self.outputs = OutputLengths()  # lengths of completed requests: how long each decoding one will stay
        self._measured: dict[str, int] = {}  # instance_id -> seq of the last measurement learned from
        self.instances: dict[str, Instance] = {}  # instance_id -> Instance
        self.routed: dict[str, Routed] = {}  # request_id -> Routed (this conductor's)
        # NOTE: who will join each decode instance is derived from every prefill report and our own
        # requests. Each decision reads it per candidate, and each route or report changes only a
        # few decode instances' share: it is kept per decode instance (dropped by `touched`), from
        # two sources kept apart, so that a route does not walk every prefill report again
        self._coming: dict[str, list[tuple[float, int, int, int]]] = {}  # decode_id -> sorted (finish, context, max, hint)
        self._coming_sums: dict[str, tuple[int, int, int]] = {}  # decode_id -> its coming's (count, context, room), likewise
        # what the prefill reports say: decode_id -> their entries, and the request ids they hold (->
        # how many reports hold each). Kept up to date per report: a prefill report changes only its
        # own instance's entries (_reports_stale), not every other's
        self._reported_coming: dict[str, list[tuple[float, int, int, int]]] | None = None
        self._held_by_prefill: dict[str, int] = {}
        self._reported_of: dict[str, list[tuple[str, str, tuple]]] = {}  # instance -> its (decode id, request id, entry)
        # decode_id -> [count, context, room] of what the prefill reports say will join it: added and
        # taken away with their entries (integers: exact), so that a decode candidate is its sums, not a walk
        self._reported_totals: dict[str, list[int]] = {}
        self._reports_stale: set[str] = set()  # instances whose prefill report changed since it was read
        # prefill instance id -> its node, reported queue seconds (None: no report), when reported and
        # its learned speed: what its candidate takes, until it is heard again or a factor moves
        self._prefill_rows: dict[str, tuple[str, float | None, float, float]] = {}
        self._rows_version = -1  # self.learned.version the rows' speeds are of
        self._capacity: tuple[int | None] | None = None  # the largest decode instance's KV room (beyond_capacity)
        # decode_id -> from its own report: requests held, their context (waiting ones too), free KV room
        self._decode_reported: dict[str, tuple[int, int, int | None]] = {}
        self._bound: dict[str, set[str]] | None = None  # decode_id -> our request ids bound there
        # NOTE: our work in transit is kept per prefill instance, with the requests it sums in the
        # order of self.routed: a route adds its own at the end (the same additions as summing them
        # all again, in the same order), and only an instance one of its requests left (reported,
        # prefilled, ended) is summed again, over its own. Each route used to sum every request in
        # flight again: O(in flight) per route, and per report
        self._transit_s: dict[str, float] | None = None  # prefill_id -> predicted work of ours not reported yet
        self._transit_of: dict[str, dict[str, Routed]] = {}  # prefill_id -> those requests, in self.routed's order
        self._transit_stale: set[str] = set()  # prefill ids whose sum is to be done again from their requests
        self._queued_bytes: dict[str, int] | None = None  # node -> bytes our requests in prefill pull from it
        self._members: dict[str, list[str]] = {}  # role -> ids of its instances that take new work, sorted
        self._decode_loads: dict[str, DecodeLoad] = {}  # decode_id -> admission's view, until the next change
        self._decode_candidates: dict[str, DecodeCandidate] = {}  # decode_id -> the policy's view, likewise
        # decode_id -> what each request it reported will still generate (ascending), their contexts
        # and reserved room, and the leave times last made of them: its admission view's costly
        # part, kept until its own next report
        self._outputs_of: dict[str, _Outputs] = {}
        # nodes whose messenger stopped heartbeating (-> since when): their workers can neither send
        # nor receive KV (a messenger that was never heard of, as in the simulator, marks nothing)
        self.lost_nodes: dict[str, float] = {}
        self.node_holders = NodeHolders()  # which messenger speaks for each node
        self.departed: dict[str, Departure] = {}  # instance_id -> how it went, until heard again
        # who last reported holding each of our requests, and since when it no longer does: a request
        # whose end message was lost (a broker restart drops what had no subscriber) ends this way,
        # not at its lease
        self._held: dict[str, set[str]] = {}  # instance_id -> our requests its latest report held
        self._unheld: dict[str, float] = {}  # request_id -> since when its last holder stopped reporting it

    def changed(self) -> None:
        """Every derived view is stale (an instance gone, requests lost: rare)."""
        self._coming = {}
        self._coming_sums = {}
        self._reported_coming = None
        self._reports_stale = set()
        self._bound = None
        self._transit_s = None
        self._transit_of, self._transit_stale = {}, set()
        self._queued_bytes = None
        self._members = {}
        self._prefill_rows = {}
        self._capacity = None
        self._decode_loads = {}
        self._decode_candidates = {}
        self._outputs_of = {}
        self._decode_reported = {}

    def touched(self, decode_ids: Iterable[str]) -> None:
        """A report or one of our requests changed: who will join, and admission's and the policy's
        views, of only the decode instances it concerns (the costly part: each sorts every request
        the instance holds). Our work in transit follows each request itself (_left_transit)."""
        coming, sums, loads, candidates = self._coming, self._coming_sums, self._decode_loads, self._decode_candidates
        for decode_id in decode_ids:
            coming.pop(decode_id, None)
            sums.pop(decode_id, None)
            loads.pop(decode_id, None)
            candidates.pop(decode_id, None)

    def _concerns(self, *infos: WorkerInfo | None) -> set[str]:
        """The decode instances whose admission view these reports of one instance shape: its own
        (a decode instance), those its prefill report says its requests go to, and those our own
        requests that it names are bound for (a request it holds is not counted as coming there
        from us, and a retried one may be bound elsewhere than its report says)."""
        out: set[str] = set()
        for info in infos:
            if info is None:
                continue
            if info.role == "decode":
                out.add(info.instance_id)
            if info.prefill is not None:
                for c in info.prefill.coming:
                    out.add(c.decode_id)
                    ours = self.routed.get(c.request_id)
                    if ours is not None:
                        out.add(ours.decode_id)
        return out

    # --- what instances say ------------------------------------------------------------------------
    def heard(self, info: WorkerInfo, now: float) -> str | Refusal | None:
        """A heartbeat or a report: "joined" for a new instance, "left" for a leaving one,
        "restarted" for a new process under a known id (its predecessor died: what it held is
        lost, though no silence was ever long enough to say so), a Refusal for one whose
        invariants differ from the cluster's, "spoofed" for a messenger that speaks for a node
        another messenger holds (common/decide/nodes.py: ignored), else None."""
        if info.role == "messenger" and not self.node_holders.claim(info.node, info.instance_id):
            return "spoofed"
        known = self.instances.get(info.instance_id)
        gone = self.departed.get(info.instance_id)
        if info.leaving and known is None and gone is not None and gone.lost:
            # its goodbye came after its exit was seen (the supervisor's Exited arrives on another
            # connection and may overtake it): it stays lost, and so its role recovering
            return None
        before = known.info if known is not None else None
        self.touched(self._concerns(before, info))
        if info.prefill is not None or (before is not None and before.prefill is not None):
            self._reports_stale.add(info.instance_id)  # its share of who will join where is read again
        if info.decode is not None or (before is not None and before.decode is not None):
            self._capacity = _largest_after(self._capacity, _decode_room(before), _decode_room(info))
            self._decode_reported.pop(info.instance_id, None)
        if before is None or info.leaving \
                or (before.role, before.draining, before.node) != (info.role, info.draining, info.node):
            self._members = {}  # who takes new work changed
        self._prefill_rows.pop(info.instance_id, None)  # its report's queue and time, when it is a prefill instance
        self._outputs_of.pop(info.instance_id, None)
        self.departed.pop(info.instance_id, None)  # back (or leaving on purpose): no longer capacity lost
        if before is not None and before.role == "messenger" and before.node != info.node:
            self.node_holders.release(before.node, info.instance_id)
        if info.leaving:  # a clean exit: a new instance under this id starts from the profile
            if info.role == "messenger":
                self.node_holders.release(info.node, info.instance_id)
            self.learned.forget(info.instance_id)
            self._measured.pop(info.instance_id, None)
            self._departs(info.instance_id, Departure(info.role, False, now))
            return "left" if self.instances.pop(info.instance_id, None) is not None else None
        if self.layout is not None and info.layout is not None:
            differences = self.layout.differences(info.layout)
            if differences:
                self.instances.pop(info.instance_id, None)
                self._members = {}
                return Refusal(info, tuple(differences))
        instance = self.instances[info.instance_id] = Instance(info, now)
        if known is not None and known.info.incarnation == info.incarnation:
            instance.alive_at, instance.gaps = known.alive_at, known.gaps
        instance.signal(now)
        self._learn(info)
        if info.role == "messenger" and info.node in self.lost_nodes:
            del self.lost_nodes[info.node]
            self._members = {}
        held = set()
        transit = self._transit_of.get(info.instance_id) if self._transit_s is not None else None
        for rid in self._held_ids(info):
            request = self.routed.get(rid)
            if request is not None:
                request.seen_by.add(info.instance_id)
                if transit and transit.pop(rid, None) is not None:  # in its report now, no longer in transit
                    self._transit_stale.add(info.instance_id)
                held.add(rid)
                self._unheld.pop(rid, None)
        for rid in self._held.get(info.instance_id, set()) - held:
            self._unheld.setdefault(rid, now)
        self._held[info.instance_id] = held
        if known is None:
            return "joined"
        if known.info.incarnation and info.incarnation and known.info.incarnation != info.incarnation:
            return "restarted"
        return None

    def _learn(self, info: WorkerInfo) -> None:
        """A measurement not seen before teaches the instance's factor (against the profile)."""
        report = info.prefill or info.decode
        m = report.measured if report is not None else None
        if m is None or self.perf is None or self._measured.get(info.instance_id) == m.seq:
            return
        self._measured[info.instance_id] = m.seq
        if info.prefill is not None:
            predicted, kind = self.perf.prefill.seconds(m.tokens, m.prefix_tokens), "prefill"
        else:
            predicted, kind = self.perf.decode.step_seconds(max(1, m.batch), m.tokens), "step"
        self.learned.observe(info.instance_id, kind, predicted, m.seconds)

    @staticmethod
    def _held_ids(info: WorkerInfo) -> list[str]:
        if info.prefill is not None:
            return info.prefill.held
        if info.decode is not None:
            return [j.request_id for j in info.decode.joined]
        return []

    def refresh(self, now: float) -> None:
        """Count every instance as just heard from (the silence was our own broker connection's)."""
        for known in self.instances.values():
            known.seen_at = known.alive_at = now
            known.gaps.clear()
        self.changed()  # the views count from the reports' times, which just moved

    def alive(self, instance_id: str, incarnation: str, now: float) -> None:
        """A liveness beacon: the instance is busy, not dead, even while its reports come late."""
        known = self.instances.get(instance_id)
        if known is not None and (not incarnation or incarnation == known.info.incarnation):
            known.signal(now)

    def expire(self, now: float) -> list[WorkerInfo]:
        """Forget instances silent (no report, no beacon) past their deadline; returns them."""
        gone = [i.info for i in self.instances.values() if now - i.alive_at > i.deadline(self.timeout_s)]
        return self._forget(gone, now)

    def dead(self, instance_id: str, now: float) -> list[WorkerInfo]:
        """Its process exited (a supervisor saw it): forget it now; returns it, if it was known. One
        that had left cleanly (a drain, then the exit) is being restarted by that supervisor: its
        capacity counts as lost (`recovering`) until it is heard again."""
        known, gone = self.instances.get(instance_id), self.departed.get(instance_id)
        if known is None and gone is not None and not gone.lost:
            self._departs(instance_id, Departure(gone.role, True, now))
        return self._forget([known.info] if known is not None else [], now)

    def recovering(self, role: str, now: float) -> bool:
        """Capacity of `role` that is gone for now, not for good: an instance lost lately
        (RECOVERY_S) and not heard from since, one draining (a restart's first half), or one on a
        node whose messenger was lost lately (it cannot move KV until its messenger is back). With
        no other instance of the role, that is an overload (429 with a Retry-After), not a cluster
        without the role (503). One that came back, or left cleanly with no supervisor seeing its
        exit (an operator's stop), is not pending."""
        cut_off = {node for node, at in self.lost_nodes.items() if now - at <= RECOVERY_S}
        return any(d.lost and d.role == role and now - d.at <= RECOVERY_S for d in self.departed.values()) \
            or any(i.info.role == role and (i.info.draining or i.info.node in cut_off) for i in self.instances.values())

    def _departs(self, instance_id: str, how: Departure) -> None:
        self.departed.pop(instance_id, None)  # to the end: the oldest departure is forgotten first
        self.departed[instance_id] = how
        if len(self.departed) > DEPARTED_KEPT:
            del self.departed[next(iter(self.departed))]

    def _forget(self, gone: list[WorkerInfo], now: float) -> list[WorkerInfo]:
        for info in gone:
            del self.instances[info.instance_id]
            self._held.pop(info.instance_id, None)  # what it held is handed back (lost_with), not ended
            self._departs(info.instance_id, Departure(info.role, True, now))
            if info.role == "messenger":
                self.lost_nodes[info.node] = now
                self.node_holders.release(info.node, info.instance_id)
        if gone:
            self.changed()
        return gone

    def of_role(self, role: str) -> list[WorkerInfo]:
        """Instances of a role that take new work (a draining one finishes what it holds, nothing more;
        one whose node lost its messenger cannot move KV), by id."""
        instances = self.instances
        return [instances[i].info for i in self._of_role(role)]

    def _of_role(self, role: str) -> list[str]:
        """of_role's ids, kept until an instance joins, leaves, or changes role, node or draining, or a
        node's messenger comes or goes."""
        ids = self._members.get(role)
        if ids is None:
            ids = self._members[role] = sorted(i for i, known in self.instances.items() if known.info.role == role
                                               and not known.info.draining and known.info.node not in self.lost_nodes)
        return ids

    def get(self, instance_id: str) -> WorkerInfo | None:
        known = self.instances.get(instance_id)
        return known.info if known else None

    # --- what this conductor did, and what ended ------------------------------------------------------
    def route(self, request: Routed) -> None:
        before = self.routed.get(request.request_id)  # its earlier attempt, bound for another instance maybe
        self.routed[request.request_id] = request
        if before is not None:  # it keeps its earlier attempt's place in self.routed: summed again in that order
            self._transit_s = self._queued_bytes = None
        elif self._transit_s is not None:  # the last of self.routed: its work is added last, as a walk would
            self._enters_transit(request)
        self._unheld.pop(request.request_id, None)  # a new attempt: whoever held the last one does not matter
        if self._bound is not None:
            if before is not None:
                self._bound[before.decode_id].discard(request.request_id)
            self._bound.setdefault(request.decode_id, set()).add(request.request_id)
        self.touched((request.decode_id, before.decode_id) if before is not None else (request.decode_id,))

    def policy_settings(self, settings: PolicySettings) -> PolicySettings:
        """`settings` with the balancing threshold learned so far (the same object until it moves)."""
        if settings.kvcache_balancing_threshold == self.threshold.value:
            return settings
        return replace(settings, kvcache_balancing_threshold=self.threshold.value)

    def prefilled(self, request_id: str, attempt: int, now: float | None = None) -> None:
        """Its prefill ended (at `now`: an outcome the balancing threshold and the TTFT margin learn from)."""
        request = self.routed.get(request_id)
        if request is not None and request.attempt == attempt:
            if now is not None and not request.prefilled and request.attempt == 0:
                self.threshold.observe(bool(request.pull_source), request.ttft_s, now - request.routed_at)
                self.ttft_margin.observe(request.ttft_s, now - request.routed_at)
            self._left_transit(request)
            request.prefilled = True
            request.pull_bytes = 0
            self.touched((request.decode_id,))

    def unstarted(self, request_id: str, attempt: int, now: float) -> Routed | None:
        """Its prefill instance found at `now` that it could no longer begin it in time for its
        TTFT SLO (common/decide/admission.py `late_start`), and rejected it. The TTFT it would have
        had, its wait so far and then its predicted work, is an outcome the TTFT margin learns from:
        without it the margin would learn only from the requests fast enough to be served. It ends."""
        request = self.routed.get(request_id)
        if request is None or request.attempt != attempt:
            return None
        if request.attempt == 0 and not request.prefilled:
            self.ttft_margin.observe(request.ttft_s, now + request.prefill_s - request.routed_at)
        return self.end(request_id)

    def end(self, request_id: str, up_to_attempt: int | None = None) -> Routed | None:
        """The request ended (or, with up_to_attempt, those of its attempts were abandoned)."""
        request = self.routed.get(request_id)
        if request is None or (up_to_attempt is not None and request.attempt > up_to_attempt):
            return None
        self.touched((request.decode_id,))
        self._left_transit(request)
        if self._bound is not None:
            self._bound[request.decode_id].discard(request_id)
        return self.routed.pop(request_id)

    def lost_with(self, instance_id: str) -> list[Routed]:
        """Our requests that cannot finish because `instance_id` is gone; they are removed."""
        lost = [r for r in self.routed.values()
                if (not r.prefilled and instance_id in r.prefill_ids) or r.decode_id == instance_id]
        for request in lost:
            del self.routed[request.request_id]
        self.changed()
        return lost

    def expire_unheld(self, now: float) -> list[Routed]:
        """Our requests that the instance last holding them has not reported for UNHELD_S, and no
        other has since: they ended and their end message was lost. Removed and returned."""
        ended = []
        for rid, since in list(self._unheld.items()):
            if now - since >= UNHELD_S:
                del self._unheld[rid]
                request = self.routed.pop(rid, None)
                if request is not None:
                    ended.append(request)
        if ended:
            self.changed()
        return ended

    def expire_leases(self, now: float) -> list[Routed]:
        old = [r for r in self.routed.values() if now - r.routed_at > self.lease_s]
        for request in old:
            del self.routed[request.request_id]
        if old:
            self.changed()
        return old

    # --- the views the policy and admission take ----------------------------------------------------
    def _report(self, instance_id: str) -> tuple[WorkerInfo | None, float]:
        known = self.instances.get(instance_id)
        return (known.info, known.seen_at) if known else (None, 0.0)

    def _in_transit(self, r: Routed, instance_id: str) -> bool:
        """Routed to the instance by us and not (yet) in its report."""
        return instance_id not in r.seen_by

    def prefill_queue_s(self, instance_id: str, now: float) -> float:
        known = self.instances.get(instance_id)
        reported = _reported_queue_s(known, now) if known is not None else 0.0
        return reported + self._in_transit_s().get(instance_id, 0.0)

    def _in_transit_s(self) -> dict[str, float]:
        """prefill_id -> predicted work of ours that its report does not hold yet."""
        if self._transit_s is None:
            self._walk_routed()
        elif self._transit_stale:
            transit = self._transit_s
            for p in self._transit_stale:
                requests = self._transit_of.get(p)
                if requests:
                    total = 0.0  # as _walk_routed sums them: from 0.0, in self.routed's order
                    for r in requests.values():
                        total = total + r.prefill_s
                    transit[p] = total
                else:
                    transit.pop(p, None)
                    self._transit_of.pop(p, None)
            self._transit_stale = set()
        return self._transit_s

    def _walk_routed(self) -> None:
        """Our work in transit per prefill instance and the bytes pulled per sender node, in one pass
        over our requests: after `changed` (or an attempt routed again); from then on each request
        of ours that enters or leaves changes them (_enters_transit, _left_transit)."""
        transit: dict[str, float] = {}
        of: dict[str, dict[str, Routed]] = {}
        queued: dict[str, int] = {}
        for rid, r in self.routed.items():
            if not r.prefilled:
                seen_by = r.seen_by
                for p in r.prefill_ids:
                    if p not in seen_by:  # in transit: routed there by us, not in its report yet
                        transit[p] = transit.get(p, 0.0) + r.prefill_s
                        of.setdefault(p, {})[rid] = r
                if r.pull_bytes:
                    queued[r.pull_source] = queued.get(r.pull_source, 0) + r.pull_bytes
        self._transit_s, self._transit_of, self._transit_stale, self._queued_bytes = transit, of, set(), queued

    def _enters_transit(self, r: Routed) -> None:
        """A new request of ours, the last of self.routed: its work and its pull added last."""
        if r.prefilled:
            return
        transit, seen_by = self._transit_s, r.seen_by
        for p in r.prefill_ids:
            if p not in seen_by:
                transit[p] = transit.get(p, 0.0) + r.prefill_s
                self._transit_of.setdefault(p, {})[r.request_id] = r
        if r.pull_bytes and self._queued_bytes is not None:
            queued = self._queued_bytes
            queued[r.pull_source] = queued.get(r.pull_source, 0) + r.pull_bytes

    def _left_transit(self, r: Routed) -> None:
        """A request of ours prefilled or ended: out of its instances' transit (each summed again,
        when next read, over the requests left: floats taken away would not give the same sum) and
        its pull out of its sender's bytes (integers: taken away exactly)."""
        if r.prefilled or self._transit_s is None:
            return
        transit_of = self._transit_of
        for p in r.prefill_ids:
            requests = transit_of.get(p)
            if requests is not None and requests.get(r.request_id) is r:
                del requests[r.request_id]
                self._transit_stale.add(p)
        queued = self._queued_bytes
        if r.pull_bytes and queued is not None:
            left = queued[r.pull_source] - r.pull_bytes
            if left:
                queued[r.pull_source] = left
            else:
                del queued[r.pull_source]

    def prefill_candidates(self, now: float, avoid: Collection[str] = ()) -> tuple[PrefillCandidate, ...]:
        """`avoid`: instances a request's failed attempts used, left out where others remain.
        (Every route builds every prefill candidate: their queues count down with `now`.)"""
        transit, rows, out = self._in_transit_s().get, self._prefill_rows, []
        if self._rows_version != self.learned.version:  # a factor moved (a peer's can move every one's)
            rows.clear()
            self._rows_version = self.learned.version
        append = out.append
        for instance_id in self._of_role("prefill"):
            row = rows.get(instance_id)
            if row is None:
                row = rows[instance_id] = self._prefill_row(instance_id)
            node, queue_s, seen_at, speed = row
            # NOTE: as _reported_queue_s computes it, term by term (the same floats)
            append(_new_row(PrefillCandidate, (instance_id, node, (0.0 if queue_s is None else
                                                                   max(0.0, queue_s - (now - seen_at)))
                                               + transit(instance_id, 0.0), speed)))
        return _elsewhere(tuple(out), avoid)

    def _prefill_row(self, instance_id: str) -> tuple[str, float | None, float, float]:
        """What a prefill instance's candidate takes of its report: its node, the queue it reported
        (None: no report), when, and its learned speed."""
        known = self.instances[instance_id]
        report = known.info.prefill
        return (known.info.node, report.queue_s if report is not None else None, known.seen_at,
                self.learned.factor(instance_id, "prefill"))

    def coming_to(self, decode_id: str) -> list[tuple[float, int, int, int]]:
        """(predicted prefill end, context, max tokens, output hint), in time order, of every request that will join
        `decode_id` and that it does not hold yet: those held by a prefill instance, and ours on
        the bus or in transfer (a prefilled one counts from its predicted prefill end)."""
        coming = self._coming.get(decode_id)
        if coming is None:
            reported, held_by_prefill = self._from_prefill_reports()
            coming = list(reported.get(decode_id, ()))
            for r in self._ours_coming(decode_id, held_by_prefill):
                coming.append((r.routed_at + r.ttft_s, r.prompt_tokens, r.max_tokens, r.expected_tokens))
            coming.sort()
            self._coming[decode_id] = coming
        return coming

    def _coming_totals(self, decode_id: str) -> tuple[int, int, int]:
        """(how many, their context, the room decode will reserve for them: prompt + max_tokens) of
        what `coming_to` lists, from the prefill reports' sums and our own requests in transit: no
        list made, none sorted (a decode candidate needs only these)."""
        sums = self._coming_sums.get(decode_id)
        if sums is None:
            _, held_by_prefill = self._from_prefill_reports()
            count, tokens, room = self._reported_totals.get(decode_id) or (0, 0, 0)
            for r in self._ours_coming(decode_id, held_by_prefill):
                count, tokens, room = count + 1, tokens + r.prompt_tokens, room + r.prompt_tokens + r.max_tokens
            sums = self._coming_sums[decode_id] = count, tokens, room
        return sums

    def _ours_coming(self, decode_id: str, held_by_prefill: dict[str, int]) -> list[Routed]:
        """Our requests bound for `decode_id` that will join it and that no report holds there yet:
        on the bus, in a prefill no report names, in transfer (`held_by_prefill`: the request ids the
        prefill reports hold)."""
        bound = self._bound_to().get(decode_id)
        if not bound:
            return []
        routed = self.routed
        return [r for r in map(routed.__getitem__, bound)
                if r.joins_decode and r.request_id not in held_by_prefill and decode_id not in r.seen_by]

    def _from_prefill_reports(self) -> tuple[dict[str, list[tuple[float, int, int, int]]], dict[str, int]]:
        """What every prefill report says will join each decode instance (decode_id -> entries, in
        no order), and the request ids they hold (-> how many reports hold each). Only the instances
        heard since it was last read are read again: their entries out, their new ones in."""
        if self._reported_coming is None:
            self._reported_coming, self._held_by_prefill, self._reported_of = {}, {}, {}
            self._reported_totals = {}
            self._reports_stale = set()
            for instance_id, known in self.instances.items():
                if known.info.prefill is not None:
                    self._add_reported(instance_id, known)
        elif self._reports_stale:
            for instance_id in self._reports_stale:
                self._drop_reported(instance_id)
                known = self.instances.get(instance_id)
                if known is not None and known.info.prefill is not None:
                    self._add_reported(instance_id, known)
            self._reports_stale.clear()
        return self._reported_coming, self._held_by_prefill

    def _add_reported(self, instance_id: str, known: Instance) -> None:
        reported, held, totals = self._reported_coming, self._held_by_prefill, self._reported_totals
        seen_at = known.seen_at
        mine = []
        for c in known.info.prefill.coming:
            held[c.request_id] = held.get(c.request_id, 0) + 1
            tokens = c.tokens
            entry = (seen_at + c.finish_in_s, tokens, c.max_tokens, c.expected_tokens)
            mine.append((c.decode_id, c.request_id, entry))
            entries = reported.get(c.decode_id)
            if entries is None:
                reported[c.decode_id] = [entry]
                totals[c.decode_id] = [1, tokens, tokens + c.max_tokens]
            else:
                entries.append(entry)
                total = totals[c.decode_id]
                total[0] += 1
                total[1] += tokens
                total[2] += tokens + c.max_tokens
        self._reported_of[instance_id] = mine

    def _drop_reported(self, instance_id: str) -> None:
        """Its entries out (each list is a multiset: an equal entry of another instance's may go in
        its place, which leaves the same values)."""
        gone = self._reported_of.pop(instance_id, None)
        if not gone:
            return
        reported, held, totals = self._reported_coming, self._held_by_prefill, self._reported_totals
        for decode_id, rid, entry in gone:
            entries = reported[decode_id]
            if len(entries) == 1:
                del reported[decode_id]
                del totals[decode_id]
            else:
                entries.remove(entry)
                total = totals[decode_id]
                total[0] -= 1
                total[1] -= entry[1]
                total[2] -= entry[1] + entry[2]
            left = held[rid] - 1
            if left:
                held[rid] = left
            else:
                del held[rid]

    def _bound_to(self) -> dict[str, set[str]]:
        """decode_id -> our requests bound for it (kept up to date by route and end)."""
        if self._bound is None:
            bound: dict[str, set[str]] = {}
            for r in self.routed.values():
                bound.setdefault(r.decode_id, set()).add(r.request_id)
            self._bound = bound
        return self._bound

    def decode_candidates(self, now: float, avoid: Collection[str] = ()) -> tuple[DecodeCandidate, ...]:
        """`avoid`: as for prefill_candidates."""
        out = []
        kept = self._decode_candidates
        for instance_id in self._of_role("decode"):
            candidate = kept.get(instance_id)
            if candidate is None:
                candidate = kept[instance_id] = self._build_decode_candidate(self.instances[instance_id].info)
            out.append(candidate)
        return _elsewhere(tuple(out), avoid)

    def _build_decode_candidate(self, d: WorkerInfo) -> DecodeCandidate:
        instance_id = d.instance_id
        coming, coming_tokens, coming_room = self._coming_totals(instance_id)  # room: prompt + max_tokens
        reported = self._decode_reported.get(instance_id)
        if reported is None:
            reported = self._decode_reported[instance_id] = _decode_reported(d.decode)
        held, context, kv_free = reported
        return _new_row(DecodeCandidate, (instance_id, d.node, held + coming,
                                          context + coming_tokens, kv_free - coming_room if kv_free is not None else None,
                                          self.learned.factor(instance_id, "step")))

    def decode_load(self, decode_id: str) -> DecodeLoad:
        """Admission's view: who decodes there since when, who will join and when. Its times are
        absolute, so it needs no clock and stays valid until a report or one of our requests
        touches the instance (`touched`); made when first asked for (admission.DecodeLoads)."""
        load = self._decode_loads.get(decode_id)
        if load is None:
            load = self._decode_loads[decode_id] = self._build_decode_load(decode_id)
        return load

    def _build_decode_load(self, decode_id: str) -> DecodeLoad:
        """Each request's leave time: now (its report) plus the tokens it will still generate
        (self.outputs) times the instance's step time with everything held and coming in its batch."""
        known = self.instances.get(decode_id)
        seen_at, report = (known.seen_at, known.info.decode) if known is not None else (0.0, None)
        coming = self._coming.get(decode_id)
        if coming is None:
            coming = self.coming_to(decode_id)
        factor = self.learned.factor(decode_id, "step")
        step_s = self._step_s(decode_id, report, factor)
        kept = self._outputs_of.get(decode_id) or self._reported_outputs(decode_id, report)
        if kept.step_s != step_s or kept.seen_at != seen_at:  # (a NaN step: made again every time)
            # NOTE: a prefill's report that only moves when its requests finish keeps the step
            # (batch and context coming are the same): the leave times are kept with it
            kept.leaves, kept.step_s, kept.seen_at = tuple([seen_at + step_s * n for n in kept.outputs]), step_s, seen_at
        # NOTE: list comprehensions and one loop, not generators: this runs for every decode instance a report touches
        if coming:
            remaining = self.outputs.remaining
            joins, join_context, join_room, join_leaves = [], [], [], []
            for finish, context, max_tokens, hint in coming:
                joins.append(finish)
                join_context.append(context)
                join_room.append(context + max_tokens)  # as decode_candidates counts their room
                join_leaves.append(finish + step_s * (remaining(1, max_tokens, hint) if max_tokens
                                                      else UNKNOWN_OUTPUT_TOKENS))
            joins, join_context, join_room, join_leaves = (tuple(joins), tuple(join_context), tuple(join_room),
                                                          tuple(join_leaves))
        else:
            joins = join_context = join_room = join_leaves = ()
        # leave times ascending without a NaN (the outputs are, and the step is a finite non-negative time)
        orderly = kept.nonnegative and 0.0 <= step_s < _INF
        return DecodeLoad.of(decode_id, kept.leaves, kept.contexts, joins, join_leaves, join_context, factor, kept.rooms,
                             join_room, kept.cum, orderly)

    def _reported_outputs(self, decode_id: str, report: DecodeReport | None) -> _Outputs:
        """What each request of the instance's report will still generate, ascending (they leave in
        that order, whatever its step time), their contexts, and the KV room each gives back as it
        leaves (its reservation: its KV and what it may still generate), and the running sums of
        the contexts (DecodeLoad's); waiting ones count as decoding. Kept until the instance's next
        report: what completed requests teach about output lengths (self.outputs) reaches it then."""
        remaining = self.outputs.remaining
        rows = []
        append = rows.append
        for j in (report.joined if report is not None else ()):
            max_tokens, generated, tokens = j.max_tokens, j.generated, j.tokens
            append(((remaining(generated, max_tokens, j.expected_tokens) if max_tokens else UNKNOWN_OUTPUT_TOKENS),
                    tokens, tokens + (max_tokens - generated if max_tokens > generated else 0)))
        rows.sort()
        if rows:
            outputs, contexts, rooms = zip(*rows)
        else:
            outputs = contexts = rooms = ()
        kept = self._outputs_of[decode_id] = _Outputs(outputs, contexts, rooms, tuple(accumulate(contexts, initial=0)),
                                                      min(contexts, default=0) >= 0)
        return kept

    def _step_s(self, decode_id: str, report: DecodeReport | None, factor: float) -> float:
        """One step of the instance with everything it holds and everything coming to it (`factor`: its learned one)."""
        if self.perf is None:
            return report.predicted_tbt_s if report is not None and report.predicted_tbt_s > 0 else DEFAULT_STEP_S
        coming, coming_tokens, _ = self._coming_totals(decode_id)
        batch = (len(report.joined) if report is not None else 0) + coming
        context = (report.context_tokens if report is not None else 0) + coming_tokens
        return self.perf.decode.step_seconds(batch if batch > 1 else 1, context) * factor

    def completed(self, generated: int) -> None:
        """A request finished after `generated` tokens: it teaches how long requests run."""
        self.outputs.observe(generated)

    def sender_queued_bytes(self) -> dict[str, int]:
        """node -> bytes our requests still in prefill are pulling from it (kept until one of ours
        changes; the caller only reads it)."""
        if self._queued_bytes is None:
            self._walk_routed()
        return self._queued_bytes

    def largest_decode_room(self) -> int | None:
        """The most KV tokens any decode instance holds in all (used + free, as it reports them);
        None when none reports a limit. Kept until a report changes it (_largest_after)."""
        if self._capacity is None:
            rooms = [room for room in map(_decode_room, (i.info for i in self.instances.values())) if room is not None]
            self._capacity = (max(rooms) if rooms else None,)
        return self._capacity[0]

    def decode_running(self, decode_id: str) -> int:
        info, _ = self._report(decode_id)
        return info.decode.running if info is not None and info.decode is not None else 0


class _Outputs:
    """A decode instance's reported requests as its admission view takes them (ClusterState._reported_outputs),
    and the leave times last made of them at one step time."""

    __slots__ = ("outputs", "contexts", "rooms", "cum", "nonnegative", "step_s", "seen_at", "leaves")

    def __init__(self, outputs: tuple[float, ...], contexts: tuple[int, ...], rooms: tuple[int, ...],
                 cum: tuple[int, ...], nonnegative: bool) -> None:
        self.outputs, self.contexts, self.rooms, self.cum = outputs, contexts, rooms, cum
        self.nonnegative = nonnegative  # no context negative
        self.step_s: float | None = None  # the leave times' step and report time (None: none made yet)
        self.seen_at = 0.0
        self.leaves: tuple[float, ...] = ()


_INF = float("inf")


def _decode_reported(report: DecodeReport | None) -> tuple[int, int, int | None]:
    """What a decode instance's candidate takes of its report: the requests it holds, their context
    (the batch's, then those waiting for room in it) and its free KV room."""
    if report is None:
        return 0, 0, None
    joined = report.joined
    return len(joined), report.context_tokens + sum([j.tokens for j in joined[report.running:]]), report.kv_free_tokens


def _decode_room(info: WorkerInfo | None) -> int | None:
    """The KV tokens a decode instance holds in all (used + free, as it reports them); None without a limit."""
    report = info.decode if info is not None else None
    if report is None or report.kv_free_tokens is None:
        return None
    return report.kv_used_tokens + report.kv_free_tokens


def _largest_after(kept: tuple[int | None] | None, before: int | None, after: int | None) -> tuple[int | None] | None:
    """The largest decode room kept (ClusterState.largest_decode_room) after one instance's went from
    `before` to `after`: the same while that instance did not hold it and does not pass it; else
    None, made again over every instance when next asked (also when the instance was refused)."""
    if kept is None:
        return None
    largest = kept[0]
    if largest is None:
        return kept if after is None else None
    if (before is not None and before >= largest) or (after is not None and after > largest):
        return None
    return kept


def _reported_queue_s(known: Instance, now: float) -> float:
    """A prefill instance's queue as its last report said, counted down since then."""
    report = known.info.prefill
    return max(0.0, report.queue_s - (now - known.seen_at)) if report is not None else 0.0


def _elsewhere(candidates: tuple, avoid: Collection[str]) -> tuple:
    """The candidates not in `avoid`; all of them if that leaves none."""
    if not avoid:
        return candidates
    return tuple(c for c in candidates if c.instance_id not in avoid) or candidates
