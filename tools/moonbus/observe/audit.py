"""`moonbus audit`: prove the events stream (JetStream MOONBUS_EVENTS) complete and unaltered.

  moonbus audit verify [--since T]      check every publisher's chain; exit 1 on any problem
  moonbus audit request ID [--since T]  one request's whole record, each event marked verified or not

Every event is sealed into its publisher's chain with the cluster secret (common/audit.py has the
scheme and the kinds of problems). The stream is read from its start (or from `--since`: an ISO
time, or "30s", "10m", "1h", "2d" ago) as the read-only auditor, and checked with the cluster
secret (default: the local cluster's <home>/secrets/cluster.key). The read is complete from the
latest of: the stream's creation, the time before which its events have expired (max_age), and
`--since`; a chain may start mid-way only where its previous event is older than that.

With the publishers' public keys (<home>/secrets/signers.json, which `moonbus up` writes), every
event must also be signed by its own publisher's key (common/signing.py). `verify` of the whole
stream checks it against the auditor's signed checkpoint of the last clean verify and writes a new
one when it is clean (tools/moonbus/observe/checkpoint.py): a stream rebuilt, rewound, shrunk or
emptied of chain heads is found there.

A completed request must also have verified events signed by each service that takes part in one
(TAKE_PART: gateway, conductor, prefill, and decode unless prefill's tokens were all there was):
by the publisher whose key signed it, not by the service an event names. A story told with one
stolen key and the cluster secret is MISSING the others. `request` checks its request when the read
holds its start (its gateway's `received`) or holds the whole stream; `verify` checks each
completed request whose `received` it read. What an event or the bus chose is printed escaped
(tools/moonbus/observe/escape.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import re
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from nats.js.api import ConsumerConfig, DeliverPolicy

from common import bus, signing
from tools.moonbus.observe import timeline
from common.audit import Problem, Report, Stored, verify
from common.signing import SIGNERS_FILE, Signers
from common.config import default_home
from common.security import SecretError, read_secret
from schemas import subjects
from schemas.events import TERMINAL_KINDS, Event
from tools.moonbus.observe import checkpoint
from tools.moonbus.observe.checkpoint import StreamState
from tools.moonbus.observe.escape import printable
from tools.moonbus.observe.tap import default_access, format_event

READ_TIMEOUT_S = 3.0  # no message this long: the read is over (or the window is empty)
_AGO = re.compile(r"(\d+(?:\.\d+)?)([smhd])")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
CREATION = "the stream's creation"  # why a read is complete from the stream's start: it holds every event
# who must take part in a completed request, and the kinds of its events that show they did: one
# stolen key (and the cluster secret) cannot tell a whole story (a coupled instance's two halves
# sign as prefill/<name>-prefill and decode/<name>-decode: tools/moonbus/cluster/processes.py)
TAKE_PART = (
    ("gateway", frozenset({"received", "first_token", "completed"})),
    ("conductor", frozenset({"routed"})),
    ("prefill", frozenset({"prefilled"})),
    ("decode", frozenset({"decode_joined", "decode_finished"})),
)


class AuditReadError(RuntimeError):
    """Raised when the stream stops delivering before its last message was read."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="audit_command", required=True)
    verify_parser = sub.add_parser("verify", help="check every publisher's chain; exit 1 on any problem")
    request_parser = sub.add_parser("request", help="one request's whole record, each event marked verified or not")
    request_parser.add_argument("request_id")
    for p in (verify_parser, request_parser):
        p.add_argument("--since", help="read from this time: ISO (local time if no zone), or 30s, 10m, 1h, 2d ago")
        p.add_argument("--home", type=Path, default=None, help="the local cluster's state directory (./.moonbus)")
        p.add_argument("--nats-url", default=None, help="default: $MOONBUS_NATS_URL, else the local cluster's")
        p.add_argument("--secret-file", default=None, help="the cluster secret (default <home>/secrets/cluster.key)")
        p.add_argument("--signers-file", default=None, help="the publishers' public keys (default "
                       "<home>/secrets/signers.json, if it exists: then every event must be signed by its publisher)")
        p.add_argument("--json", action="store_true", help="print JSON")
    verify_parser.add_argument("--checkpoint", type=Path, default=None,
                               help="the auditor's signed checkpoint (default <home>/audit/checkpoint.json; written "
                                    "after every clean verify of the whole stream, checked before)")


