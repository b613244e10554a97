"""Every door, tried as an outsider (or a compromised service) would: the API, the bus, the KV link.

One cluster (tiny-random) with API keys for three tenants and the closed bus `moonbus up` runs:
acme and globex are ordinary tenants, tiny may have one request in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import struct
import threading

import aiohttp
import msgspec
import nats
import pytest
from prometheus_client.parser import text_string_to_metric_families

from common import bus
from common.security import LINK_NONCE_BYTES, link_proof, read_secret
from common.transport import Transports, TransportError, checksum
from schemas import subjects
from schemas.events import Event
from schemas.index import IndexDumpReply, IndexDumpRequest
from schemas.pool import KvEventData, SnapshotReply
from schemas.transfer import CallFrame, WriteFrame
from schemas.tokens import TokenChunk
from schemas.workers import WorkerInfo
from tests.integration.conftest import start_cluster, stream_tokens
from tests.wait import until
from tools.moonbus.cluster import keys as keys_tool
from tools.moonbus.cluster.security import instance_user

pytestmark = pytest.mark.integration
END_OF_FORGERIES = b'{"forgeries": "done"}'


@pytest.fixture(scope="module")
def guarded(tmp_path_factory, tiny_profile):
    home = tmp_path_factory.mktemp("security")
    key_file = home / "api-keys.json"
    issued = {}
    for tenant, extra in (("acme", []), ("globex", []), ("tiny", ["--max-concurrent", "1"]), ("ops", ["--operator"])):
        issued[tenant] = add_key(key_file, tenant, extra)
    cluster = start_cluster(home, profile=tiny_profile, api_keys=str(key_file))
    yield cluster, issued
    cluster.stop()


def add_key(key_file, tenant: str, extra: list[str]) -> str:
    import argparse
    import contextlib
    import io

    parser = argparse.ArgumentParser()
    keys_tool.add_arguments(parser)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert keys_tool.run(parser.parse_args(["add", "--tenant", tenant, "--file", str(key_file), *extra])) == 0
    return out.getvalue().strip()


async def call(cluster, body: dict | bytes, key: str | None = None, path="/v1/completions"):
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with aiohttp.ClientSession() as session:
        async with session.post(cluster.spec.url + path, data=data, headers=headers) as resp:
            return resp.status, await resp.json(content_type=None), resp.headers


def completion(prompt: str, **extra) -> dict:
    return {"model": "tiny-random", "prompt": prompt, "max_tokens": 4, "temperature": 0, **extra}


async def test_no_key_or_a_wrong_key_is_401_in_the_openai_shape(guarded):
    cluster, issued = guarded
    for key in (None, "mb-not-a-key"):
        status, body, _ = await call(cluster, completion("hello"), key)
        assert status == 401
        assert body["error"]["code"] == "invalid_api_key" and body["error"]["message"]
    status, body, _ = await call(cluster, completion("hello"), issued["acme"])
    assert status == 200 and body["usage"]["completion_tokens"] == 4
    key_file = cluster.spec.api_keys
    assert issued["acme"] not in open(key_file).read()  # stored hashed only


async def test_a_tenant_sees_nothing_of_another_tenants_cache_even_under_the_same_salt(guarded):
    cluster, issued = guarded
    prompt = "the quarterly numbers of acme corporation, strictly confidential " * 6
    await call(cluster, completion(prompt), issued["acme"])
    _, again, _ = await call(cluster, completion(prompt), issued["acme"])
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # acme's own cache
    _, other, _ = await call(cluster, completion(prompt), issued["globex"])
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # nothing leaks to globex
    assert other["choices"][0]["text"] == again["choices"][0]["text"]  # the same answer, computed afresh
    salted = "a system prompt acme salts, and globex guesses the salt of " * 6
    await call(cluster, completion(salted, cache_salt="partners-v1"), issued["acme"])
    _, again, _ = await call(cluster, completion(salted, cache_salt="partners-v1"), issued["acme"])
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # acme's salt, acme's cache
    _, guessed, _ = await call(cluster, completion(salted, cache_salt="partners-v1"), issued["globex"])
    assert guessed["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # a salt is scoped to its tenant


async def test_the_dashboard_shows_a_tenant_only_its_own_requests_and_nothing_of_the_clusters(guarded):
    cluster, issued = guarded
    status, _, headers = await call(cluster, completion("whose decision is this?"), issued["acme"])
    assert status == 200
    rid = headers["X-Request-Id"]
    states = {}
    async with aiohttp.ClientSession() as session:
        for tenant in ("acme", "globex", "ops"):
            for _ in range(600):  # the routed event reaches the gateway's dashboard shortly after the reply
                async with session.get(f"{cluster.spec.url}/dashboard/state",
                                       headers={"Authorization": f"Bearer {issued[tenant]}"}) as resp:
                    assert resp.status == 200
                    states[tenant] = await resp.json()
                seen = {d["request_id"] for d in states[tenant]["decisions"]}
                if tenant == "globex" or rid in seen:
                    break
                await asyncio.sleep(0.1)
    acme, globex, ops = states["acme"], states["globex"], states["ops"]
    assert rid in {d["request_id"] for d in acme["decisions"]} and {d["tenant"] for d in acme["decisions"]} == {"acme"}
    assert rid not in {d["request_id"] for d in globex["decisions"]}
    assert {d.get("tenant") for d in globex["decisions"]} <= {"globex"}
    # every tenant's traffic: the instances' queues and KV, the pools, the requests in flight, the
    # prediction error, the candidates' batches; a tenant sees none of it, and its own outcomes only
    cluster_wide = {"conductor", "instances", "nodes", "ttft_error"}
    for state in (acme, globex):
        assert not cluster_wide & set(state) and state["scope"] == "tenant"
        assert all(d["prefill_costs"] == d["decode_costs"] == [] for d in state["decisions"])
    completed = {t: s["outcomes"]["totals"]["completed"] for t, s in states.items()}
    assert completed["acme"] >= 1 and completed["acme"] + completed["globex"] <= completed["ops"]
    assert cluster_wide | {"outcomes"} <= set(ops) and ops["scope"] == "cluster"  # an operator's key sees everything
    mine = next(d for d in ops["decisions"] if d["request_id"] == rid)
    assert mine["tenant"] == "acme" and mine["prefill_costs"] and mine["decode_costs"]
    assert ops["instances"] and ops["outcomes"]["totals"]["completed"] >= 1


async def test_with_keys_on_metrics_are_an_operators_and_health_tells_strangers_only_readiness(guarded):
    cluster, issued = guarded
    async with aiohttp.ClientSession() as session:
        async def get(path: str, key: str | None):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            async with session.get(cluster.spec.url + path, headers=headers) as resp:
                return resp.status, await resp.text()

        status, text = await get("/metrics", None)
        assert status == 401 and json.loads(text)["error"]["code"] == "invalid_api_key"
        status, text = await get("/metrics", issued["acme"])
        assert status == 403 and "operator" in json.loads(text)["error"]["message"]
        status, text = await get("/metrics", issued["ops"])
        assert status == 200 and "moonbus_gateway_requests_total" in text  # every tenant's requests counted
        status, text = await get("/health", None)
        assert status == 200 and set(json.loads(text)) == {"status", "model", "instances"}
        status, text = await get("/health", issued["acme"])
        assert set(json.loads(text)) == {"status", "model", "instances"}
        status, text = await get("/health", issued["ops"])
        assert {"in_flight", "decode_kv", "kv_layouts"} <= set(json.loads(text))


async def test_an_oversized_body_is_413_and_a_tenant_over_its_limit_gets_429(guarded):
    cluster, issued = guarded
    huge = json.dumps(completion("x" * (5 << 20))).encode()
    status, body, _ = await call(cluster, huge, issued["acme"])
    assert status == 413 and "larger than" in body["error"]["message"]
    (status, body, headers), rest = await while_one_is_in_flight(
        cluster, issued["tiny"], lambda: call(cluster, completion("second"), issued["tiny"]))
    assert status == 429 and "1 requests in flight" in body["error"]["message"]
    assert int(headers["Retry-After"]) >= 1
    assert rest.rstrip().endswith("data: [DONE]")


async def while_one_is_in_flight(cluster, key: str, meanwhile):
    """Start a streamed request of the key's tenant at the first gateway; once it is in flight for
    sure (its first event came) freeze its decode instance, so that it stays so with no timer to
    race, and await `meanwhile()`; then let it finish. Returns (what meanwhile returned, the rest
    of the first stream)."""
    decode = cluster.procs["decode-0"].popen
    async with aiohttp.ClientSession() as session:
        async with session.post(cluster.spec.url + "/v1/completions",
                                json=completion("slow " * 20, max_tokens=64, ignore_eos=True, stream=True),
                                headers={"Authorization": f"Bearer {key}"}) as first:
            assert first.status == 200
            await first.content.readline()  # its first event: admitted, prefilled
            decode.send_signal(signal.SIGSTOP)
            try:
                answer = await meanwhile()
            finally:
                decode.send_signal(signal.SIGCONT)
            return answer, (await first.read()).decode()


@pytest.fixture(scope="module")
def two_doors(tmp_path_factory, tiny_profile):
    """Two gateway replicas in front of one cluster, its KV links on TLS (moonbus up --link-tls);
    tenant tiny may have one request in flight, hog and fair set no limit (a fair share beyond 2:
    --fair-share-floor). A frozen decode instance is not declared lost (the tests freeze it to hold
    requests in flight, with no timer to race)."""
    home = tmp_path_factory.mktemp("two-doors")
    keys = {"tiny": add_key(home / "api-keys.json", "tiny", ["--max-concurrent", "1"]),
            "hog": add_key(home / "api-keys.json", "hog", []), "fair": add_key(home / "api-keys.json", "fair", [])}
    cluster = start_cluster(home, profile=tiny_profile, api_keys=str(home / "api-keys.json"), gateways=2,
                            link_tls=True, service_args={"gateway": ["--fair-share-floor", "2", "--probe-after", "600"],
                                                         "conductor": ["--heartbeat-timeout", "600"]})
    yield cluster, keys
    cluster.stop()


async def test_a_tenants_limit_holds_across_gateway_replicas(two_doors):
    """Limits were counted per gateway process: N replicas gave a tenant N times its limit."""
    cluster, keys = two_doors
    key = keys["tiny"]
    second_door = f"http://{cluster.spec.host}:{cluster.spec.port + 1}"
    admin = await nats.connect(cluster.spec.nats_url, allow_reconnect=False)
    told = await admin.subscribe(subjects.tenant_usage("gateway"))

    async def at_the_second_door():
        heard = 0  # the first gateway has told the others twice (the second heard the first for sure)
        while heard < 2:
            usage = json.loads((await told.next_msg(timeout=30)).data)
            heard += usage["tenants"].get("tiny", [0])[0] == 1
        # (admitted, it would wait for the frozen decode instance: a bound, so that it fails, not hangs)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            async with session.post(second_door + "/v1/completions", json=completion("second"),
                                    headers={"Authorization": f"Bearer {key}"}) as second:
                return second.status, await second.json(content_type=None)

    (status, body), rest = await while_one_is_in_flight(cluster, key, at_the_second_door)
    await admin.close()
    assert status == 429 and "1 requests in flight" in body["error"]["message"], body
    assert rest.rstrip().endswith("data: [DONE]")
    status, body, _ = await call(cluster, completion("after"), key)  # the first ended: the tenant may again
    assert status == 200, body


async def test_a_tenant_without_limits_cannot_crowd_out_another(two_doors):
    """Reproduced: a tenant without limits (moonbus keys add's default) held 38 streams and another
    tenant waited 79 s. Alone it may hold any number; while another tenant is served, its share."""
    cluster, keys = two_doors
    decode = cluster.procs["decode-0"].popen
    url = cluster.spec.url + "/v1/completions"
    streams = []

    async def open_stream(session, tenant: str, prompt: str):
        response = await session.post(url, json=completion(prompt, max_tokens=32, ignore_eos=True, stream=True),
                                      headers={"Authorization": f"Bearer {keys[tenant]}"})
        assert response.status == 200, await response.text()
        await response.content.readline()  # its first token: admitted and prefilled
        streams.append(response)

    async with aiohttp.ClientSession() as session:
        await open_stream(session, "hog", "hog 0")
        decode.send_signal(signal.SIGSTOP)  # what was admitted stays in flight
        try:
            for i in (1, 2):  # alone, the hog may hold more than the floor
                await open_stream(session, "hog", f"hog {i}")
            await open_stream(session, "fair", "the other tenant")  # admitted at once
            # (admitted, it would wait for the frozen decode instance: a bound, so that it fails, not hangs)
            status, body, headers = await asyncio.wait_for(call(cluster, completion("hog 3"), keys["hog"]), 60)
            assert status == 429 and "fair share while 2 tenants" in body["error"]["message"], body
            assert int(headers["Retry-After"]) >= 1
        finally:
            decode.send_signal(signal.SIGCONT)
        for response in streams:  # every admitted request completes
            assert (await response.read()).decode().rstrip().endswith("data: [DONE]")
    status, body, _ = await call(cluster, completion("hog again"), keys["hog"])  # alone again: served
    assert status == 200, body


async def test_the_kv_links_run_tls_when_asked(two_doors):
    """Reproduced: after the link's handshake the KV travelled with an unkeyed checksum only, so a
    relay on the path could rewrite it (tests/unit/test_link_tls.py shows a relay reading and
    rewriting nothing once TLS is on). With --link-tls every process that opens KV links has its
    own certificate of the cluster's link CA, handoffs go through TLS, and a peer holding the
    cluster secret but no certificate is refused."""
    cluster, keys = two_doors
    key = keys["fair"]
    secrets_dir = cluster.spec.home / "secrets"
    issued = {p.name for p in secrets_dir.glob("link-*")}
    assert {"link-ca.pem", "link-ca.key", "link-messenger-d0.pem", "link-messenger-p0.pem", "link-prefill-0.pem"} <= issued
    assert all((secrets_dir / name).stat().st_mode & 0o077 == 0 for name in issued)
    messenger = await heartbeat_of(cluster, "messenger", "messenger-d0")  # where every handoff lands
    status, body, _ = await call(cluster, completion("through the tunnel"), key)  # prefill-0 -> TLS -> node-d0
    assert status == 200 and body["usage"]["completion_tokens"] == 4, body
    member_without_certificate = Transports("tcp", read_secret(cluster.secrets.cluster_key), 10.0)
    with pytest.raises(TransportError):
        with member_without_certificate.connect({"tcp": messenger.transfer_addr}) as channel:
            channel.call("complete", b"")
    log = cluster.log_dir / "messenger-d0.log"
    # the refusal is logged when the listener gives up on it (its handshake deadline)
    await until(lambda: "certificate of the cluster's link CA" in log.read_text(), "messenger-d0 logs the refusal")
    assert "refused: no TLS session with a certificate of the cluster's link CA" in log.read_text()
    assert not cluster.dead()


async def test_the_bus_refuses_strangers_and_keeps_each_role_to_its_subjects(guarded):
    cluster, _ = guarded
    with pytest.raises(Exception, match="Authorization Violation"):
        await nats.connect(cluster.spec.nats_addr, connect_timeout=2, allow_reconnect=False, max_reconnect_attempts=0)
    secrets = cluster.secrets
    admin = await nats.connect(cluster.spec.nats_url, allow_reconnect=False)
    seen: list[str] = []
    heard_all = asyncio.Event()

    async def record(msg):
        if msg.data == b'{"forged": true}':  # the real instances heartbeat meanwhile: only ours count
            seen.append(msg.subject)
        elif msg.data == END_OF_FORGERIES:
            heard_all.set()

    await admin.subscribe("moonbus.>", cb=record)
    await bus.flush(admin)
    attempts = {  # role -> what it must not publish
        instance_user("gateway"): [subjects.worker_heartbeat("decode", "decode-0"), subjects.kv_event("stored", "node-p0"),
                                   subjects.tokens_from(subjects.gateway_tokens("x"), "worker", "decode-0"),
                                   subjects.tenant_usage("gateway-7")],
        instance_user("decode-0"): [subjects.request_event("completed", "cmpl-forged"), subjects.kv_event("evicted", "node-d0"),
                                    subjects.tokens_from(subjects.gateway_tokens("gateway"), "worker", "prefill-0"),
                                    subjects.tokens_from(subjects.gateway_tokens("gateway"), "conductor", "conductor")],
        instance_user("prefill-0"): [subjects.request_event("failed", "cmpl-forged"), subjects.REQUEST_CANCEL],
        "auditor": [subjects.worker_heartbeat("prefill", "prefill-0"), subjects.CONDUCTOR_ROUTE],
    }
    denied: dict[str, list[str]] = {}
    for role, forbidden in attempts.items():
        errors: list[Exception] = []

        async def on_error(exc, errors=errors):
            errors.append(exc)

        nc = await nats.connect(cluster.spec.nats_addr, user=role, password=secrets.password(role),
                                error_cb=on_error, allow_reconnect=False)
        for subject in forbidden:
            await nc.publish(subject, b'{"forged": true}')
        await bus.flush(nc)  # the broker's refusals come before its answer to the flush: all are in
        denied[role] = [str(e) for e in errors]
        await nc.close()
    # the broker handled every forgery before it answered their flushes, and passes on what it
    # takes in order: a message published after them reaches `record` after any forgery it let through
    await admin.publish("moonbus.test.forgeries-done", END_OF_FORGERIES)
    await until(heard_all.is_set, "the message published after the forgeries comes back")
    await admin.close()
    for role, forbidden in attempts.items():
        for subject in forbidden:
            assert subject not in seen, (role, subject)
            assert any(subject.lower() in d.lower() for d in denied[role]), (role, subject, denied[role])
    # replies: each user reads its own inbox only (every role once read `_INBOX.>`: others' replies)
    errors = []

    async def on_sub_error(exc):
        errors.append(str(exc))

    decode = instance_user("decode-0")
    nc = await nats.connect(cluster.spec.nats_addr, user=decode, password=secrets.password(decode),
                            error_cb=on_sub_error, allow_reconnect=False, inbox_prefix=f"_INBOX_{decode}")
    # ... and its own tasks only (prefill-1's user once read prefill-0's: request ids and prompts)
    for theirs in ("_INBOX.>", "_INBOX_gateway.>", "_INBOX_conductor.>", subjects.decode_tasks("decode-1")):
        await nc.subscribe(theirs)
    await nc.subscribe(f"_INBOX_{decode}.>")
    await nc.subscribe(subjects.decode_tasks("decode-0"))
    await bus.flush(nc)  # the broker's refusals come before its answer to the flush: all are in
    await nc.close()
    refused = [e for e in errors if "subscription" in e.lower()]
    assert len(refused) == 4 and not any(f"_inbox_{decode}".lower() in e.lower() for e in refused), errors
    assert any("decode-1" in e for e in refused) and not any("decode-0.tasks" in e for e in refused), errors
    # the roles' shared users (rights over every instance of a role) are not users of this bus:
    # each process has its own (issue: with the `decode` user, refusing decode-0's joins made it give up)
    for role in ("prefill", "decode", "messenger", "cache_index", "coupled"):
        with pytest.raises(Exception, match="Authorization Violation"):
            await nats.connect(cluster.spec.nats_addr, user=role, password=secrets.password(role), connect_timeout=2,
                               allow_reconnect=False, max_reconnect_attempts=0)


async def test_an_instance_speaks_only_for_itself(guarded):
    """With the cache index's credentials, heartbeats in decode-0's name with another model once made
    the conductor refuse decode-0, which exited; the supervisor gave up on it after six exits."""
    cluster, issued = guarded
    real = await heartbeat_of(cluster, "decode", "decode-0")
    forged = msgspec.structs.replace(real, model="another-model", incarnation="forged").to_bytes()
    user = instance_user("cache_index")
    errors: list[str] = []

    async def on_error(exc):
        errors.append(str(exc))

    nc = await nats.connect(cluster.spec.nats_addr, user=user, password=cluster.secrets.password(user),
                            error_cb=on_error, allow_reconnect=False, inbox_prefix=f"_INBOX_{user}")
    theirs, own = subjects.worker_heartbeat("decode", "decode-0"), subjects.worker_heartbeat("cache_index", "cache-index")
    ignored = await spoofed_heartbeats(cluster)
    for _ in range(6):  # on decode-0's subject (the bus refuses), and on its own subject in decode-0's name
        await nc.publish(theirs, forged)
        await nc.publish(own, forged)
        await nc.publish(subjects.control_alive("decode-0"), b"{}")
    await bus.flush(nc)  # the broker's refusals come before its answer to the flush: all are in
    await nc.close()
    assert any(theirs in e for e in errors) and any(subjects.control_alive("decode-0") in e for e in errors), errors

    async def all_ignored() -> bool:
        return await spoofed_heartbeats(cluster) >= ignored + 6

    # the conductor ignored every forgery that reached it (none went on to be heard as decode-0's)...
    await until(all_ignored, "the conductor ignores all 6 forgeries")
    spoofed = await stored_event(cluster, subjects.instance_event("spoofed", "decode-0"))
    assert spoofed["data"]["subject"] == own, spoofed
    assert not await stored(cluster, subjects.instance_event("refused", "decode-0"))  # ...so it refused no one
    assert cluster.procs["decode-0"].popen.poll() is None  # it never heard a refusal
    status, reply, _ = await call(cluster, completion("still served?"), issued["acme"])
    assert status == 200, reply


async def test_a_messenger_cannot_make_the_cluster_forget_another_node(guarded):
    """A heartbeat's node was not tied to the messenger that sent it: messenger-d0's user announcing
    node-p0's messenger's departure dropped node-p0 from the conductor's and the cache index's maps.
    A node is now held by its own messenger; another's word about it is ignored and counted."""
    cluster, issued = guarded
    prompt = "a prefix node-p0 keeps in its pool, whoever says it left " * 6
    await call(cluster, completion(prompt), issued["acme"])
    _, warm, _ = await call(cluster, completion(prompt), issued["acme"])
    cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0
    real = await heartbeat_of(cluster, "messenger", "messenger-d0")
    user = instance_user("messenger-d0")
    nc = await nats.connect(cluster.spec.nats_addr, user=user, password=cluster.secrets.password(user),
                            allow_reconnect=False, inbox_prefix=f"_INBOX_{user}")
    lie = msgspec.structs.replace(real, node="node-p0", leaving=True).to_bytes()
    for _ in range(20):  # on its own subject, in its own name, about another node
        await nc.publish(subjects.worker_heartbeat("messenger", "messenger-d0"), lie)
    await bus.flush(nc)
    await nc.close()

    async def counted(process: str, name: str) -> float:
        async with aiohttp.ClientSession() as session:
            async with session.get(cluster.procs[process].metrics) as resp:
                text = await resp.text()
        return sum(x.value for f in text_string_to_metric_families(text) for x in f.samples
                   if x.name == name and x.labels.get("kind", "node") == "node")

    async def both_ignored() -> bool:
        return await counted("conductor", "moonbus_conductor_spoofed_total") >= 20 \
            and await counted("cache_index", "moonbus_cache_index_spoofed_total") >= 20

    await until(both_ignored, "the conductor and the cache index ignore all 20 lies")
    _, again, _ = await call(cluster, completion(prompt), issued["acme"])
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == cached  # node-p0's prefix is still found
    assert not cluster.dead()


async def test_no_worker_can_stretch_an_answer_past_its_max_tokens(guarded):
    """A worker's user once sent 60 tokens with finish_reason stop into a live request that asked
    for 8, and the client got all 60. The gateway now ends a stream at its max_tokens, whatever
    the request's own routed decode instance sends (who else may send them: test_token_senders)."""
    cluster, issued = guarded
    decode = cluster.procs["decode-0"].popen
    user = instance_user("decode-0")
    nc = await nats.connect(cluster.spec.nats_addr, user=user, password=cluster.secrets.password(user),
                            allow_reconnect=False, inbox_prefix=f"_INBOX_{user}")
    body = completion("stretch me", max_tokens=8, stream=True, return_token_ids=True)

    async def stretch(first: dict) -> None:  # the first token: inject the rest, stretched
        forged = TokenChunk(first["id"], 1, [5] * 60, finish_reason="stop", source="decode-0")
        await nc.publish(subjects.tokens_from(subjects.gateway_tokens("gateway"), "worker", "decode-0"), forged.to_bytes())
        await bus.flush(nc)
        decode.send_signal(signal.SIGCONT)

    decode.send_signal(signal.SIGSTOP)  # the first token comes from prefill; the rest waits for decode
    try:
        tokens, finish = await stream_tokens(f"{cluster.spec.url}/v1/completions", body, issued["acme"], stretch)
    finally:
        decode.send_signal(signal.SIGCONT)
        await nc.close()
    assert len(tokens) == 8 and finish == "length", (len(tokens), finish)


async def test_a_messenger_speaks_only_for_its_own_nodes_pool(guarded):
    """A KV event says which blocks a node holds; any messenger's user could once publish them for
    any node, so one node's messenger could make the index (and every route) believe another node
    holds a prefix. Now the bus takes a messenger's KV events only on its own node's subjects, and
    the cache index and conductors take an event only from the subject of the node it names."""
    cluster, issued = guarded
    admin = await nats.connect(cluster.spec.nats_url)
    snap = SnapshotReply.from_bytes((await admin.request(subjects.messenger_control("node-d0", "snapshot"), b"{}",
                                                         timeout=10)).data)
    forged_keys = [0x7EA5E0000 + i for i in range(4)]
    forged = Event("stored", 0.0, "messenger", "messenger-p0",
                   data=KvEventData("node-d0", snap.epoch, snap.seq + 1, forged_keys, "dram").to_dict()).to_bytes()
    user = instance_user("messenger-p0")
    errors: list[str] = []

    async def on_error(exc):
        errors.append(str(exc))

    nc = await nats.connect(cluster.spec.nats_addr, user=user, password=cluster.secrets.password(user),
                            error_cb=on_error, allow_reconnect=False, inbox_prefix=f"_INBOX_{user}")
    theirs, own = subjects.kv_event("stored", "node-d0"), subjects.kv_event("stored", "node-p0")
    await nc.publish(theirs, forged)  # on node-d0's subject: the bus refuses
    await nc.publish(own, forged)  # on its own subject, in node-d0's name: the followers drop it
    await bus.flush(nc)  # the broker's refusal comes before its answer to the flush
    await nc.close()
    assert any(theirs in e for e in errors), errors
    index = cluster.log_dir / "cache_index.log"
    await until(lambda: "not that node's subject" in index.read_text(), "the cache index drops the forged event")
    dump = IndexDumpReply.from_bytes((await admin.request(subjects.INDEX_DUMP, IndexDumpRequest("node-d0").to_bytes(),
                                                          timeout=10)).data)
    await admin.close()
    assert not set(forged_keys) & set(dump.keys)
    assert f"KV event for node node-d0 on subject {own} dropped" in index.read_text()
    status, reply, _ = await call(cluster, completion("still served?"), issued["acme"])
    assert status == 200, reply


async def stored(cluster, subject: str) -> bool:
    """Whether the events stream holds an event under `subject` now."""
    from nats.js.errors import NotFoundError

    nc = await nats.connect(cluster.spec.nats_url, allow_reconnect=False)
    try:
        await nc.jetstream().get_last_msg(subjects.EVENTS_STREAM, subject)
        return True
    except NotFoundError:
        return False
    finally:
        await nc.close()


async def spoofed_heartbeats(cluster) -> float:
    """How many heartbeats the conductor has ignored for speaking for an instance their subject does not name."""
    async with aiohttp.ClientSession() as session:
        async with session.get(cluster.procs["conductor"].metrics) as resp:
            text = await resp.text()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "moonbus_conductor_spoofed_total" and s.labels.get("kind") == "heartbeat")


