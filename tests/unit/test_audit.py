"""The audit chain (common/audit.py): sealing, and every kind of problem the verifier reports."""

from __future__ import annotations

import hashlib
import hmac
import json
from types import SimpleNamespace

import msgspec
import orjson
import pytest

from common import bus, signing
from common.audit import ZERO, Chain, ChainSummary, Problem, Stored, verify
from schemas.events import Event
from tools.moonbus.observe import checkpoint
from tools.moonbus.observe.audit import complete_since, expected_stream_seqs, parse_since, request_record

SECRET = bytes(range(32))
GW = "gateway/gateway/aaaa"
CD = "conductor/conductor/bbbb"


def make_event(kind: str = "received", ts: float = 100.0, request_id: str = "r1", **data) -> dict:
    event = Event(kind, ts, "gateway", "gateway", request_id, data)
    return msgspec.structs.asdict(event)


def make_chain(publisher: str = GW, n: int = 3, secret: bytes = SECRET, t0: float = 100.0) -> list[tuple[str, bytes]]:
    """n sealed events of one publisher: (subject, payload); seq k has ts t0 + k - 1."""
    chain = Chain(secret, publisher)
    out = []
    for i in range(n):
        subject = f"moonbus.events.request.received.r{i}"
        out.append((subject, chain.seal(subject, make_event(ts=t0 + i, request_id=f"r{i}", i=i))))
    return out


def make_stored(*events: tuple[str, bytes], first: int = 1) -> list[Stored]:
    """Stream messages in this order, numbered from `first`."""
    return [Stored(first + i, subject, payload) for i, (subject, payload) in enumerate(events)]


def alter(payload: bytes, **changes) -> bytes:
    """The payload with fields changed, re-encoded (the digest stays its last member)."""
    return orjson.dumps(orjson.loads(payload) | changes)


def decoded(payload: bytes) -> dict:
    return orjson.loads(payload)


def test_seal_numbers_and_chains_events():
    (s1, p1), (s2, p2) = make_chain(n=2)
    e1, e2 = decoded(p1), decoded(p2)
    assert (e1["publisher"], e1["seq"], e1["prev"], e1["prev_ts"]) == (GW, 1, ZERO, 0.0)
    assert (e2["seq"], e2["prev"], e2["prev_ts"]) == (2, e1["digest"], 100.0)
    assert list(e2)[-1] == "digest" and Event.from_bytes(p2).digest == e2["digest"]
    body = p2[:p2.index(b',"digest":')] + b"}"
    assert orjson.loads(body) == {k: v for k, v in e2.items() if k != "digest"}
    expected = hmac.new(SECRET, bytes.fromhex(e1["digest"]) + s2.encode() + b"\n" + body, hashlib.sha256)
    assert e2["digest"] == expected.hexdigest()


def test_an_event_that_cannot_be_encoded_takes_no_seq():
    chain = Chain(SECRET, GW)
    with pytest.raises(TypeError):
        chain.seal("moonbus.events.request.received.r0", make_event(bad=object()))
    assert decoded(chain.seal("moonbus.events.request.received.r0", make_event()))["seq"] == 1


def test_a_clean_stream_verifies():
    gw, cd = make_chain(GW, 3), make_chain(CD, 2)
    stored = make_stored(gw[0], cd[0], gw[1], gw[2], cd[1])
    report = verify(stored, SECRET)
    assert report.ok and report.problems == []
    assert report.chains == [ChainSummary(CD, 2, 1, 2, 0), ChainSummary(GW, 3, 1, 3, 0)]
    assert report.marks == {1: "verified", 2: "verified", 3: "verified", 4: "verified", 5: "verified"}