def parse_since(text: str, now: float) -> float:
    """Seconds since the epoch: "10m" is ten minutes before `now`; else an ISO time (local if naive)."""
    match = _AGO.fullmatch(text.strip())
    if match:
        return now - float(match[1]) * _UNITS[match[2]]
    try:
        return datetime.datetime.fromisoformat(text.strip()).timestamp()
    except ValueError:
        raise ValueError(f"--since {text!r}: expected an ISO time or an age like 30s, 10m, 1h, 2d") from None


def complete_since(created: float, max_age_s: float, now: float, since: float | None) -> tuple[float, str]:
    """From when on the read must hold every event, and why (the latest bound wins)."""
    bounds = [(created, CREATION)]
    if max_age_s > 0:
        bounds.append((now - max_age_s, f"events older than {max_age_s:g} s expire"))
    if since is not None:
        bounds.append((since, "--since"))
    return max(bounds)


@dataclass
class Read:
    records: list[Stored]  # in stream order
    complete_from: float  # every event published since then must be in `records`
    why: str  # what sets complete_from
    stream_seqs: tuple[int, int] | None  # the stream seqs `records` must cover (None: nothing read)
    stream: StreamState | None = None  # the stream when it was read


def expected_stream_seqs(records: list[Stored], last_seq: int, head_kept: bool) -> tuple[int, int] | None:
    """The read covers every seq from the stream's first (1 when nothing can have expired and the
    read is from the start) to its last at the time of the read (kept after a delete)."""
    if not records:
        return (1, last_seq) if head_kept and last_seq else None
    return (1 if head_kept else records[0].stream_seq), max(last_seq, records[-1].stream_seq)


async def read_stream(url: str, auth, since: float | None) -> Read:
    """Every stored event (from `since`, if given), and what the read must hold."""
    nc = await bus.connect(url, "moonbus-audit", auth, first_connect_timeout_s=10)
    try:
        js = nc.jetstream()
        info = await js.stream_info(subjects.EVENTS_STREAM)
        created = info.created.timestamp() if info.created else 0.0
        now, max_age = time.time(), info.config.max_age or 0.0
        stream = StreamState(created, info.state.last_seq, max_age, info.config.max_bytes or -1, info.state.bytes or 0)
        bound = complete_since(created, max_age, now, since)
        head_kept = since is None and (max_age <= 0 or created > now - max_age)  # nothing expired yet
        if info.state.messages == 0:
            return Read([], *bound, expected_stream_seqs([], info.state.last_seq, head_kept), stream)
        if since is None:
            config = ConsumerConfig(deliver_policy=DeliverPolicy.ALL)
        else:
            start = datetime.datetime.fromtimestamp(since, datetime.timezone.utc)
            config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=start)
        sub = await js.subscribe(subjects.EVENTS_ALL, ordered_consumer=True, config=config)
        try:
            records = await _read_all(sub, empty_ok=since is not None)
            return Read(records, *bound, expected_stream_seqs(records, info.state.last_seq, head_kept), stream)
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
    finally:
        await bus.shutdown(nc)


async def _read_all(sub, empty_ok: bool) -> list[Stored]:
    """Until the consumer has nothing pending: what the stream held when the read began (and since)."""
    records: dict[int, Stored] = {}  # stream seq -> event
    while True:
        try:
            msg = await sub.next_msg(timeout=READ_TIMEOUT_S)
        except asyncio.TimeoutError:
            if records or not empty_ok:
                last = max(records, default=0)
                raise AuditReadError(f"the stream stopped delivering after stream seq {last}") from None
            return []
        meta = msg.metadata
        records[meta.sequence.stream] = Stored(meta.sequence.stream, msg.subject, msg.data,
                                               meta.timestamp.timestamp() if meta.timestamp else float("inf"))
        if meta.num_pending == 0:
            return list(records.values())


def default_secret_file(args: argparse.Namespace) -> Path:
    return Path(args.secret_file) if args.secret_file else (args.home or default_home()) / "secrets" / "cluster.key"


def print_report(report: Report, read: Read) -> None:
    records = read.records
    span = f" (stream seqs {records[0].stream_seq}-{records[-1].stream_seq})" if records else ""
    print(f"{subjects.EVENTS_STREAM}: {len(records)} events read{span}; "
          f"complete from {_when(read.complete_from)} ({read.why})")
    if report.chains:
        print(f"{'publisher':<48} {'events':>7} {'seqs':>13} {'problems':>8}")
    for c in report.chains:
        print(f"{printable(c.publisher):<48} {c.events:>7} {f'{c.first_seq}-{c.last_seq}':>13} {c.problems:>8}")
    if records and not report.chains:
        print("no event verifies: do the services run with this cluster secret (--cluster-secret-file)?")
    if report.problems:
        print(f"\n{len(report.problems)} problem(s):")
    for p in report.problems:
        print("  " + format_problem(p))
    print("\nOK: every chain is complete and unaltered" if report.ok
          else f"\nFAILED: {len(report.problems)} problem(s) in the audit log")


