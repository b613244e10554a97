"""Overload admission: admit or reject a routed request at arrival (docs/architecture.md, "The conductor": overload admission).

Goodput counts only requests that meet both SLOs, and a request rejected after its prefill wasted
that prefill, so the conductor predicts. Modes (AdmissionSettings.mode):

    none        admit everything
    baseline    reject if predicted TTFT (of the policy's p*) > ttft_slo_s. Nothing else at
                arrival: the decode instance re-checks TBT when the KV arrives (`late_verdict`)
                and may reject then, late, with the prefill wasted.
    early       baseline, and also reject if the decode pool's CURRENT load already breaks the
                TBT SLO: min over decode instances of tbt(batch + 1, context + this prompt) >
                tbt_slo_s. It acts on decode load one prefill-duration too early, which makes
                prefill and decode load oscillate in anti-phase.
    predictive  baseline, and also reject if the decode load AT THE MOMENT THIS PREFILL FINISHES
                (T = now + ttft) breaks the TBT SLO. That load is predicted from the snapshot
                (per decode instance, a DecodeLoad: join and leave times and context lengths):
                    + requests in prefill that finish by T (they will have joined decode)
                    - decoding requests that will have left by T
                Each request leaves after its own predicted remaining output (the paper assumed
                one uniform decode time; common/decide/outputs.py estimates each request's from
                its max_tokens, a client hint and the lengths of recent completions), at the
                instance's learned step time. This damps the oscillation. Its TTFT check
                multiplies the predicted TTFT by the learned margin (common/decide/learn.py
                TtftMargin: how much later than predicted first tokens came, near the SLO), so
                that what it admits is served within the SLO, not just predicted within it.

A deadline at the prefill's start (`ttft_deadline`, `late_start`): admission predicts the queue a
request joins, but the queue can change behind that prediction. When an instance is lost, the
requests it held are resumed at their arrival's place in the queues (common/decide/queue_order.py),
ahead of those admitted after them; a prediction can also simply miss. So each admitted request
carries the time its first token is due, and a prefill instance about to start one that its
predicted work would bring past that time rejects it instead (a late rejection that wastes no
prefill: the queue behind it starts sooner). Admission "none" sets no deadline; a request
resumed after its first token has none (it came), nor has a pipelined one (the conductor's
choice: its stages must run in the same order on every instance). One re-dispatched before its
first token keeps its deadline.

Retry-After on a rejection: for TTFT, the excess (ttft - slo), since a queue drains one second
of work per second; for TBT, the time from the evaluated moment until departures alone bring
the best instance under the SLO (arrivals after it are ignored, so it is optimistic). Both are
clamped to [min_retry_after_s, max_retry_after_s].

The module is pure: no I/O, no clock; the snapshot carries `now`.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field, replace
from heapq import merge
from itertools import accumulate
from operator import itemgetter
from typing import Callable, Iterator, Sequence

from common.decide.perf import Profile
from common.decide.policy import Decision, DecodeCandidate

MODES = ("none", "baseline", "early", "predictive")


@dataclass(frozen=True, slots=True)
class AdmissionSettings:
    mode: str = "predictive"
    ttft_slo_s: float = 10.0
    tbt_slo_s: float = 0.25
    min_retry_after_s: float = 1.0
    max_retry_after_s: float = 60.0
    # predictive: the share of admitted requests whose first token should come within the TTFT SLO;
    # the learned margin is that quantile of actual / predicted TTFT (0: no margin)
    ttft_quantile: float = 0.9

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"admission mode {self.mode!r} is not one of {MODES}")
        if not 0 <= self.ttft_quantile < 1:
            raise ValueError("ttft_quantile must be within [0, 1)")
        for name in ("ttft_slo_s", "tbt_slo_s", "min_retry_after_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        if self.max_retry_after_s < self.min_retry_after_s:
            raise ValueError("max_retry_after_s must be >= min_retry_after_s")


@dataclass(frozen=True, slots=True)
class DecodeLoad:
    """One decode instance's requests as the conductor predicts them: when each will leave (and,
    for those still in prefill, when each will join), with its context. Times are absolute.

    Each request's leave time is its own (common/decide/outputs.py: the tokens it will still
    generate, times the instance's step time), not a uniform decode time.
    NOTE: the conductor rebuilds it only when a request joins or leaves (not per decision);
    sorted times let a prediction bisect instead of scanning.
    """

    decode_id: str
    leaves: tuple[float, ...] = ()  # requests decoding (or waiting for room) now: when each leaves, ascending
    leave_context: tuple[int, ...] = ()
    joins: tuple[float, ...] = ()  # requests coming here (in prefill): when each joins, ascending
    join_leaves: tuple[float, ...] = ()  # ... and when each of those leaves
    join_context: tuple[int, ...] = ()
    step_factor: float = 1.0  # its steps take the profile's prediction times this (learned)
    leave_room: tuple[int, ...] = ()  # ... and the KV room each gives back as it leaves (() = its context)
    join_room: tuple[int, ...] = ()  # the room each coming request takes when it joins and gives back as it leaves
    _cum: tuple[int, ...] = field(init=False, repr=False, compare=False)  # running sums of leave_context
    # leaves ascending without a NaN, and no context negative: what lets the Retry-After scan take a
    # run of departures at one time in one step (_tbt_retry_after)
    _orderly: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.leaves) != len(self.leave_context) or not (len(self.joins) == len(self.join_leaves) == len(self.join_context)) \
                or (self.leave_room and len(self.leave_room) != len(self.leaves)) \
                or (self.join_room and len(self.join_room) != len(self.joins)):
            raise ValueError(f"DecodeLoad {self.decode_id}: times and contexts differ in length")
        object.__setattr__(self, "_cum", tuple(accumulate(self.leave_context, initial=0)))
        leaves = self.leaves
        object.__setattr__(self, "_orderly", all([a <= b for a, b in zip(leaves, leaves[1:])])  # (False at a NaN)
                           and (not leaves or leaves[0] == leaves[0]) and min(self.leave_context, default=0) >= 0)

    @classmethod
    def of(cls, decode_id: str, leaves: tuple[float, ...], leave_context: tuple[int, ...], joins: tuple[float, ...],
           join_leaves: tuple[float, ...], join_context: tuple[int, ...], step_factor: float,
           leave_room: tuple[int, ...], join_room: tuple[int, ...], cum: tuple[int, ...], orderly: bool) -> DecodeLoad:
        """One built by a caller that guarantees what __post_init__ checks (the lengths agree) and
        passes the running sums of leave_context (initial 0) it keeps, and whether the leaves are
        ascending without a NaN and no context is negative: the conductor rebuilds a few of these
        per route (common/decide/cluster_state.py)."""
        load = _new_object(cls)
        _set(load, "decode_id", decode_id)
        _set(load, "leaves", leaves)
        _set(load, "leave_context", leave_context)
        _set(load, "joins", joins)
        _set(load, "join_leaves", join_leaves)
        _set(load, "join_context", join_context)
        _set(load, "step_factor", step_factor)
        _set(load, "leave_room", leave_room)
        _set(load, "join_room", join_room)
        _set(load, "_cum", cum)
        _set(load, "_orderly", orderly)
        return load

    def at(self, t: float, predictive: bool) -> tuple[int, int]:
        """(batch, context tokens) now (predictive=False) or predicted at time t (predictive=True)."""
        cum = self._cum
        if not predictive:
            return len(self.leaves), cum[-1]
        k = bisect_right(self.leaves, t)  # those gone by t
        batch, context = len(self.leaves) - k, cum[-1] - cum[k]
        for joins, leaves, c in zip(self.joins, self.join_leaves, self.join_context):
            if joins > t:
                break
            if leaves > t:
                batch, context = batch + 1, context + c
        return batch, context

    def departures(self, t: float, predictive: bool) -> Iterator[tuple[float, int]]:
        """(leave time, context) of the requests counted by `at(t)`, in leave order, lazily: the
        callers stop at the first departure that settles their question."""
        k = bisect_right(self.leaves, t) if predictive else 0
        now = zip(self.leaves[k:], self.leave_context[k:])
        if not predictive:
            return now
        joined = sorted((leaves, c) for joins, leaves, c in zip(self.joins, self.join_leaves, self.join_context)
                        if joins <= t < leaves)
        return merge(now, joined) if joined else now


_new_object = object.__new__
_set = object.__setattr__


@dataclass(frozen=True, slots=True)
class DecodeLoadSnapshot:
    now: float
    decode: tuple[DecodeLoad, ...]  # every live decode instance


@dataclass(frozen=True, slots=True)
class DecodeLoads:
    """The decode loads a route may judge, each made when first asked for (`load_of`): a request
    admitted on its policy's decode instance needs that instance's load alone (`judge`), and the
    conductor drops an instance's load at every report that touches it."""

    now: float
    ids: tuple[str, ...]  # every live decode instance, in the candidates' order
    load_of: Callable[[str], DecodeLoad]

    @classmethod
    def made(cls, snapshot: DecodeLoadSnapshot) -> DecodeLoads:
        """Loads already made (a test's, a caller that holds them all)."""
        by_id = {d.decode_id: d for d in snapshot.decode}
        return cls(snapshot.now, tuple(by_id), by_id.__getitem__)

    def snapshot(self, ids: Sequence[str]) -> DecodeLoadSnapshot:
        load_of = self.load_of
        return DecodeLoadSnapshot(self.now, tuple([load_of(i) for i in ids]))

    def every(self) -> tuple[DecodeLoad, ...]:
        """Every live decode instance's load, in the candidates' order."""
        load_of = self.load_of
        return tuple([load_of(i) for i in self.ids])