def test_an_event_without_digest_is_forged():
    gw = make_chain(n=2)
    forged = ("moonbus.events.request.completed.r0", orjson.dumps(make_event("completed", request_id="r0")))
    report = verify(make_stored(gw[0], forged, gw[1]), SECRET)
    assert report.problems == [Problem("forged", "", 0, 2, "moonbus.events.request.completed.r0",
                                       "no digest: not sealed by a holder of the cluster secret")]
    assert report.marks == {1: "verified", 2: "forged", 3: "verified"}
    assert report.chains == [ChainSummary(GW, 2, 1, 2, 0)]


def test_garbage_and_malformed_chain_fields_are_forged():
    gw = make_chain(n=1)
    stored = make_stored(gw[0]) + [
        Stored(2, "moonbus.events.request.received.x", b"not json"),
        Stored(3, "moonbus.events.request.received.x", b"[1, 2]"),
        Stored(4, "moonbus.events.request.received.x", alter(gw[0][1], seq="1")),
        Stored(5, "moonbus.events.request.received.x", alter(gw[0][1], prev="00")),
    ]
    malformed = "malformed chain fields (publisher, seq, prev, prev_ts, digest)"
    assert [(p.kind, p.stream_seq, p.detail) for p in verify(stored, SECRET).problems] == [
        ("forged", 2, "not JSON"), ("forged", 3, "not a JSON object"), ("forged", 4, malformed),
        ("forged", 5, malformed)]


def test_a_wrong_digest_from_an_unknown_publisher_is_forged():
    gw = make_chain(n=2)
    intruder = make_chain("gateway/evil/cccc", n=1, secret=b"x" * 32)  # sealed with another secret
    report = verify(make_stored(gw[0], intruder[0], gw[1]), SECRET)
    assert report.problems == [Problem("forged", "gateway/evil/cccc", 1, 2, intruder[0][0],
                                       "digest does not verify; no authentic event of this publisher")]
    assert [c.publisher for c in report.chains] == [GW]


def test_a_copy_beside_the_authentic_event_is_forged():
    gw = make_chain(n=3)
    subject, payload = gw[1]
    copy = (subject, alter(payload, data={"i": 99}))
    report = verify(make_stored(*gw, copy), SECRET)
    assert report.problems == [Problem("forged", GW, 2, 4, subject,
                                       "digest does not verify; the authentic event of this seq is stored too")]
    assert report.marks[2] == "verified" and report.marks[4] == "forged"


def test_an_edited_event_is_named_and_not_counted_as_dropped():
    gw = make_chain(n=3)
    subject, payload = gw[1]
    edited = (subject, alter(payload, data={"i": 99}))
    report = verify(make_stored(gw[0], edited, gw[2]), SECRET)
    assert report.problems == [Problem("edited", GW, 2, 2, subject,
                                       "digest does not verify: not the event its publisher published")]
    assert report.chains == [ChainSummary(GW, 2, 1, 3, 1)]


def test_an_edit_republished_at_the_end_is_edited():
    """How one edits a stream: delete the original, publish a changed copy (stored last)."""
    gw = make_chain(n=4)
    subject, payload = gw[1]
    stored = make_stored(gw[0], gw[2], gw[3], (subject, alter(payload, ts=1.5)))
    assert [(p.kind, p.publisher, p.seq, p.stream_seq) for p in verify(stored, SECRET).problems] == [
        ("edited", GW, 2, 4)]


def test_an_event_moved_to_another_subject_is_edited():
    gw = make_chain(n=3)
    report = verify(make_stored(gw[0], ("moonbus.events.request.failed.r1", gw[1][1]), gw[2]), SECRET)
    assert [(p.kind, p.seq, p.subject) for p in report.problems] == [("edited", 2, "moonbus.events.request.failed.r1")]


def test_the_seal_covers_the_bytes_stored():
    gw = make_chain(n=3)
    subject, payload = gw[1]
    respaced = json.dumps(json.loads(payload)).encode()  # the same content, other bytes
    assert json.loads(respaced) == json.loads(payload)
    assert [(p.kind, p.seq) for p in verify(make_stored(gw[0], (subject, respaced), gw[2]), SECRET).problems] == [
        ("edited", 2)]