def format_problem(p: Problem) -> str:
    who = f"{printable(p.publisher)} seq {p.seq}" if p.publisher else \
        "(the stream)" if p.kind in ("deleted", "rebuilt", "rewound", "shrunk", "forged") and not p.stream_seq or \
        p.kind == "deleted" else "(no publisher)"
    where = f"stream seq {p.stream_seq}" + (f"  {printable(p.subject)}" if p.subject else "")
    return f"{p.kind.upper():<10} {who}  {where}: {printable(p.detail)}"


def _when(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts).isoformat(sep=" ", timespec="seconds") if ts > 0 else "the beginning"


def request_record(report: Report, records: list[Stored], request_id: str) -> tuple[list[Stored], list[Problem]]:
    """The request's events (its subjects, or naming it), and the problems within its span of the
    stream (a dropped event there may have been one of its own)."""
    mine = [r for r in records if _is_of_request(r, request_id)]
    if not mine:
        return [], []
    first, last = mine[0].stream_seq, mine[-1].stream_seq
    own = {r.stream_seq for r in mine}
    # what is missing from a gap next to or inside the request's span may have been its own
    around = [p for p in report.problems
              if p.stream_seq in own or (p.kind in ("dropped", "deleted") and p.gap[0] <= last and p.gap[1] >= first)]
    return mine, around


def missing_services(events: list[Event]) -> list[str]:
    """The services that must have taken part in a completed request and signed none of its
    `events` (verified ones: `publisher` is whose key signed each). Decode need not take part when
    the client got no more tokens than prefill made (each prefill yields one: max_tokens 1, an end
    at the first token)."""
    signed = {(e.publisher.split("/", 1)[0], e.kind) for e in events}
    missing = [service for service, kinds in TAKE_PART if not any((service, kind) in signed for kind in kinds)]
    tokens = [e.data.get("completion_tokens") for e in events if e.kind == "completed"]
    prefills = sum(1 for e in events if (e.publisher.split("/", 1)[0], e.kind) == ("prefill", "prefilled"))
    if "decode" in missing and tokens and all(type(t) is int and t <= prefills for t in tokens):
        missing.remove("decode")
    return missing


def unwitnessed(report: Report, records: list[Stored], whole: bool, request_id: str = "") -> list[Problem]:
    """A MISSING problem at each completed request's terminal event (of `request_id`'s alone, if
    given) that a service which must take part signed nothing of. Unless the read is `whole`, a
    request is checked only if its `received` was read: an older one's events may predate it."""
    requests: dict[str, list[tuple[Stored, Event]]] = {}
    for r in records:
        if report.marks.get(r.stream_seq) != "verified":
            continue
        try:
            event = Event.from_bytes(r.payload)
        except ValueError:
            continue
        if event.request_id and (not request_id or event.request_id == request_id):
            requests.setdefault(event.request_id, []).append((r, event))
    problems = []
    for rid, mine in requests.items():
        ends = [(r, e) for r, e in mine if e.kind == "completed"]
        started = any(e.kind == "received" and e.publisher.startswith("gateway/") for _, e in mine)
        if not ends or not (whole or started):
            continue
        missing = missing_services([e for _, e in mine])
        if missing:
            r, end = ends[0]
            problems.append(Problem("missing", end.publisher, end.seq, r.stream_seq, r.subject,
                                    f"request {rid} completed, but no event of it is signed by "
                                    f"{' or '.join(missing)}, which must take part"))
    return problems


def _is_of_request(record: Stored, request_id: str) -> bool:
    if record.subject.startswith(subjects.EVENTS_PREFIX + ".request.") and record.subject.endswith("." + request_id):
        return True
    try:
        obj = json.loads(record.payload)
    except ValueError:
        return False
    return isinstance(obj, dict) and obj.get("request_id") == request_id