@dataclass(frozen=True, slots=True)
class Verdict:
    admit: bool
    reason: str
    stage: str = "arrival"
    retry_after_s: float = 0.0  # > 0 only when rejected
    ttft_s: float = 0.0  # the predicted TTFT judged
    tbt_s: float = 0.0  # predicted TBT on the best decode instance (0 when not evaluated)
    decode_id: str = ""  # the best decode instance at the evaluated moment ("" when not evaluated)


def admit(ttft_s: float, context_tokens: int, load: DecodeLoadSnapshot, settings: AdmissionSettings, perf: Profile,
          chosen: str = "", ttft_margin: float = 1.0) -> Verdict:
    """Judge a request whose prefill is predicted to end `ttft_s` from now (the policy's p*), at arrival.
    `chosen`: the policy's decode instance; when it meets the TBT SLO at the evaluated moment, the
    verdict names it, else the instance with the lowest TBT then. `ttft_margin` (predictive only):
    the predicted TTFT is judged times it (learned: TtftMargin)."""
    mode = settings.mode
    if mode == "none":
        return Verdict(True, "admission off", ttft_s=ttft_s)
    judged = ttft_s * ttft_margin if mode == "predictive" else ttft_s
    if judged > settings.ttft_slo_s:
        retry = clamp_retry_after(judged - settings.ttft_slo_s, settings)
        margin = f" (x{ttft_margin:.2f} margin: {judged:.3f}s)" if judged != ttft_s else ""
        return Verdict(False, f"ttft {ttft_s:.3f}s{margin} > slo {settings.ttft_slo_s:g}s", retry_after_s=retry,
                       ttft_s=ttft_s)
    if mode == "baseline":
        return Verdict(True, f"ttft {ttft_s:.3f}s within slo; decode checks tbt on kv arrival", ttft_s=ttft_s)
    if not load.decode:
        return Verdict(False, "no decode instance", retry_after_s=settings.min_retry_after_s, ttft_s=ttft_s)

    predictive = mode == "predictive"
    at = load.now + ttft_s if predictive else load.now
    step = perf.decode.step_seconds
    judged = []  # (tbt with this request, decode_id, batch, context, instance)
    append = judged.append
    mine = None
    for d in load.decode:
        if predictive:  # d.at(at, True), spelled out: this runs for every decode instance per route
            leaves, cum = d.leaves, d._cum
            k = bisect_right(leaves, at)  # those gone by then
            batch, context = len(leaves) - k, cum[-1] - cum[k]
            if d.joins:
                for joins, leaves_s, c in zip(d.joins, d.join_leaves, d.join_context):
                    if joins > at:
                        break
                    if leaves_s > at:
                        batch, context = batch + 1, context + c
        else:
            batch, context = len(d.leaves), d._cum[-1]
        row = (step(batch + 1, context + context_tokens) * d.step_factor, d.decode_id, batch, context, d)
        append(row)
        if mine is None and row[1] == chosen:
            mine = row
    best_tbt, best_id = min(judged, key=_by_tbt_then_id)[:2]
    if mine is not None and mine[0] <= settings.tbt_slo_s:
        best_tbt, best_id = mine[:2]
    when = f"at prefill end (+{ttft_s:.3f}s)" if predictive else "now"
    if best_tbt <= settings.tbt_slo_s:
        return Verdict(True, f"tbt {best_tbt:.4f}s on {best_id} {when} within slo", ttft_s=ttft_s, tbt_s=best_tbt, decode_id=best_id)
    retry = _tbt_retry_after(at, context_tokens, judged, settings, perf, predictive)
    return Verdict(False, f"tbt {best_tbt:.4f}s on {best_id} {when} > slo {settings.tbt_slo_s:g}s",
                   retry_after_s=retry, ttft_s=ttft_s, tbt_s=best_tbt, decode_id=best_id)