def test_dropped_events_are_reported_as_runs():
    gw = make_chain(n=7)
    stored = make_stored(gw[0], gw[2], gw[5], gw[6])  # seq 2, then 4 and 5, are gone
    report = verify(stored, SECRET)
    assert report.problems == [
        Problem("dropped", GW, 2, 2, gw[2][0], "seq 2 missing before stream seq 2", (1, 2)),
        Problem("dropped", GW, 4, 3, gw[5][0], "seqs 4-5 (2 events) missing before stream seq 3", (2, 3)),
    ]
    assert report.marks == {1: "verified", 2: "verified", 3: "verified", 4: "verified"}
    assert report.chains == [ChainSummary(GW, 4, 1, 7, 2)]


def test_a_chain_may_start_mid_way_only_before_the_read_is_complete():
    gw = make_chain(n=5, t0=100.0)  # seq k has ts 99 + k; seq 3's prev_ts is 101
    stored = make_stored(gw[2], gw[3], gw[4], first=10)
    assert verify(stored, SECRET, since=101.5).ok  # seq 2 was published before the window
    assert verify(stored, SECRET, since=101.0).problems == [  # seq 2 was published inside it
        Problem("dropped", GW, 1, 10, gw[2][0], "seqs 1-2 (2 events) missing before stream seq 10", (0, 10))]
    # a gap inside the window is reported all the same
    assert [(p.kind, p.seq) for p in verify(make_stored(gw[2], gw[4]), SECRET, since=101.5).problems] == [
        ("dropped", 4)]


def test_duplicated_and_reordered_events():
    gw = make_chain(n=4)
    report = verify(make_stored(gw[0], gw[1], gw[1], gw[3], gw[2]), SECRET)
    assert report.problems == [
        Problem("duplicated", GW, 2, 3, gw[1][0], "already stored at stream seq 2"),
        Problem("reordered", GW, 3, 5, gw[2][0], "stored after seq 4 of its chain"),
    ]
    assert report.marks == {1: "verified", 2: "verified", 3: "duplicated", 4: "verified", 5: "reordered"}


def test_an_authentic_event_from_another_history_is_unlinked():
    """Only a holder of the secret can do this (two processes that share a publisher name)."""
    a, b = make_chain(GW, n=2), make_chain(GW, n=3, t0=200.0)
    report = verify(make_stored(a[0], a[1], b[2]), SECRET)
    assert report.problems == [Problem("unlinked", GW, 3, 3, b[2][0],
                                       "prev is not the digest of the chain's previous event")]


def test_holes_in_the_stream_seqs_are_deleted_messages():
    """Chains cannot see a chain's last events (or a whole chain) deleted; the stream's seqs can."""
    gw = make_chain(GW, 3)
    # deleted: stream seq 1, 4-6 (say another publisher's whole chain) and 8-9 (the newest)
    stored = [Stored(seq, subject, payload) for seq, (subject, payload) in zip((2, 3, 7), gw)]
    report = verify(stored, SECRET, stream_seqs=(1, 9))
    assert report.problems == [Problem("deleted", "", 0, 1, "", "stream seq 1 deleted", (0, 2)),
                               Problem("deleted", "", 0, 4, "", "stream seqs 4-6 (3 messages) deleted", (3, 7)),
                               Problem("deleted", "", 0, 8, "", "stream seqs 8-9 (2 messages) deleted", (7, 10))]
    assert report.marks == {2: "verified", 3: "verified", 7: "verified"}
    assert [p.stream_seq for p in verify(stored, SECRET).problems] == [4]  # default: first to last read


