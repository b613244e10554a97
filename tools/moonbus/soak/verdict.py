"""What a soak run proves: each request's outcome, exactly-once ends, leaks, and the exit status.

Pure: results, recorded events and probes of the cluster in, verdicts out (the unit tests feed
them made-up data). The rules:

    outcome      completed | 429 | 503 | failed (with a reason). 429 and 503 are answers to the
                 request itself (HTTP status, before any token: a stream begins with its first
                 token). A stream that ended in an error event after a token is failed, whatever
                 its code: the client got a broken answer (a late 429 wasted its prefill; a 503
                 means a migration failed). A request that was migrated and completed is simply
                 completed.
    exactly once every request the gateway gave an X-Request-Id has exactly one terminal event
                 (completed, failed, rejected, cancelled) in MOONBUS_EVENTS: two is "ended twice",
                 none is "never ended"; a client stream still open at --timeout is "never ended"
    leaks        after the drain: conductor in flight 0, no pinned block on any messenger, no
                 request KV file in the shm directory, /dev/shm grown by at most 64 MiB beyond
                 what the slabs and other programs' files in it grew (filling a slab is not a leak)
    exit status  0 only if every request is completed/429/503, none ended twice or never, and
                 nothing leaked; 1 otherwise, each violation named by request id or resource
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

from tools.moonbus.traces.measures import OK, RequestResult
from schemas.events import TERMINAL_KINDS, Event
from schemas.pool import PoolStatus

COMPLETED, REJECTED_429, UNAVAILABLE_503, FAILED = "completed", "429", "503", "failed"
OUTCOMES = (COMPLETED, REJECTED_429, UNAVAILABLE_503, FAILED)
DEV_SHM_LEAK_BYTES = 64 << 20  # /dev/shm growth (beyond the slabs') that counts as a leak
MIGRATED_KIND = "migrated"
RESTARTED_KIND = "restarted"
PREFILLED_KIND = "prefilled"


@dataclass(frozen=True, slots=True)
class Outcome:
    kind: str  # one of OUTCOMES
    reason: str = ""  # why it failed, in words
    timed_out: bool = False  # the client gave up at --timeout: the request never ended for it


@dataclass(frozen=True, slots=True)
class Violation:
    """One reason the run fails: `subject` is a request id (or #seq without one) or a resource."""

    what: str  # "request" | "resource" | "slo"
    subject: str
    detail: str

    def __str__(self) -> str:
        return f"{self.what} {self.subject}: {self.detail}"


def _is_timeout(error: str) -> bool:
    # replay.send_one writes "<exception class>: <message>"; every aiohttp and asyncio timeout
    # class name ends in TimeoutError (TimeoutError, ServerTimeoutError, ConnectionTimeoutError, ...)
    return error.split(":", 1)[0].strip().endswith("TimeoutError")


def classify(r: RequestResult) -> Outcome:
    """A finished `replay.send_one` result as a soak outcome."""
    if r.status == OK:
        return Outcome(COMPLETED)
    if r.http_status == 429:
        return Outcome(REJECTED_429)
    if r.http_status == 503:
        return Outcome(UNAVAILABLE_503)
    if _is_timeout(r.error):
        return Outcome(FAILED, f"timeout: {r.error}", timed_out=True)
    if r.http_status not in (0, 200):
        return Outcome(FAILED, r.error or f"HTTP {r.http_status}")
    if r.error_code == 429:
        return Outcome(FAILED, f"rejected late, after the stream started (its prefill wasted): {r.error}")
    if r.error_code:
        return Outcome(FAILED, f"error event {r.error_code} in the stream: {r.error}")
    if r.error:
        return Outcome(FAILED, f"connection error: {r.error}")
    return Outcome(FAILED, "the stream ended without [DONE]")


def count_outcomes(outcomes: Iterable[Outcome]) -> dict[str, int]:
    counts = dict.fromkeys(OUTCOMES, 0)
    for o in outcomes:
        counts[o.kind] += 1
    return counts


@dataclass(frozen=True, slots=True)
class Resumption:
    """One `migrated` event: a request handed back by the cluster and routed again."""

    ts: float  # wall clock
    attempt: int  # the new attempt's number
    reason: str  # the error that handed it back ("instance decode-0 exited", ...)
    resumed_tokens: int  # tokens the client already had
    before_first_token: bool


@dataclass
class EventLog:
    """What the soak records from MOONBUS_EVENTS, fed one event at a time."""

    terminal: dict[str, list[str]] = field(default_factory=dict)  # request_id -> terminal kinds, in order
    migrated: dict[str, int] = field(default_factory=dict)  # request_id -> migrated events
    resumptions: dict[str, list[Resumption]] = field(default_factory=dict)  # request_id -> its migrated events
    cached: dict[tuple[str, int], int] = field(default_factory=dict)  # (request_id, attempt) -> cached tokens
    restarted: dict[str, int] = field(default_factory=dict)  # process kind -> restarted events
    seen: set[int] = field(default_factory=set)  # stream sequences: a redelivery is not a second end

    def add(self, event: Event, stream_seq: int | None = None) -> None:
        if stream_seq is not None:
            if stream_seq in self.seen:
                return
            self.seen.add(stream_seq)
        if event.kind in TERMINAL_KINDS and event.request_id:
            self.terminal.setdefault(event.request_id, []).append(event.kind)
        elif event.kind == MIGRATED_KIND and event.request_id:
            self.migrated[event.request_id] = self.migrated.get(event.request_id, 0) + 1
            d = event.data
            self.resumptions.setdefault(event.request_id, []).append(Resumption(
                event.ts, int(d.get("attempt", 0)), str(d.get("reason", "")), int(d.get("resumed_tokens", 0)),
                bool(d.get("before_first_token", False))))
        elif event.kind == PREFILLED_KIND and event.request_id:
            self.cached[(event.request_id, int(event.data.get("attempt", 0)))] = int(event.data.get("cached_tokens", 0))
        elif event.kind == RESTARTED_KIND:
            kind = str(event.data.get("kind") or "unknown")
            self.restarted[kind] = self.restarted.get(kind, 0) + 1


def _who(r: RequestResult, seq: int) -> str:
    return r.request_id or f"#{seq}"


def exactly_once(results: Sequence[RequestResult], outcomes: Sequence[Outcome],
                 terminal: dict[str, list[str]]) -> tuple[list[dict], list[dict]]:
    """(ended twice, never ended), one dict per request: request_id, seq, and terminal kinds or why."""
    twice, never = [], []
    for seq, (r, o) in enumerate(zip(results, outcomes)):
        kinds = terminal.get(r.request_id, []) if r.request_id else []
        if len(kinds) > 1:
            twice.append({"request_id": r.request_id, "seq": seq, "terminal": kinds})
        if o.timed_out:
            never.append({"request_id": _who(r, seq), "seq": seq, "why": "the client stream did not finish within --timeout"})
        elif r.request_id and not kinds:
            never.append({"request_id": r.request_id, "seq": seq, "why": "no terminal event"})
    return twice, never


@dataclass(frozen=True)
class Probe:
    """One look at the cluster after the load. None where the value could not be read.

    Request KV files count only if they are new since the run started: a file an earlier run
    left behind is reported (in the summary) but is not this run's leak.
    """

    in_flight: int | None  # the conductor's; None: it did not answer
    pools: dict[str, PoolStatus | None]  # messenger node -> its status; None: no (valid) reply
    pool_errors: dict[str, str] = field(default_factory=dict)  # messenger node -> why there is no status
    new_files: dict[str, int] | None = None  # request KV files (path -> bytes) not there at the start; None: dir unknown
    pool_files_before: dict[str, int] = field(default_factory=dict)  # node -> request_files its messenger had at the start

    @property
    def pinned_blocks(self) -> int:
        return sum(p.pinned_blocks for p in self.pools.values() if p is not None)

    def pool_new_files(self, node: str) -> int:
        pool = self.pools.get(node)
        return max(0, pool.request_files - self.pool_files_before.get(node, 0)) if pool is not None else 0

    @property
    def pool_request_files(self) -> int:
        return sum(self.pool_new_files(node) for node in self.pools)

    def unknown(self) -> list[str]:
        """What could not be read, in words."""
        out = [] if self.in_flight is not None else ["conductor: no status reply"]
        out += [f"messenger {node}: {self.pool_errors.get(node) or 'no status reply'}"
                for node, p in sorted(self.pools.items()) if p is None]
        return out

    def idle(self) -> bool:
        """Everything known and nothing held (the drain waits for this)."""
        return (self.in_flight == 0 and not self.unknown() and self.pinned_blocks == 0
                and self.pool_request_files == 0 and not self.new_files)

    def to_json(self) -> dict:
        return {"in_flight": self.in_flight,
                "pools": {n: (p.to_dict() if p is not None else None) for n, p in self.pools.items()},
                "pool_errors": self.pool_errors, "pinned_blocks": self.pinned_blocks,
                "pool_request_files": self.pool_request_files,
                "shm_request_files": None if self.new_files is None else len(self.new_files),
                "shm_request_bytes": sum((self.new_files or {}).values()),
                "shm_new_files": sorted(self.new_files or {}), "unknown": self.unknown()}


def _some(names: Iterable[str], shown: int = 10) -> str:
    names = sorted(names)
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def leak_violations(probe: Probe, dev_shm_growth: int | None, slab_growth: int = 0,
                    others_growth: int = 0, deleted_maps: Sequence[str] = ()) -> list[Violation]:
    """Leaks in the last probe of the drain; what is still unknown then counts as a failure.

    /dev/shm may grow by what the slabs grew (filled pages) and by what the files of others in it
    grew (other clusters on the machine), plus DEV_SHM_LEAK_BYTES.
    """
    out: list[Violation] = []
    if probe.in_flight:
        out.append(Violation("resource", "conductor", f"{probe.in_flight} requests still in flight"))
    for node, pool in sorted(probe.pools.items()):
        if pool is None:
            out.append(Violation("resource", f"messenger {node}",
                                 f"no status until the drain timeout ({probe.pool_errors.get(node) or 'no reply'})"))
            continue
        if pool.pinned_blocks:
            holders = ", ".join(f"{h} ({n})" for h, n in sorted(pool.holders.items()))
            out.append(Violation("resource", f"messenger {node}", f"{pool.pinned_blocks} blocks pinned: {holders}"))
        if probe.pool_new_files(node):
            out.append(Violation("resource", f"messenger {node}",
                                 f"{probe.pool_new_files(node)} more request KV files than at the start "
                                 f"({pool.request_files} now, {pool.request_file_bytes} bytes)"))
    if probe.in_flight is None:
        out.append(Violation("resource", "conductor", "no status reply until the drain timeout"))
    if probe.new_files:
        out.append(Violation("resource", "shm directory",
                             f"{len(probe.new_files)} request KV files left ({sum(probe.new_files.values())} bytes): "
                             + _some(probe.new_files)))
    explained = max(0, slab_growth) + max(0, others_growth)
    if dev_shm_growth is not None and dev_shm_growth - explained > DEV_SHM_LEAK_BYTES:
        out.append(Violation("resource", "/dev/shm",
                             f"grew by {dev_shm_growth / 2**20:.1f} MiB ({max(0, slab_growth) / 2**20:.1f} MiB of it our "
                             f"slabs, {max(0, others_growth) / 2**20:.1f} MiB others' files): more than "
                             f"{DEV_SHM_LEAK_BYTES >> 20} MiB unexplained"
                             + (f"; removed files still mapped: {'; '.join(deleted_maps)}" if deleted_maps else "")))
    return out


def request_violations(results: Sequence[RequestResult], outcomes: Sequence[Outcome],
                       twice: Sequence[dict], never: Sequence[dict]) -> list[Violation]:
    out = [Violation("request", _who(r, seq), f"failed: {o.reason}")
           for seq, (r, o) in enumerate(zip(results, outcomes)) if o.kind == FAILED]
    out += [Violation("request", t["request_id"], f"ended twice: {', '.join(t['terminal'])}") for t in twice]
    out += [Violation("request", n["request_id"], f"never ended: {n['why']}") for n in never]
    return out


def slo_violations(attainment: float | None, minimum: float, completed: int) -> list[Violation]:
    """Served late is a failure of the design: fewer than `minimum` of the completed requests within
    both SLOs fails the run (0 turns the check off; nothing completed is judged by the outcomes)."""
    if minimum <= 0 or attainment is None or completed == 0 or attainment >= minimum:
        return []
    return [Violation("slo", "attainment", f"{attainment:.1%} of the {completed} completed requests met both SLOs; "
                                           f"the run asks for {minimum:.0%}")]


def exit_code(violations: Sequence[Violation]) -> int:
    return 1 if violations else 0


def touched_by_kills(kills: Sequence, t0_wall: float, events: EventLog, results: Sequence[RequestResult],
                     outcomes: Sequence[Outcome]) -> list[dict]:
    """What each kill did to the requests: one dict per kill (in order) with the requests it handed
    back and how each ended. A request's resumption belongs to the kill whose process its reason
    names ("instance decode-0 exited"); one whose reason names none (a transfer that broke when a
    messenger died, a message lost while the broker restarted) belongs to the latest kill before it."""
    ended = {r.request_id: o.kind for r, o in zip(results, outcomes) if r.request_id}
    per_kill = [{"at_s": k.at_s, "kind": k.kind, "name": k.name, "requests": []} for k in kills]
    for request_id, resumptions in sorted(events.resumptions.items()):
        for r in resumptions:
            at_s = r.ts - t0_wall
            named = [i for i, k in enumerate(kills) if k.at_s <= at_s + 1.0 and _names(r.reason, k.name)]
            before = [i for i, k in enumerate(kills) if k.at_s <= at_s + 1.0]
            who = named[-1] if named else (before[-1] if before else None)
            if who is None:
                continue  # handed back before any kill (a drain, a failed hand-off): not chaos's doing
            per_kill[who]["requests"].append({
                "request_id": request_id, "attempt": r.attempt, "resumed_tokens": r.resumed_tokens,
                "how": "re-dispatched" if r.before_first_token else "resumed",
                "cached_tokens": events.cached.get((request_id, r.attempt)), "ended": ended.get(request_id, "?")})
    return per_kill


def _names(reason: str, name: str) -> bool:
    return f"instance {name} " in reason or reason.endswith(f"instance {name}")