_by_tbt_then_id = itemgetter(0, 1)


def judge(decision: Decision, context_tokens: int, loads: DecodeLoads, settings: AdmissionSettings,
          perf: Profile, colocate: bool = False, resumed: bool = False, ttft_margin: float = 1.0) -> tuple[Verdict, Decision]:
    """Admission of the policy's decision, and where the request goes if admitted: the policy's decode
    instance when it meets the TBT SLO at the moment judged (the prefill's end, predictively), else
    the one with the lowest TBT then. Only instances with KV room for the request are judged (and,
    colocated, only those on p*'s node). The policy ranks decode instances by the load they hold
    and will hold; admission looks at the load when this request joins, so without this a request
    admitted for one instance was sent to another, and rejected there when its KV arrived.
    `resumed`: a later attempt of a request admitted at its arrival (its instance was lost); its
    client already has a stream, so it is not judged again (it would be rejected for the very
    delay the loss caused, and its stream would end in an error).
    The policy's instance is judged first, alone: when it meets the TBT SLO, `admit` names it
    whatever the others' loads are, so theirs are made only when it does not (the same verdict)."""
    if resumed:
        return Verdict(True, "resumed: admitted at its arrival", ttft_s=decision.ttft_s), decision
    costs, ids = decision.decode_costs, loads.ids
    if not colocate and all([c.fits for c in costs]) and len(costs) == len(ids) \
            and all([c.instance_id == i for c, i in zip(costs, ids)]):
        eligible = ids  # every instance is eligible (the common case: the loads are the costs' instances)
    else:
        fit = {c.instance_id for c in costs if c.fits and (not colocate or c.node == decision.prefill_node)}
        eligible = tuple([i for i in ids if i in fit])
    chosen = decision.decode_id
    verdict = None
    if chosen in eligible:
        verdict = admit(decision.ttft_s, context_tokens, loads.snapshot((chosen,)), settings, perf, chosen=chosen,
                        ttft_margin=ttft_margin)
        if not verdict.admit and verdict.decode_id:  # the TBT SLO broke on it: the others are judged
            verdict = None
    if verdict is None:
        verdict = admit(decision.ttft_s, context_tokens, loads.snapshot(eligible), settings, perf, chosen=chosen,
                        ttft_margin=ttft_margin)
    if verdict.admit and verdict.decode_id and verdict.decode_id != decision.decode_id:
        cost = next(c for c in decision.decode_costs if c.instance_id == verdict.decode_id)
        decision = replace(decision, decode_id=cost.instance_id, decode_node=cost.node, tbt_s=cost.tbt_s,
                           reason=f"{decision.reason}; decode {cost.instance_id}: within the TBT SLO when the "
                                  f"prefill ends ({verdict.tbt_s:.4f}s)")
    return verdict, decision