def test_expected_stream_seqs():
    records = make_stored(*make_chain(n=2), first=5)
    assert expected_stream_seqs(records, 9, head_kept=True) == (1, 9)  # nothing expired: from seq 1
    assert expected_stream_seqs(records, 9, head_kept=False) == (5, 9)
    assert expected_stream_seqs(records, 3, head_kept=False) == (5, 6)  # published during the read
    assert expected_stream_seqs([], 4, head_kept=True) == (1, 4)
    assert expected_stream_seqs([], 0, head_kept=True) is None


class FakeNats:
    """A broker with JetStream as the event publisher sees it: every publish reaches the stream's
    subjects and is acknowledged on its reply subject, except that the first `fail` are refused
    (503: a stream leader being elected); a message id already stored is not stored again."""

    is_connected = True

    def __init__(self, fail: int = 0) -> None:
        self.published: list[tuple[str, bytes]] = []
        self.ids: list[str] = []
        self.fail = fail
        self.acks = None
        self.publishers: list = []  # what common.bus.Connection keeps: the publishers to flush at shutdown
        self.denied: set[str] = set()  # and the subjects the broker refused it

    def new_inbox(self) -> str:
        return "_INBOX.test"

    async def subscribe(self, subject: str, cb) -> None:
        self.acks = cb

    async def publish(self, subject: str, data: bytes, reply: str = "", headers: dict | None = None) -> None:
        if self.fail:
            self.fail -= 1
            await self.acks(SimpleNamespace(subject=reply, headers={"Status": "503"}, data=b""))
            return
        if headers["Nats-Msg-Id"] not in self.ids:
            self.ids.append(headers["Nats-Msg-Id"])
            self.published.append((subject, data))
        await self.acks(SimpleNamespace(subject=reply, headers=None, data=b'{"stream": "MOONBUS_EVENTS", "seq": 1}'))


async def test_the_event_publisher_seals_what_it_publishes():
    nc = FakeNats()
    events = bus.EventPublisher(nc, "gateway", "gw-1", secret=SECRET, incarnation="abc")
    await events.request("received", "r1", prompt_tokens=3)
    await events.instance("joined", "decode-0", role="decode")
    await events.kv("stored", "node-1", {"request_id": "r1", "keys": [1, 2]})
    assert await events.flush(5)
    assert [s for s, _ in nc.published] == [
        "moonbus.events.request.received.r1", "moonbus.events.instance.joined.decode-0", "moonbus.events.kv.stored.node-1"]
    sealed = [Event.from_bytes(data) for _, data in nc.published]
    assert [(e.publisher, e.seq) for e in sealed] == [("gateway/gw-1/abc", 1), ("gateway/gw-1/abc", 2),
                                                     ("gateway/gw-1/abc", 3)]
    assert sealed[2].prev == sealed[1].digest and sealed[2].data == {"request_id": "r1", "keys": [1, 2]}
    stored = [Stored(i + 1, s, d) for i, (s, d) in enumerate(nc.published)]
    assert verify(stored, SECRET).ok


async def test_events_not_acknowledged_are_sent_again_in_order_and_stored_once():
    nc = FakeNats(fail=3)
    events = bus.EventPublisher(nc, "gateway", "gw-1", secret=SECRET, incarnation="abc")
    for i in range(5):
        await events.request("received", f"r{i}")
    assert await events.flush(10)
    assert [s for s, _ in nc.published] == [f"moonbus.events.request.received.r{i}" for i in range(5)]
    stored = [Stored(i + 1, s, d) for i, (s, d) in enumerate(nc.published)]
    assert verify(stored, SECRET).ok  # no gap, no reordering
    await events.close()


async def test_without_a_secret_events_are_as_before():
    nc = FakeNats()
    publisher = bus.EventPublisher(nc, "gateway", "gw-1")
    await publisher.request("received", "r1")
    assert await publisher.flush(5)
    event = Event.from_bytes(nc.published[0][1])
    assert (event.publisher, event.seq, event.prev, event.digest) == ("", 0, "", "")
    # an older event (no chain fields) still decodes
    old = Event.from_bytes(b'{"kind":"received","ts":1.0,"service":"gateway","instance_id":"g","data":{}}')
    assert (old.seq, old.digest) == (0, "")


