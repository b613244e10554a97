"""The tamper-evident audit log: each publisher's events form a chain keyed with the cluster secret.

Sealing (`Chain`, used by common.bus.EventPublisher). A publisher is one EventPublisher,
named `<service>/<instance_id>/<incarnation>` (a random incarnation per start, so a restarted
process begins a new chain). It numbers its events 1, 2, 3, ... in the order it publishes them
(one event loop, and NATS keeps a connection's order: the stream stores them in that order) and
seals each one:

    body    = the event as JSON (orjson) with `publisher`, `seq`, `prev` (hex) and `prev_ts`
    digest  = HMAC-SHA256(secret, prev || subject || "\\n" || body)
    payload = body with `"digest":"<hex>"` appended as its last member, and with a signing key of
              its own (common/signing.py) `"sig":"<hex>"` after it: Ed25519 over the digest

`prev` is the previous event's digest (32 zero bytes for seq 1); `prev_ts` the previous event's
time (it tells a verifier whether that event should have been stored). The subject is sealed too,
so an event cannot be moved to another subject. NOTE: the seal covers the exact bytes stored, not
a canonical re-encoding: nothing to agree on but the bytes (orjson does not sort a nested
dataclass's fields, say), any change to them shows, and sealing costs one encoding, not four.

Verifying (`verify`, used by `moonbus audit`): given the stored events in stream order, an event
is authentic when its digest verifies (only holders of the secret can make one) and, given the
publishers' public keys, its signature is by its own publisher's key (only that process holds
it: another service with the secret cannot write its events). Problems:

  forged      not a sealed event (no digest: published by something without the secret), or a
              digest that does not verify from a publisher no authentic event names, or beside
              the authentic event of the same publisher and seq
  edited      a digest that does not verify where the publisher's authentic event of that seq is
              absent: the stored event is not the one that was published
  dropped     seqs of a chain that no stored event claims (reported once per run of them)
  duplicated  an authentic event stored twice
  reordered   an authentic event stored after a later one of its chain
  unlinked    an authentic event whose prev is not the digest of its chain's previous event
  deleted     stream seqs inside the read that no message holds: JetStream never reuses one and
              expiry removes only the oldest, so a hole is a message someone deleted (this finds
              what chains cannot: a chain's last events, or a whole chain, deleted)

The read is complete from `since` on: a chain's first stored event may be seq k > 1 only if its
predecessor was published before `since` (its `prev_ts`): before the stream existed, before its
oldest events expired, or before the window of `moonbus audit verify --since`. Chains alone
cannot see a chain's last events dropped; the stream's seqs (`deleted`) can, as long as the stream
itself is not rebuilt (its creation time, printed by `moonbus audit verify`, says when it was).
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass, field
from typing import Any, Iterable

import orjson

ZERO = "00" * 32  # the prev of a chain's first event
_HEX64 = re.compile(r"[0-9a-f]{64}")


_SEALED = re.compile(rb',"digest":"([0-9a-f]{64})"(?:,"sig":"([0-9a-f]{128})")?\}\Z')  # how a sealed payload ends


def seal_digest(secret: bytes, prev: str, subject: str, body: bytes) -> str:
    """The digest of an event: `body` its JSON up to its digest, `prev` the previous digest (hex)."""
    return hmac.new(secret, bytes.fromhex(prev) + subject.encode() + b"\n" + body, hashlib.sha256).hexdigest()


class Chain:
    """One publisher's chain: numbers and seals its events in the order they are published."""

    def __init__(self, secret: bytes, publisher: str, signer=None) -> None:
        self._secret = secret
        self._signer = signer  # common.signing.Signer: this process's own key (None: sealed only)
        self.publisher = publisher
        self.seq = 0  # the last event's
        self._prev = ZERO
        self._prev_ts = 0.0

    def seal(self, subject: str, event: dict[str, Any]) -> bytes:
        """The payload to publish: the event's fields (with a "ts"; any "digest" is left out),
        numbered and sealed. Advances the chain.

        NOTE: the caller must publish sealed events in the order they were sealed."""
        return self.signed(self.sealed(subject, event))

    def sealed(self, subject: str, event: dict[str, Any]) -> Sealed:
        """`seal` without its signature (`signed` adds it): the chain's part, which must be done
        in publishing order, at once; the costly signature can wait until the event is sent."""
        fields = {k: v for k, v in event.items() if k != "digest"}
        fields.update(publisher=self.publisher, seq=self.seq + 1, prev=self._prev, prev_ts=self._prev_ts)
        body = orjson.dumps(fields)  # raises (and takes no seq) if the event cannot be encoded
        digest = seal_digest(self._secret, self._prev, subject, body)
        self.seq, self._prev, self._prev_ts = self.seq + 1, digest, fields["ts"]
        return Sealed(body[:-1] + b',"digest":"' + digest.encode(), digest)

    def signed(self, sealed: Sealed) -> bytes:
        """The payload of a sealed event: with this publisher's signature of its digest, if it has a key."""
        if self._signer is None:
            return sealed.head + b'"}'
        return sealed.head + b'","sig":"' + self._signer.sign(bytes.fromhex(sealed.digest)).encode() + b'"}'