async def heartbeat_of(cluster, role: str, instance_id: str = "") -> WorkerInfo:
    nc = await nats.connect(cluster.spec.nats_url, allow_reconnect=False)
    try:
        sub = await nc.subscribe(subjects.WORKER_HEARTBEAT_ALL)
        while True:
            info = WorkerInfo.from_bytes((await sub.next_msg(timeout=10)).data)
            if info.role == role and instance_id in ("", info.instance_id):
                return info
    finally:
        await nc.close()


def link_connection(addr: str) -> socket.socket:
    host, port = addr.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def closed_on_us(sock: socket.socket) -> bool:
    try:
        return sock.recv(64) == b""
    except ConnectionResetError:
        return True


def op(kind: bytes, header: bytes) -> bytes:
    return kind + struct.pack(">I", len(header)) + header


async def test_the_kv_link_refuses_strangers_and_writes_outside_its_regions(guarded):
    cluster, issued = guarded
    messenger = await heartbeat_of(cluster, "messenger")
    payload = b"\1" * 512
    stray = WriteFrame(region="nowhere", pieces=[[1 << 40, len(payload)]]).to_bytes()
    writes = op(b"W", stray) + payload + struct.pack(">Q", checksum([payload]))
    # 1. no secret: the handshake fails, nothing is read
    with link_connection(messenger.transfer_addr) as sock:
        sock.recv(LINK_NONCE_BYTES)
        sock.sendall(os.urandom(LINK_NONCE_BYTES) + b"\0" * 32)
        with contextlib.suppress(OSError):
            sock.sendall(writes)
        assert closed_on_us(sock)
    # ... and the refusal reaches the audit log (the messenger may write it: it once could not, and
    # the refused event held back every later event of that messenger)
    refused = await stored_event(cluster, subjects.instance_event("link_refused", messenger.instance_id))
    assert refused["data"]["node"] == messenger.node and refused["data"]["reason"]
    # 2. with the cluster secret (a compromised node): a write to a region that is not there, or
    # past its end, lands nowhere and the next call says so; a path for a region name is refused
    secret = read_secret(cluster.secrets.cluster_key)
    for attempt in (writes, op(b"W", b'{"region": "../../../tmp/x", "pieces": [[0, 512]]}') + payload):
        with link_connection(messenger.transfer_addr) as sock:
            nonce = sock.recv(LINK_NONCE_BYTES)
            sock.sendall(os.urandom(LINK_NONCE_BYTES) + link_proof(secret, nonce, b"client"))
            sock.recv(32)
            sock.sendall(attempt + op(b"C", CallFrame(op="complete", nbytes=0).to_bytes()))
            try:
                reply = sock.recv(4096)
            except ConnectionResetError:
                reply = b""
            assert reply == b"" or b'"ok":false' in reply, reply
    # the cluster is unharmed: a request still goes through prefill -> link -> decode
    status, body, _ = await call(cluster, completion("still serving?"), issued["acme"])
    assert status == 200 and body["usage"]["completion_tokens"] == 4
    assert not cluster.dead()