def test_request_record_takes_its_events_and_the_gaps_next_to_them():
    gw = make_chain(n=5)  # one event each for r0..r4
    # r2's event (seq 3, stream seq 3) deleted: a gap in its chain and in the stream, between r1's and r3's
    stored = [Stored(seq, subject, payload) for seq, (subject, payload) in zip((1, 2, 4, 5), gw[:2] + gw[3:])]
    report = verify(stored, SECRET)
    assert [(p.kind, p.gap) for p in report.problems] == [("deleted", (2, 4)), ("dropped", (2, 4))]
    for request_id, stream_seq, gaps in [("r0", 1, []), ("r1", 2, ["deleted", "dropped"]),
                                         ("r3", 4, ["deleted", "dropped"]), ("r4", 5, [])]:
        mine, around = request_record(report, stored, request_id)
        assert [r.stream_seq for r in mine] == [stream_seq]
        assert [p.kind for p in around] == gaps
    assert request_record(report, stored, "nope") == ([], [])


def test_parse_since():
    assert parse_since("10m", 1000.0) == 400.0
    assert parse_since("1h", 7200.0) == 3600.0
    assert parse_since("30s", 100.0) == 70.0
    assert parse_since("2024-01-02T03:04:05+00:00", 0.0) == 1704164645.0
    with pytest.raises(ValueError, match="expected an ISO time"):
        parse_since("yesterday", 0.0)


def test_complete_since_takes_the_latest_bound():
    assert complete_since(500.0, 0.0, 1000.0, None) == (500.0, "the stream's creation")
    assert complete_since(500.0, 100.0, 1000.0, None) == (900.0, "events older than 100 s expire")
    assert complete_since(500.0, 100.0, 1000.0, 950.0) == (950.0, "--since")


# --- signatures: each publisher's own key -------------------------------------------------

def test_a_publisher_signs_its_events_and_no_other_key_passes_for_it():
    gateway, conductor = signing.Signer(bytes(range(32))), signing.Signer(bytes(range(1, 33)))
    signers = signing.Signers({"gateway/gateway": gateway.public_hex, "conductor/conductor": conductor.public_hex})
    subject = "moonbus.events.request.completed.r9"
    signed = Chain(SECRET, GW, gateway).seal(subject, make_event("completed", request_id="r9"))
    assert orjson.loads(signed)["sig"] and Event.from_bytes(signed).kind == "completed"
    report = verify(make_stored((subject, signed)), SECRET, signers=signers)
    assert report.ok and report.marks == {1: "verified"}
    # a holder of the cluster secret and the conductor's key makes up a gateway event: sealed, not the gateway's
    made_up = Chain(SECRET, "gateway/gateway/cccc", conductor).seal(subject, make_event("completed", request_id="r9"))
    unsigned = Chain(SECRET, "gateway/gateway/dddd").seal(subject, make_event("completed", request_id="r9"))
    report = verify(make_stored((subject, made_up), (subject, unsigned)), SECRET, signers=signers)
    assert [(p.kind, p.publisher, p.stream_seq) for p in report.problems] == [
        ("forged", "gateway/gateway/cccc", 1), ("forged", "gateway/gateway/dddd", 2)]
    assert "not signed by its publisher's own key" in report.problems[0].detail
    assert verify(make_stored((subject, made_up)), SECRET).ok  # without the keys only the seal is checked
    # an event stored before its publisher had a key (a cluster started before keys existed) is sealed only
    since = signing.Signers({"gateway/gateway": {"key": gateway.public_hex, "since": 1000.0}})
    assert verify([Stored(1, subject, unsigned, stored_at=900.0)], SECRET, signers=since).ok
    assert [p.kind for p in verify([Stored(1, subject, unsigned, stored_at=1100.0)], SECRET, signers=since).problems] == ["forged"]


