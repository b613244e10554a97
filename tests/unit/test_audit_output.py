"""What `moonbus audit` and `moonbus tap` print of the bus is escaped, and a completed request must
be signed by each service that takes part in it (one stolen key cannot tell a whole story)."""

from __future__ import annotations

import argparse
import asyncio
import json

import msgspec
import pytest

from common import signing
from common.audit import Chain, Stored, verify
from schemas.events import Event
from tools.moonbus.observe import audit as audit_cli
from tools.moonbus.observe.audit import Read, format_problem, missing_services, print_request, request_record, \
    unwitnessed
from tools.moonbus.observe.escape import printable, printable_json
from tools.moonbus.observe.tap import format_event

SECRET = bytes(range(32))
HOSTILE = "r1\x1b[2J\u202e"  # clears the screen; shows the rest of the line reversed
KEYS = {service: signing.Signer(bytes([i + 1]) * 32) for i, service in enumerate(
    ("gateway", "conductor", "prefill", "decode", "coupled"))}
SIGNERS = signing.Signers({"gateway/gateway": KEYS["gateway"].public_hex,
                           "conductor/conductor": KEYS["conductor"].public_hex,
                           "prefill/prefill-0": KEYS["prefill"].public_hex,
                           "decode/decode-0": KEYS["decode"].public_hex,
                           "prefill/c0-prefill": KEYS["coupled"].public_hex,
                           "decode/c0-decode": KEYS["coupled"].public_hex})
# a request's events in path order: (publisher, signing key, kind, data)
WHOLE = [("gateway/gateway/g1", "gateway", "received", {"prompt_tokens": 3}),
         ("conductor/conductor/c1", "conductor", "routed", {"admitted": True}),
         ("prefill/prefill-0/p1", "prefill", "prefilled", {"finished": False}),
         ("prefill/prefill-0/p1", "prefill", "kv_transferred", {}),
         ("gateway/gateway/g1", "gateway", "first_token", {}),
         ("decode/decode-0/d1", "decode", "decode_joined", {}),
         ("decode/decode-0/d1", "decode", "decode_finished", {"tokens": 3}),
         ("gateway/gateway/g1", "gateway", "completed", {"completion_tokens": 4})]


def story(steps, request_id: str = "r1") -> list[Stored]:
    """The request's events as stored: each sealed into its publisher's chain and signed with the
    key named (its event names the publisher's service, whoever signs it)."""
    chains: dict[str, Chain] = {}
    stored = []
    for i, (publisher, key, kind, data) in enumerate(steps):
        chain = chains.setdefault(publisher, Chain(SECRET, publisher, KEYS[key]))
        service, instance = publisher.split("/")[:2]
        subject = f"moonbus.events.request.{kind}.{request_id}"
        event = msgspec.structs.asdict(Event(kind, 100.0 + i, service, instance, request_id, data))
        stored.append(Stored(i + 1, subject, chain.seal(subject, event)))
    return stored


def problems_of(steps, whole: bool = True) -> list[tuple[str, str]]:
    """(kind, detail) of each problem `moonbus audit` finds in the story of `steps`."""
    stored = story(steps)
    report = verify(stored, SECRET, signers=SIGNERS)
    return [(p.kind, p.detail) for p in report.problems + unwitnessed(report, stored, whole)]


# --- escaping ------------------------------------------------------------------------------

def test_control_characters_are_escaped_and_the_rest_is_left_as_it_is():
    assert printable(HOSTILE) == "r1\\x1b[2J\\u202e"
    assert printable("\t\n\x00\x7f\x85\u200f\u2028\U000e0001") == "\\x09\\x0a\\x00\\x7f\\x85\\u200f\\u2028\\U000e0001"
    for text in ("plain", "héllo wörld 世界 \u00a0 \\x1b", ""):
        assert printable(text) == text


def test_a_json_line_stays_the_same_json_with_its_controls_escaped():
    raw = '{"request_id":"r1\u202e\x7f",\n"data":{"reason":"\\u001b[2J"}}'
    safe = printable_json(raw)
    assert json.loads(safe) == json.loads(raw)
    assert safe.isprintable() and "\\u202e" in safe


def test_tap_prints_an_events_strings_escaped():
    event = Event("failed\x1b[31m", 100.0, "gateway\u202e", "gw\x07", HOSTILE, {"reason\x1b": "\x1b[2J\u202e"})
    line = format_event(event)
    assert "\x1b" not in line and "\u202e" not in line and "\x07" not in line
    assert "r1\\x1b[2J\\u202e" in line and "failed\\x1b[31m" in line and "gateway\\u202e/gw\\x07" in line
    assert 'reason\\x1b="\\u001b[2J\\u202e"' in line


