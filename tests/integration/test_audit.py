"""The tamper-evident audit log on a real cluster: `moonbus audit verify` passes on the stream as the
services wrote it, then names a forged, a dropped and an edited event (publisher and seq)."""

from __future__ import annotations

import asyncio
import datetime
import json
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from common import bus
from common.audit import Stored
from schemas import subjects
from schemas.events import Event
from tests.integration.conftest import collect_request_events, post, start_cluster
from tools.moonbus.cluster.security import instance_user
from tools.moonbus.observe.audit import read_stream

pytestmark = pytest.mark.integration

REPO = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def audited(tmp_path_factory, tiny_profile):
    cluster = start_cluster(tmp_path_factory.mktemp("audit"), profile=tiny_profile)
    yield cluster
    cluster.stop()


def moonbus_audit(cluster, *args: str) -> subprocess.CompletedProcess:
    """`moonbus audit ...` as an operator runs it: the local cluster's auditor and secret, by --home."""
    return subprocess.run([sys.executable, "-m", "tools.moonbus.cli", "audit", *args, "--home", str(cluster.spec.home)],
                          capture_output=True, text=True, timeout=120, cwd=REPO)


async def complete(cluster, prompt: str) -> str:
    status, body, _ = await post(f"{cluster.spec.url}/v1/completions",
                                 {"model": "tiny-random", "prompt": prompt, "max_tokens": 4, "temperature": 0})
    assert status == 200, body
    await collect_request_events(cluster.spec.nats_url, body["id"])  # its terminal event is stored
    return body["id"]


def find(records: list[Stored], kind: str, request_id: str) -> tuple[Stored, dict]:
    subject = subjects.request_event(kind, request_id)
    record = next(r for r in records if r.subject == subject)
    return record, json.loads(record.payload)


async def test_audit_verify_names_forged_dropped_and_edited_events(audited):
    cluster = audited
    first = await complete(cluster, "Hello there, how are you?")
    mid = time.time()
    others = [await complete(cluster, prompt) for prompt in ("Once upon a time", "The quick brown fox")]

    clean = moonbus_audit(cluster, "verify")
    print(clean.stdout)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert "OK: every chain is complete and unaltered" in clean.stdout
    for service in ("gateway/gateway/", "conductor/conductor/", "prefill/prefill-0/", "decode/decode-0/"):
        assert service in clean.stdout
    everything = json.loads(moonbus_audit(cluster, "verify", "--json").stdout)
    window = moonbus_audit(cluster, "verify", "--since", datetime.datetime.fromtimestamp(mid).isoformat(), "--json")
    assert window.returncode == 0, window.stdout + window.stderr
    assert 0 < json.loads(window.stdout)["events"] < everything["events"]  # chains start mid-way: fine

    # tamper, as the admin
    records = (await read_stream(cluster.spec.nats_url, None, None)).records
    nc = await bus.connect(cluster.spec.nats_url, "test-tamper")
    js = nc.jetstream()
    try:
        # (1) forged: an event nobody sealed, and a sealed event's altered copy beside it
        forged = Event("completed", time.time(), "gateway", "gateway", first, {"completion_tokens": 999})
        forged_ack = await js.publish(subjects.request_event("completed", first), forged.to_bytes())
        real, body = find(records, "completed", others[0])
        altered = body | {"data": body["data"] | {"completion_tokens": 0}}  # the digest stays its last member
        copy_ack = await js.publish(real.subject, orjson.dumps(altered))
        # (2) dropped: delete the first request's `received` (the gateway published more after it)
        dropped, dropped_body = find(records, "received", first)
        await js.delete_msg(subjects.EVENTS_STREAM, dropped.stream_seq)
        # (3) edited: change a field of its `routed`, delete the original, publish the changed copy
        routed, routed_body = find(records, "routed", first)
        msg = await js.get_msg(subjects.EVENTS_STREAM, routed.stream_seq)
        changed = json.loads(msg.data)
        changed["data"]["decode"] = "decode-evil"
        await js.delete_msg(subjects.EVENTS_STREAM, routed.stream_seq)
        edited_ack = await js.publish(routed.subject, json.dumps(changed).encode())
    finally:
        await nc.drain()

    tampered = moonbus_audit(cluster, "verify")
    print(tampered.stdout)
    assert tampered.returncode == 1, tampered.stdout + tampered.stderr
    report = json.loads(moonbus_audit(cluster, "verify", "--json").stdout)
    named = sorted((p["kind"], p["publisher"], p["seq"], p["stream_seq"]) for p in report["problems"])
    after_dropped = find(records, "first_token", first)[0].stream_seq  # the gateway's next event
    # the stream's own seqs show both deletions too (one run when they were neighbours)
    lo, hi = sorted((dropped.stream_seq, routed.stream_seq))
    deleted = [("deleted", "", 0, lo)] + ([("deleted", "", 0, hi)] if hi > lo + 1 else [])
    assert named == sorted([
        ("forged", "", 0, forged_ack.seq),
        ("forged", body["publisher"], body["seq"], copy_ack.seq),
        ("dropped", dropped_body["publisher"], dropped_body["seq"], after_dropped),
        ("edited", routed_body["publisher"], routed_body["seq"], edited_ack.seq),
        *deleted,
    ])
    for kind, publisher, seq, stream_seq in named:
        if publisher:
            assert f"{kind.upper():<10} {publisher} seq {seq}  stream seq {stream_seq}" in tampered.stdout
    assert f"FORGED     (no publisher)  stream seq {forged_ack.seq}" in tampered.stdout

    record = moonbus_audit(cluster, "request", first)
    print(record.stdout)
    assert record.returncode == 1
    lines = record.stdout.splitlines()
    assert lines[0].startswith(f"request {first}: ")
    completed = find(records, "completed", first)[0].stream_seq
    assert any(line.split()[:2] == ["verified", f"#{completed}"] for line in lines)
    assert any(line.split()[:2] == ["FORGED", f"#{forged_ack.seq}"] for line in lines)
    assert any(line.split()[:2] == ["EDITED", f"#{edited_ack.seq}"] for line in lines)
    assert f"DROPPED    {dropped_body['publisher']} seq {dropped_body['seq']}" in record.stdout
    assert f"DELETED    (the stream)  stream seq {lo}" in record.stdout
    assert not any(f"#{dropped.stream_seq} " in line for line in lines)  # it is gone
    untouched = moonbus_audit(cluster, "request", others[1])
    assert untouched.returncode == 0, untouched.stdout