def ttft_deadline(arrival_ts: float, settings: AdmissionSettings, holds_tokens: bool = False,
                  pipelined: bool = False) -> float:
    """When an admitted request's first token is due (0: no deadline), on its arrival's clock.
    An attempt resumed after its first token (`holds_tokens`: its client has tokens) has none:
    its first token came. One re-dispatched before it (its instance was lost) keeps the deadline:
    its client holds nothing yet, and a first token past the SLO is as late as a first attempt's.
    A pipelined prefill has none: its stages run in the same order on every instance of the
    group, so no stage may drop one."""
    return 0.0 if settings.mode == "none" or holds_tokens or pipelined else arrival_ts + settings.ttft_slo_s


def late_start(now: float, deadline: float, work_s: float) -> float:
    """Seconds by which a prefill begun `now` and predicted to take `work_s` (the conductor's
    prediction: prefill and transfer) would bring the first token past `deadline`; <= 0 when it
    would not, or when there is no deadline. Live (services/prefill/compute.py) and simulated alike."""
    return now + work_s - deadline if deadline > 0 else 0.0


def kv_reservation(kv_len: int, max_tokens: int, num_generated: int, max_context: int | None = None) -> int:
    """KV tokens a request reserves on a decode instance: its KV now plus one per step it may still
    run (each step feeds one token and yields the next), capped by the model's context."""
    tokens = kv_len + max(max_tokens - num_generated, 0)
    return tokens if max_context is None else min(tokens, max_context)