def test_audit_prints_a_requests_hostile_ids_reasons_and_garbage_escaped(capsys):
    stored = story([("gateway/gateway/g1", "gateway", "received", {}),
                    ("gateway/gateway/g1", "gateway", "failed", {"reason": "\x1b[2J\u202e"})], HOSTILE)
    stored.append(Stored(3, f"moonbus.events.request.failed.{HOSTILE}", HOSTILE.encode() + b"\xff not json"))
    report = verify(stored, SECRET, signers=SIGNERS)
    mine, around = request_record(report, stored, HOSTILE)
    print_request(report, mine, around, HOSTILE)
    for p in report.problems:
        print(format_problem(p))
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\u202e" not in out
    assert f"request {printable(HOSTILE)}: 3 events" in out
    assert "FORGED" in out and "moonbus.events.request.failed.r1\\x1b[2J\\u202e" in out  # the subject
    assert "r1\\x1b[2J\\u202e\ufffd not json" in out  # what does not parse, escaped
    assert '"\\u001b[2J\\u202e"' in out  # the reason


# --- who took part: the verified signer, not the service an event names ----------------------

def test_a_completed_request_signed_by_every_service_is_clean():
    assert problems_of(WHOLE) == []


def test_a_request_told_with_the_gateway_key_alone_is_missing_the_others():
    alone = [("gateway/gateway/g1", "gateway", kind, data) for _, _, kind, data in WHOLE]
    assert problems_of(alone) == [("missing", "request r1 completed, but no event of it is signed by conductor or "
                                              "prefill or decode, which must take part")]
    # the other services' events, written as theirs with the gateway's key: forged, and still missing
    posing = [(publisher, "gateway", kind, data) for publisher, _, kind, data in WHOLE]
    kinds = [kind for kind, _ in problems_of(posing)]
    assert kinds == ["forged"] * 5 + ["missing"]


def test_a_request_whose_start_is_not_in_the_read_is_checked_only_when_the_read_is_whole():
    late = [step for step in WHOLE if step[2] not in ("received", "routed")]
    assert problems_of(late, whole=False) == []
    assert [kind for kind, _ in problems_of(late, whole=True)] == ["missing"]


def test_decode_need_not_take_part_when_prefill_made_every_token():
    short = [("gateway/gateway/g1", "gateway", "received", {}),
             ("conductor/conductor/c1", "conductor", "routed", {}),
             ("prefill/prefill-0/p1", "prefill", "prefilled", {"finished": True}),
             ("gateway/gateway/g1", "gateway", "first_token", {}),
             ("gateway/gateway/g1", "gateway", "completed", {"completion_tokens": 1})]
    assert problems_of(short) == []
    events = [Event.from_bytes(r.payload) for r in story(short)]
    assert missing_services(events[:-1] + [msgspec.structs.replace(events[-1], data={"completion_tokens": 4})]) \
        == ["decode"]
    assert missing_services(events[:-1] + [msgspec.structs.replace(events[-1], data={"completion_tokens": "1"})]) \
        == ["decode"]


def test_a_coupled_instances_halves_take_part_as_prefill_and_decode():
    coupled = {"prefill/prefill-0/p1": "prefill/c0-prefill/p2", "decode/decode-0/d1": "decode/c0-decode/d2"}
    steps = [(coupled.get(publisher, publisher), "coupled" if publisher in coupled else key, kind, data)
             for publisher, key, kind, data in WHOLE]
    assert problems_of(steps) == []


def run_audit(tmp_path, monkeypatch, stored: list[Stored], *command: str) -> int:
    secret_file = tmp_path / "cluster.key"
    secret_file.write_text(SECRET.hex())
    keys = {who: {"key": signer.public_hex, "since": 0.0} for who, signer in (
        ("gateway/gateway", KEYS["gateway"]), ("conductor/conductor", KEYS["conductor"]),
        ("prefill/prefill-0", KEYS["prefill"]), ("decode/decode-0", KEYS["decode"]))}
    signing.write_signers(tmp_path / signing.SIGNERS_FILE, keys)

    async def read_stream(url, auth, since):
        return Read(stored, 0.0, audit_cli.CREATION, (1, len(stored)))

    monkeypatch.setattr(audit_cli, "read_stream", read_stream)
    args = argparse.Namespace(audit_command=command[0], request_id=command[-1], since=None, home=tmp_path,
                              nats_url="nats://127.0.0.1:1", secret_file=str(secret_file), signers_file=None,
                              json=False, checkpoint=None)
    return asyncio.run(audit_cli.audit(args))


@pytest.mark.parametrize("command", [("verify",), ("request", "r1")])
def test_moonbus_audit_fails_a_request_the_gateway_told_alone(tmp_path, monkeypatch, capsys, command):
    assert run_audit(tmp_path, monkeypatch, story(WHOLE), *command) == 0
    alone = story([("gateway/gateway/g1", "gateway", kind, data) for _, _, kind, data in WHOLE])
    assert run_audit(tmp_path, monkeypatch, alone, *command) == 1
    out = capsys.readouterr().out
    assert "MISSING    gateway/gateway/g1 seq 8  stream seq 8" in out
    assert "no event of it is signed by conductor or prefill or decode" in out