async def test_the_stream_shrunk_or_rebuilt_and_a_made_up_request_are_found(audited):
    """With the admin user the stream's max age was shrunk to 20 s, or the stream deleted and made
    again, and verify passed; with the gateway's user and the cluster key a made-up request's
    sealed chain showed as verified. The auditor's checkpoint (written by the clean verify of the
    test above) and the publishers' own keys find all three."""
    cluster = audited
    nc = await bus.connect(cluster.spec.nats_url, "test-tamper")
    js = nc.jetstream()
    try:
        config = (await js.stream_info(subjects.EVENTS_STREAM)).config
        await js.update_stream(msgspec_replace(config, max_age=20.0, duplicate_window=10.0))
        shrunk = moonbus_audit(cluster, "verify")
        print(shrunk.stdout)
        assert shrunk.returncode == 1 and "SHRUNK" in shrunk.stdout, shrunk.stdout + shrunk.stderr
        await js.delete_stream(subjects.EVENTS_STREAM)
        await bus.ensure_events_stream(nc)  # made again, empty, as the conductor makes it
    finally:
        await nc.drain()
    rebuilt = moonbus_audit(cluster, "verify")
    print(rebuilt.stdout)
    assert rebuilt.returncode == 1, rebuilt.stdout + rebuilt.stderr
    assert "REBUILT" in rebuilt.stdout and "REWOUND" in rebuilt.stdout and "VANISHED" in rebuilt.stdout

    # a made-up request, sealed with the cluster key and sent with the gateway's own NATS user
    from common.config import NatsAuth
    from common.security import read_secret

    user = instance_user("gateway")
    auth = NatsAuth(user, str(cluster.secrets.password_file(user)))
    gw = await bus.connect(cluster.spec.nats_addr, "gateway", auth)
    try:
        publisher = bus.EventPublisher(gw, "gateway", "gateway", secret=read_secret(cluster.secrets.cluster_key))
        await publisher.request("received", "cmpl-madeup", prompt_tokens=3)
        await publisher.request("completed", "cmpl-madeup", completion_tokens=3)
        await publisher.flush()
    finally:
        await bus.shutdown(gw)
    record = moonbus_audit(cluster, "request", "cmpl-madeup")
    print(record.stdout)
    assert record.returncode == 1
    assert [line.split()[0] for line in record.stdout.splitlines()[1:3]] == ["FORGED", "FORGED"]
    assert "(no verified terminal event)" in record.stdout
    real = await complete(cluster, "A real one, after all that")
    assert moonbus_audit(cluster, "request", real).returncode == 0  # signed by its publishers: verified


def msgspec_replace(config, **changes):
    import dataclasses

    return dataclasses.replace(config, **changes)


async def test_tap_follows_the_stream_and_a_signal_ends_it_at_once(audited):
    """`moonbus tap` prints events as they come; Ctrl-C (or SIGTERM) stops it while it waits for
    the next one (it used to wait for the next event, up to an hour, first)."""
    cluster = audited
    tap = subprocess.Popen([sys.executable, "-m", "tools.moonbus.cli", "tap", "--kind", "completed", "--json",
                            "--home", str(cluster.spec.home)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        line, sent = "", set()
        for attempt in range(60):  # until the tap is subscribed, each completion is one more chance
            sent.add(await complete(cluster, f"tap me {attempt}"))
            ready = await asyncio.to_thread(select.select, [tap.stdout], [], [], 1.0)
            if ready[0]:
                line = tap.stdout.readline()
                break
        event = json.loads(line)
        assert event["kind"] == "completed" and event["request_id"] in sent
        tap.send_signal(signal.SIGTERM)  # idle now: nothing else completes
        assert tap.wait(30) == 0
    finally:
        if tap.poll() is None:
            tap.kill()