@pytest.mark.parametrize("source", ["127.0.0.2", "127.0.0.1"])
async def test_a_stranger_holding_the_kv_door_delays_no_one_and_floods_no_log(guarded, source):
    """Reproduced: holding the KV listener's 64 slots from one address made every handoff fail
    (500 "cannot reach the KV destination") and wrote a log line per refusal; so did holding 16
    from 127.0.0.1, the address the cluster's own prefill connects from (the door now gives a
    newcomer the oldest waiting connection's place, and the prefill tries a link turned away again)."""
    cluster, issued = guarded
    messenger = await heartbeat_of(cluster, "messenger", "messenger-d0")  # where every handoff lands
    host, port = messenger.transfer_addr.rsplit(":", 1)
    stop = threading.Event()
    opened = []

    def hold():  # from `source`, up to 100 connections open at all times, none proving anything
        held: list[socket.socket] = []
        while not stop.is_set():
            held = [c for c in held if c.fileno() != -1]
            while len(held) < 100 and not stop.is_set():
                c = socket.socket()
                c.bind((source, 0))
                try:
                    c.connect((host, int(port)))
                except OSError:
                    c.close()
                    break
                held.append(c)
                opened.append(1)
            for c in held:  # let go of those the door closed
                c.setblocking(False)
                try:
                    if c.recv(64) == b"":
                        c.close()
                except BlockingIOError:
                    pass
                except OSError:
                    c.close()
            stop.wait(0.05)
        for c in held:
            c.close()

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    try:
        while len(opened) < 200:  # the door is under siege before the requests come
            await asyncio.sleep(0.1)
        for i in range(4):
            status, body, _ = await call(cluster, completion(f"through the siege {i}"), issued["acme"])
            assert status == 200 and body["usage"]["completion_tokens"] == 4, body
    finally:
        stop.set()
        holder.join(30)
    async with aiohttp.ClientSession() as session:
        async with session.get(cluster.procs[messenger.instance_id].metrics) as resp:
            text = await resp.text()
    refused = next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == "moonbus_messenger_link_refused_total")
    assert refused >= 100  # most of the stranger's connections were turned away at the door
    log = (cluster.log_dir / f"{messenger.instance_id}.log").read_text()
    lines = sum(f"connection from {source}:" in line and "refused" in line for line in log.splitlines())
    assert lines < refused / 10  # a line per address now and then, not one per refusal
    assert not cluster.dead()


async def test_the_pipeline_listener_is_closed_when_nothing_pipelines(guarded):
    cluster, _ = guarded
    prefill = await heartbeat_of(cluster, "prefill")
    assert prefill.transfer_addr == ""  # no port to connect to at all


async def stored_event(cluster, subject: str, timeout_s: float = 60) -> dict:
    """The first event stored in the stream under `subject` (the admin user reads it)."""
    from nats.js.api import ConsumerConfig, DeliverPolicy

    nc = await nats.connect(cluster.spec.nats_url)
    try:
        sub = await nc.jetstream().subscribe(subject, ordered_consumer=True,
                                             config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL))
        return json.loads((await sub.next_msg(timeout=timeout_s)).data)
    finally:
        await nc.drain()