@dataclass(frozen=True)
class Sealed:
    """A sealed event not signed yet: its JSON up to its digest's value (unclosed), and the digest."""

    head: bytes
    digest: str


@dataclass(frozen=True)
class Stored:
    """One message of the events stream, as read back."""

    stream_seq: int
    subject: str
    payload: bytes
    stored_at: float = float("inf")  # when the stream stored it (its clock); unknown: the latest


@dataclass(frozen=True)
class Problem:
    kind: str  # forged | edited | dropped | duplicated | reordered | unlinked | deleted
    publisher: str  # "" when the event names none
    seq: int  # the publisher's seq (dropped: the first missing one); 0 when the event has none
    stream_seq: int  # the event's place in the stream (dropped: the chain's next stored event;
    # deleted: the first deleted one)
    subject: str
    detail: str
    # dropped, deleted: what is missing was stored strictly between these stream seqs
    gap: tuple[int, int] = (0, 0)


@dataclass(frozen=True)
class ChainSummary:
    publisher: str
    events: int  # authentic events stored
    first_seq: int
    last_seq: int
    problems: int


@dataclass
class Report:
    chains: list[ChainSummary]
    problems: list[Problem]  # in stream order
    # stream seq -> "verified" or the kind of problem that event is
    marks: dict[int, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass(frozen=True)
class _Sealed:
    """A stored event that claims a place in a chain."""

    record: Stored
    publisher: str
    seq: int
    prev: str
    prev_ts: float
    digest: str
    body: bytes | None  # the payload up to its digest (None: the payload does not end as sealed)
    sig: str = ""  # its publisher's signature of the digest, hex ("" = none)


def verify(stored: Iterable[Stored], secret: bytes, since: float = 0.0,
           stream_seqs: tuple[int, int] | None = None, signers=None) -> Report:
    """Check every chain in `stored` (stream order); the read is complete from `since` on, and
    holds every message of `stream_seqs` (first, last; default: the first and last read) left.
    With `signers` (common.signing.Signers), an event must also be signed by its publisher's key."""
    problems: list[Problem] = []
    marks: dict[int, str] = {}
    chains: dict[str, list[_Sealed]] = {}  # publisher -> its authentic events, in stream order
    failed: list[_Sealed] = []  # sealed events whose digest does not verify
    read: list[int] = []  # stream seqs
    for record in stored:
        read.append(record.stream_seq)
        sealed, why = _unseal(record)
        if sealed is None:
            problems.append(Problem("forged", "", 0, record.stream_seq, record.subject, why))
        elif sealed.body is not None and hmac.compare_digest(
                sealed.digest, seal_digest(secret, sealed.prev, record.subject, sealed.body)):
            unsigned = signers and signers.required(sealed.publisher, record.stored_at) and \
                not signers.verify(sealed.publisher, bytes.fromhex(sealed.digest), sealed.sig)
            if unsigned:
                problems.append(Problem("forged", sealed.publisher, sealed.seq, record.stream_seq, record.subject,
                                        "sealed with the cluster secret, but not signed by its publisher's own key"))
                continue
            chains.setdefault(sealed.publisher, []).append(sealed)
            marks[record.stream_seq] = "verified"
        else:
            failed.append(sealed)
    problems += _classify_failed(failed, chains)
    for publisher, events in chains.items():
        problems += _check_order(events) + _check_links(events)
        problems += _find_gaps(events, {s.seq for s in failed if s.publisher == publisher}, since)
    problems += _find_deleted(read, stream_seqs)
    problems.sort(key=lambda p: (p.stream_seq, p.publisher, p.seq))
    for p in problems:
        if p.kind not in ("dropped", "deleted"):
            marks[p.stream_seq] = p.kind
    return Report(_summaries(chains, problems), problems, marks)


def _unseal(record: Stored) -> tuple[_Sealed | None, str]:
    """The chain fields of a stored event, or None and why it is not a sealed event."""
    try:
        obj = orjson.loads(record.payload)
    except orjson.JSONDecodeError:
        return None, "not JSON"
    if not isinstance(obj, dict):
        return None, "not a JSON object"
    if not obj.get("digest"):
        return None, "no digest: not sealed by a holder of the cluster secret"
    publisher, seq, prev, prev_ts, digest = (obj.get(k) for k in ("publisher", "seq", "prev", "prev_ts", "digest"))
    well_formed = (isinstance(publisher, str) and publisher and type(seq) is int and seq > 0
                   and isinstance(prev, str) and _HEX64.fullmatch(prev) and isinstance(digest, str)
                   and type(prev_ts) in (int, float))
    if not well_formed:
        return None, "malformed chain fields (publisher, seq, prev, prev_ts, digest)"
    end = _SEALED.search(record.payload)
    body = record.payload[:end.start()] + b"}" if end and end[1].decode() == digest else None
    sig = end[2].decode() if end and end[2] else ""
    return _Sealed(record, publisher, seq, prev, float(prev_ts), digest, body, sig), ""


def _classify_failed(failed: list[_Sealed], chains: dict[str, list[_Sealed]]) -> list[Problem]:
    problems = []
    for s in failed:
        authentic = chains.get(s.publisher)
        if authentic is None:
            kind, detail = "forged", "digest does not verify; no authentic event of this publisher"
        elif any(a.seq == s.seq for a in authentic):
            kind, detail = "forged", "digest does not verify; the authentic event of this seq is stored too"
        else:
            kind, detail = "edited", "digest does not verify: not the event its publisher published"
        problems.append(Problem(kind, s.publisher, s.seq, s.record.stream_seq, s.record.subject, detail))
    return problems


def _check_order(events: list[_Sealed]) -> list[Problem]:
    problems = []
    seen: dict[int, int] = {}  # seq -> stream seq of its first copy
    highest = 0
    for s in events:
        r = s.record
        if s.seq in seen:
            problems.append(Problem("duplicated", s.publisher, s.seq, r.stream_seq, r.subject,
                                    f"already stored at stream seq {seen[s.seq]}"))
            continue
        seen[s.seq] = r.stream_seq
        if s.seq < highest:
            problems.append(Problem("reordered", s.publisher, s.seq, r.stream_seq, r.subject,
                                    f"stored after seq {highest} of its chain"))
        highest = max(highest, s.seq)
    return problems


def _check_links(events: list[_Sealed]) -> list[Problem]:
    problems = []
    by_seq: dict[int, _Sealed] = {}
    for s in events:
        by_seq.setdefault(s.seq, s)
    for seq, s in sorted(by_seq.items()):
        before = by_seq.get(seq - 1)
        expected = ZERO if seq == 1 else before.digest if before else s.prev
        if s.prev != expected:
            problems.append(Problem("unlinked", s.publisher, seq, s.record.stream_seq, s.record.subject,
                                    "prev is not the digest of the chain's previous event"))
    return problems


def _find_gaps(events: list[_Sealed], claimed: set[int], since: float) -> list[Problem]:
    """Runs of seqs that no stored event claims (`claimed`: the seqs of events that failed)."""
    by_seq: dict[int, _Sealed] = {}
    for s in events:
        by_seq.setdefault(s.seq, s)
    first = by_seq[min(by_seq)]
    # the chain may start mid-way only if the event before its first stored one predates the read
    start = first.seq if first.seq == 1 or first.prev_ts < since else 1
    present = set(by_seq) | claimed
    missing = [seq for seq in range(start, max(by_seq)) if seq not in present]
    problems = []
    for run in _runs(missing):
        after = by_seq[min(seq for seq in by_seq if seq > run[-1])].record
        before = by_seq.get(run[0] - 1)
        what = f"seq {run[0]}" if len(run) == 1 else f"seqs {run[0]}-{run[-1]} ({len(run)} events)"
        problems.append(Problem("dropped", first.publisher, run[0], after.stream_seq, after.subject,
                                f"{what} missing before stream seq {after.stream_seq}",
                                (before.record.stream_seq if before else 0, after.stream_seq)))
    return problems


def _find_deleted(read: list[int], stream_seqs: tuple[int, int] | None) -> list[Problem]:
    if not read and stream_seqs is None:
        return []
    first, last = stream_seqs or (min(read), max(read))
    edges = [first - 1, *sorted({seq for seq in read if first <= seq <= last}), last + 1]
    problems = []
    for before, after in zip(edges, edges[1:]):
        if after - before > 1:
            run = f"stream seq {before + 1}" if after - before == 2 else \
                f"stream seqs {before + 1}-{after - 1} ({after - before - 1} messages)"
            problems.append(Problem("deleted", "", 0, before + 1, "", f"{run} deleted", (before, after)))
    return problems


def _runs(seqs: list[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    for seq in seqs:
        if runs and runs[-1][-1] == seq - 1:
            runs[-1].append(seq)
        else:
            runs.append([seq])
    return runs


def _summaries(chains: dict[str, list[_Sealed]], problems: list[Problem]) -> list[ChainSummary]:
    summaries = []
    for publisher, events in sorted(chains.items()):
        seqs = [s.seq for s in events]
        count = sum(1 for p in problems if p.publisher == publisher)
        summaries.append(ChainSummary(publisher, len(set(seqs)), min(seqs), max(seqs), count))
    return summaries