def late_verdict(state: DecodeCandidate, context_tokens: int, needed_tokens: int, budget_tokens: int | None,
                 perf: Profile, tbt_slo_s: float, check_tbt: bool = True) -> str:
    """The decode instance's check when a request's KV arrives, live and simulated alike: "" takes
    it (it waits for KV room, first come first served), else why it is rejected late: "tbt" (with it
    the batch's step breaks the TBT SLO; admission "none" does not check) or "kv" (its reservation,
    `needed_tokens`, exceeds the instance's whole KV budget: no departure would ever make room)."""
    if check_tbt and perf.decode.step_seconds(state.num_running + 1, state.context_tokens + context_tokens) \
            * state.step_factor > tbt_slo_s:
        return "tbt"
    if budget_tokens is not None and needed_tokens > budget_tokens:
        return "kv"
    return ""


def has_room(running: int, max_batch: int | None, reserved_tokens: int, needed_tokens: int,
             budget_tokens: int | None) -> bool:
    """A waiting request may join the batch now: a free row, and its reservation fits the budget."""
    return ((max_batch is None or running < max_batch)
            and (budget_tokens is None or reserved_tokens + needed_tokens <= budget_tokens))


def _tbt_retry_after(at: float, context_tokens: int, judged: list, settings: AdmissionSettings,
                     perf: Profile, predictive: bool) -> float:
    """Seconds after `at` until departures alone bring some decode instance under the TBT SLO.

    Instances are tried least loaded first, so `best` shrinks early and prunes the rest.
    """
    step, slo = perf.decode.step_seconds, settings.tbt_slo_s
    monotone = getattr(perf.decode, "monotone", None)
    runs = monotone is not None and monotone()
    best = settings.max_retry_after_s
    for _, _, batch, ctx, d in sorted(judged, key=_by_tbt_then_id):
        # d.departures(at, predictive), spelled out: its first departure alone often settles that
        # this instance cannot beat `best`, before any step is priced
        leaves = d.leaves
        k = bisect_right(leaves, at) if predictive else 0
        joined = sorted([(leaves_s, c) for joins, leaves_s, c in zip(d.joins, d.join_leaves, d.join_context)
                         if joins <= at < leaves_s]) if predictive and d.joins else None
        if k < len(leaves):
            first = leaves[k]  # (a NaN stays first, as merge yields it: never pruned, below)
            if joined and joined[0][0] < first:  # (joined holds no NaN: `at < NaN` is False)
                first = joined[0][0]
        elif joined:
            first = joined[0][0]
        else:
            continue  # nobody leaves
        if first - at >= best:  # as the loop below would find at its first departure (False for a NaN)
            continue
        if runs and d._orderly and d.step_factor >= 0 and (not joined or min(joined, key=_context)[1] >= 0):
            best = _by_runs(at, context_tokens, batch, ctx, d, k, joined, best, step, slo)
            continue
        now = zip(leaves[k:], d.leave_context[k:])
        for leave_s, c in merge(now, joined) if joined else now:
            if leave_s - at >= best:  # departures only get later: this instance cannot beat `best`
                break
            batch, ctx = batch - 1, ctx - c
            if step(batch + 1, ctx + context_tokens) * d.step_factor <= slo:
                best = leave_s - at
                break
    return clamp_retry_after(best, settings)