def print_request(report: Report, mine: list[Stored], around: list[Problem], request_id: str) -> None:
    print(f"request {printable(request_id)}: {len(mine)} events")
    terminal = False
    verified: list[dict] = []
    for r in mine:
        mark = report.marks.get(r.stream_seq, "?")
        try:
            event = Event.from_bytes(r.payload)
            line = format_event(event)
            terminal |= event.kind in TERMINAL_KINDS and mark == "verified"
            if mark == "verified":
                verified.append({"kind": event.kind, "ts": event.ts, "data": event.data})
        except ValueError:
            line = printable(r.payload.decode(errors="replace"))
        print(f"  {mark.upper() if mark != 'verified' else mark:<10} #{r.stream_seq:<7} {line}")
    if not terminal:
        print("  (no verified terminal event)")
    rows = [replace(s, attempt=s.attempt if type(s.attempt) is int else printable(str(s.attempt)),
                    note=printable(s.note)) for s in timeline.stages(verified)]  # notes quote the events
    if rows:
        print("\nits time, stage by stage, beside the conductor's prediction (verified events only):")
        print("  " + timeline.format_stages(rows).replace("\n", "\n  "))
    if around:
        print(f"\n{len(around)} problem(s) in its span of the stream:")
    for p in around:
        print("  " + format_problem(p))


async def audit(args: argparse.Namespace) -> int:
    secret_file = default_secret_file(args)
    try:
        secret = read_secret(secret_file)
        since = parse_since(args.since, time.time()) if args.since else None
    except (SecretError, ValueError) as exc:
        print(f"moonbus audit: {exc}", file=sys.stderr)
        return 2
    url, auth = (args.nats_url, None) if args.nats_url else default_access(args.home)
    try:
        read = await read_stream(url, auth, since)
    except (ConnectionError, AuditReadError) as exc:
        print(f"moonbus audit: {exc}", file=sys.stderr)
        return 2
    home = args.home or default_home()
    signers_file = Path(args.signers_file) if args.signers_file else Path(secret_file).parent / SIGNERS_FILE
    try:
        signers = Signers.read(signers_file) if args.signers_file or signers_file.exists() else None
    except (OSError, ValueError) as exc:
        print(f"moonbus audit: cannot read the publishers' keys in {signers_file}: {exc}", file=sys.stderr)
        return 2
    report = verify(read.records, secret, read.complete_from, read.stream_seqs, signers)
    if args.audit_command == "verify":
        report.problems += unwitnessed(report, read.records, whole=False)
        report.problems.sort(key=lambda p: (p.stream_seq, p.publisher, p.seq))
        if read.stream is not None:  # the stream itself against what the last clean verify saw
            path = args.checkpoint or home / "audit" / "checkpoint.json"
            auditor = signing.new_key(signing.key_file(Path(secret_file).parent, "auditor"))
            saved, problems = checkpoint.read(path, auditor)
            if saved is not None:
                problems += checkpoint.check(saved, read.stream, read.records if since is None else None)
            report.problems[:0] = problems
            if report.ok and since is None:
                checkpoint.write(path, checkpoint.Checkpoint(read.stream, checkpoint.heads_of(report, read.records),
                                                             time.time()), auditor)
        if signers is None:
            print(f"note: no {signers_file}: events are checked as sealed with the cluster secret, not as signed "
                  "by their publishers", file=sys.stderr)
        if args.json:
            print(json.dumps({"events": len(read.records), "complete_from": read.complete_from, "why": read.why,
                              "stream_seqs": read.stream_seqs, "ok": report.ok,
                              "chains": [asdict(c) for c in report.chains],
                              "problems": [asdict(p) for p in report.problems]}, indent=1))
        else:
            print_report(report, read)
        return 0 if report.ok else 1
    mine, around = request_record(report, read.records, args.request_id)
    around += unwitnessed(report, mine, read.why == CREATION, args.request_id)
    if args.json:
        print(json.dumps({"request_id": args.request_id, "problems": [asdict(p) for p in around],
                          "events": [{"stream_seq": r.stream_seq, "subject": r.subject,
                                      "mark": report.marks.get(r.stream_seq, "?"),
                                      "event": json.loads(r.payload) if _is_json(r.payload) else None}
                                     for r in mine]}, indent=1))
    elif not mine:
        print(f"no events of request {printable(args.request_id)} in the stream")
    else:
        print_request(report, mine, around, args.request_id)
    ended = any(report.marks.get(r.stream_seq) == "verified" and _terminal(r) for r in mine)
    # a record is proven only whole: every event verified, nothing wrong around it, and a verified end
    clean = mine and ended and not around and all(report.marks.get(r.stream_seq) == "verified" for r in mine)
    return 0 if clean else 1


def _terminal(record: Stored) -> bool:
    try:
        return Event.from_bytes(record.payload).kind in TERMINAL_KINDS
    except ValueError:
        return False


def _is_json(payload: bytes) -> bool:
    try:
        json.loads(payload)
        return True
    except ValueError:
        return False


def run(args: argparse.Namespace) -> int:
    return asyncio.run(audit(args))