def test_signatures_are_the_bytes_the_cryptography_package_made_and_each_library_verifies_the_others():
    """The signer moved from `cryptography` (OpenSSL) to PyNaCl (libsodium): Ed25519 is deterministic,
    so the same key signs the same digest into the same bytes, and the events stored before the move
    still verify (and an auditor on either library takes the other's events)."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

    seed = bytes(range(7, 39))
    ours, theirs = signing.Signer(seed), Ed25519PrivateKey.from_private_bytes(seed)
    digests = [hashlib.sha256(bytes([i])).digest() for i in range(20)] + [b"", b"x" * 1000]
    for data in digests:
        assert ours.sign(data) == theirs.sign(data).hex()
    assert ours.public_hex == Ed25519PublicKey.from_public_bytes(bytes.fromhex(ours.public_hex)).public_bytes_raw().hex()
    signers = signing.Signers({"gateway/gateway": ours.public_hex})
    publisher = "gateway/gateway/aaaa"
    assert all(signers.verify(publisher, data, theirs.sign(data).hex()) for data in digests)
    assert all(ours.signed(data, theirs.sign(data).hex()) for data in digests)
    theirs_public = theirs.public_key()
    for data in digests:
        theirs_public.verify(bytes.fromhex(ours.sign(data)), data)  # raises if it does not verify
    # what does not verify, whichever way it is wrong
    signature = ours.sign(digests[0])
    flipped = signature[:-1] + ("0" if signature[-1] != "0" else "1")
    for wrong in (flipped, signature[:-2], "", "zz" * 64, ours.sign(digests[1])):
        assert not signers.verify(publisher, digests[0], wrong) and not ours.signed(digests[0], wrong)
    assert not signers.verify("conductor/conductor/aaaa", digests[0], signature)  # nobody registered


def test_the_checkpoint_finds_a_rebuilt_rewound_shrunk_or_emptied_stream(tmp_path):
    auditor = signing.Signer(bytes(range(32)))
    records = make_stored(*make_chain(n=3, t0=1000.0))
    report = verify(records, SECRET)
    state = checkpoint.StreamState(created=500.0, last_seq=3, max_age_s=3600.0, max_bytes=1 << 30, bytes=1000)
    path = tmp_path / "audit" / "checkpoint.json"
    checkpoint.write(path, checkpoint.Checkpoint(state, checkpoint.heads_of(report, records), 1100.0), auditor)
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    saved, problems = checkpoint.read(path, auditor)
    assert problems == [] and saved.heads == {GW: (3, orjson.loads(records[2].payload)["digest"], 3, 1002.0)}
    assert checkpoint.check(saved, state, records, wall_now=1200.0) == []
    # the stream deleted and made again, with nothing in it
    rebuilt = checkpoint.StreamState(created=1150.0, last_seq=0, max_age_s=3600.0, max_bytes=1 << 30)
    assert [p.kind for p in checkpoint.check(saved, rebuilt, [], wall_now=1200.0)] == ["rebuilt", "rewound", "vanished"]
    # its max age shrunk to 20 s: the events expired at once
    shrunk = checkpoint.StreamState(created=500.0, last_seq=3, max_age_s=20.0, max_bytes=1 << 30)
    assert [p.kind for p in checkpoint.check(saved, shrunk, [], wall_now=1200.0)] == ["shrunk", "vanished"]
    # expired as the limits allow: nothing to say
    assert checkpoint.check(saved, state, [], wall_now=1002.0 + 3601.0) == []
    # the file edited
    whole = json.loads(path.read_text())
    whole["checkpoint"]["stream"]["last_seq"] = 1
    path.write_text(json.dumps(whole))
    saved, problems = checkpoint.read(path, auditor)
    assert saved is None and [p.kind for p in problems] == ["forged"]