_context = itemgetter(1)


def _by_runs(at: float, context_tokens: int, batch: int, ctx: int, d: DecodeLoad, k: int,
             joined: list[tuple[float, int]] | None, best: float, step, slo: float) -> float:
    """_tbt_retry_after's scan of one instance, a run of departures at one time at a time: `best`,
    or the sooner time at which departures bring it under the SLO.

    NOTE: exact only where the step never falls as batch or context grows (perf.py `monotone`), the
    factor is not negative and the departures are in time order with no negative context
    (DecodeLoad._orderly, and `joined`'s): then every departure lowers the step, so the SLO is met
    after some departure of a run iff it is after the run's last, and that run's time is the answer
    the scan one departure at a time gives. Most of an instance often leaves at one time (requests
    of one output length): one step priced instead of one per departure.
    """
    leaves, cum, factor = d.leaves, d._cum, d.step_factor
    n, i = len(leaves), k
    nj, j = (len(joined), 0) if joined else (0, 0)
    while i < n or j < nj:
        t = leaves[i] if i < n else joined[j][0]  # the next run's time
        if j < nj and joined[j][0] < t:
            t = joined[j][0]
        if t - at >= best:  # departures only get later: this instance cannot beat `best`
            return best
        if i < n and leaves[i] == t:
            end = bisect_right(leaves, t, i)
            batch, ctx, i = batch - (end - i), ctx - (cum[end] - cum[i]), end
        while j < nj and joined[j][0] == t:
            batch, ctx, j = batch - 1, ctx - joined[j][1], j + 1
        if step(batch + 1, ctx + context_tokens) * factor <= slo:
            return t - at
    return best


def kv_retry_after(prompt_tokens: int, decode: Sequence[DecodeCandidate], loads: Sequence[DecodeLoad], now: float,
                   settings: AdmissionSettings) -> float:
    """No decode instance has KV room for the prompt: seconds until the first one frees enough, as
    its requests are predicted to leave (their context returns to its room)."""
    best = settings.max_retry_after_s
    for candidate, load in zip(decode, loads):
        missing = prompt_tokens - (candidate.kv_free_tokens or 0)
        for leave_s, context in load.departures(now, False):
            missing -= context
            if missing <= 0:
                best = min(best, leave_s - now)
                break
    return clamp_retry_after(best, settings)


def room_within(decode: Sequence[DecodeCandidate], loads: Sequence[DecodeLoad], now: float,
                horizon_s: float) -> tuple[DecodeCandidate, ...]:
    """The decode instances as a request finds them if it may wait up to `horizon_s` for KV room:
    each one's free room grown by the room its requests predicted to leave by then give back
    (their reservations; the requests coming to it count too, their room already taken in
    `kv_free_tokens`). The conductor routes by this snapshot when none has room now, so
    a request that will fit once running requests finish waits in that instance's queue (its KV
    arrives only when its prefill ends) instead of being refused at arrival."""
    out = []
    for candidate, load in zip(decode, loads):
        if candidate.kv_free_tokens is None:
            out.append(candidate)
            continue
        rooms = load.leave_room or load.leave_context
        freed = 0
        for leave_s, room in zip(load.leaves, rooms):  # ascending leave times
            if leave_s > now + horizon_s:
                break
            freed += room
        freed += sum(room for leave_s, room in zip(load.join_leaves, load.join_room) if leave_s <= now + horizon_s)
        out.append(candidate._replace(kv_free_tokens=candidate.kv_free_tokens + freed))
    return tuple(out)


def clamp_retry_after(seconds: float, settings: AdmissionSettings = AdmissionSettings()) -> float:
    """A Retry-After within the settings' bounds (the defaults where the caller has none)."""
    return min(max(seconds, settings.min_retry_after_s), settings.max_retry_after_s)
