"""Dead and draining workers: requests resume elsewhere, limits end in one clear error, nothing hangs.

One cluster of 2 prefill + 2 decode instances (tiny-random). Processes are killed with SIGKILL
while they hold requests, or sent SIGTERM (a drain). The gateway here resumes a request at most
once after its first token (`--max-migrations 1`, default 3), so the limit is reached by killing
twice. Decode instances drain for up to 120 s (`--drain-grace`), which a 60-token request of
tiny-random finishes inside; the test of what outlives the grace restarts them with a grace of 0,
which any request still running outlives.

A second cluster (1 prefill + 2 decode, one row per decode instance) holds requests in every state
a decode instance can hold them when it dies: its processes are frozen (SIGSTOP) to keep each
request where it is, so its conductor takes nobody for dead by silence (the supervisor of `moonbus
up` says who died, as it does in production) and its gateway does not probe quiet requests.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
import uuid
import urllib.request
from dataclasses import dataclass, field

import aiohttp
import pytest

from common import bus
from schemas import subjects
from schemas.events import TERMINAL_KINDS
from tests.integration.conftest import assert_greedy, collect_request_events, post, start_cluster
from tests.wait import until
from tools.moonbus.cluster.supervisor import SupervisorEvents
from tools.moonbus.cluster.up import supervise

pytestmark = pytest.mark.integration

# generous: covers the conductor's heartbeat timeout (3 s) on a loaded 2-core machine
BOUND_S = 60
GRACE_S = 120
PROMPT = "a long story about the moon and its cake " * 4


# NOTE: the clusters here run float32: a resumed request's KV is recomputed by a prefill (or
# reloaded), so its tokens may part from an undisturbed run's at a near-tie (tests/greedy.py), and
# bfloat16's logits tie often on tiny-random (its steps are 1/16 at 16): a float32 sequence rarely
# meets one, so each stream is compared with transformers' greedy output over its whole length.
# The dtype-sensitive tests (bytes, tiers) run in both dtypes elsewhere.
DTYPE = "float32"


def assert_greedy_of(tokens: list[int], tiny_in, prompt: str, max_tokens: int, what: str = "") -> None:
    """The stream's tokens are transformers' greedy output for the prompt: none lost or repeated."""
    tokenizer, model = tiny_in(DTYPE)
    assert_greedy(tokens, model, tokenizer(prompt)["input_ids"], max_tokens, ignore_eos=True, what=what)


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tiny_profile):
    cluster = start_cluster(tmp_path_factory.mktemp("failures"), prefill=2, decode=2, profile=tiny_profile, dtype=DTYPE,
                            service_args={"gateway": ["--max-migrations", "1", "--route-timeout", str(BOUND_S)],
                                          "decode": ["--drain-grace", str(GRACE_S)]})
    yield cluster
    cluster.stop()


BLOCK = 16  # the cluster's block_tokens
LONG = 1200  # tokens: still decoding when its instance is told to stop, after 5 of them


def proc(cluster, name):
    return cluster.procs[name].popen


def body(max_tokens: int) -> dict:
    return {"model": "tiny-random", "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "return_token_ids": True}


async def stream(cluster, payload: dict, on_event=None) -> tuple[str, list[dict]]:
    """Stream a completion; on_event(request_id, events) runs after each event (to kill things)."""
    events, request_id = [], None
    timeout = aiohttp.ClientTimeout(total=BOUND_S * 3)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.post(f"{cluster.spec.url}/v1/completions", json=payload | {"stream": True}) as resp:
            assert resp.status == 200, await resp.text()
            request_id = resp.headers["X-Request-Id"]
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                events.append({"done": True} if data == b"[DONE]" else json.loads(data))
                if on_event is not None:
                    await on_event(request_id, events)
    return request_id, events


def tokens_of(events: list[dict]) -> list[int]:
    return [t for e in events if e.get("choices") for t in e["choices"][0].get("token_ids", [])]


def kill(cluster, name: str) -> None:
    proc(cluster, name).send_signal(signal.SIGKILL)
    proc(cluster, name).wait(10)


async def event_of(cluster, request_id: str, kind: str, attempt: int = 0, timeout_s: float = BOUND_S) -> dict:
    """The first `kind` event of one attempt of a request (waits for it)."""
    from nats.js.api import ConsumerConfig, DeliverPolicy

    from common import bus
    from schemas import subjects

    nc = await bus.connect(cluster.spec.nats_url, "test-event")
    try:
        sub = await nc.jetstream().subscribe(subjects.request_event(kind, request_id), ordered_consumer=True,
                                             config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL))
        while True:
            event = json.loads((await sub.next_msg(timeout=timeout_s)).data)
            if event["data"].get("attempt", 0) == attempt:
                return event["data"]
    finally:
        await nc.drain()


async def routed(cluster, request_id: str, attempt: int) -> dict:
    """The `routed` event of one attempt of a request."""
    return await event_of(cluster, request_id, "routed", attempt)


async def wait_healthy(cluster, prefill: int, decode: int) -> None:
    deadline = time.monotonic() + BOUND_S
    while time.monotonic() < deadline:
        instances = cluster.health().get("instances", {})
        if instances.get("prefill", 0) >= prefill and instances.get("decode", 0) >= decode:
            return
        time.sleep(0.3)
    raise AssertionError(f"cluster did not come back: {cluster.health()}")


async def test_a_killed_decode_instance_hands_its_stream_to_the_other(pair, tiny_in):
    cluster = pair
    # each run in a cache namespace of its own: what the undisturbed run stored cannot help the other
    status, undisturbed, _ = await post(f"{cluster.spec.url}/v1/completions", body(400) | {"cache_salt": "undisturbed"})
    assert status == 200, undisturbed
    killed = {}

    async def kill_its_decode(request_id, events):
        if not killed and len(tokens_of(events)) >= 100:  # a few generated blocks stored by then
            decode_id = (await routed(cluster, request_id, 0))["decode_id"]
            kill(cluster, decode_id)
            killed.update(name=decode_id, at=time.monotonic(), tokens=len(tokens_of(events)))

    request_id, events = await stream(cluster, body(400) | {"cache_salt": "killed"}, kill_its_decode)
    assert killed, "the stream ended before its decode instance could be killed"
    assert events[-1] == {"done": True}
    assert not [e for e in events if "error" in e], events[-3:]
    # one stream, no token lost or repeated: greedy tokens, as the undisturbed run's
    assert_greedy_of(undisturbed["choices"][0]["token_ids"], tiny_in, PROMPT, 400, "undisturbed")
    assert_greedy_of(tokens_of(events), tiny_in, PROMPT, 400, "killed")
    assert len(tokens_of(events)) == 400
    path = await collect_request_events(cluster.spec.nats_url, request_id)
    kinds = [e["kind"] for e in path]
    assert [k for k in kinds if k in ("completed", "failed", "cancelled", "rejected")] == ["completed"]
    [migrated] = [e for e in path if e["kind"] == "migrated"]
    assert migrated["data"]["attempt"] == 1 and migrated["data"]["resumed_tokens"] >= killed["tokens"]
    second = await routed(cluster, request_id, 1)
    assert second["decode_id"] != killed["name"]
    # resumed, not recomputed: the lost instance stored the blocks it generated as it went, and the
    # new prefill reused them (its cached tokens reach past the prompt's blocks)
    prompt_tokens = undisturbed["usage"]["prompt_tokens"]
    [resumed] = [e for e in path if e["kind"] == "prefilled" and e["data"]["attempt"] == 1]
    assert prompt_tokens // BLOCK * BLOCK < resumed["data"]["cached_tokens"] <= prompt_tokens + migrated["data"]["resumed_tokens"]
    cluster.restart(killed["name"])  # as the supervisor would
    await wait_healthy(cluster, 2, 2)


async def test_a_prefill_lost_before_the_first_token_is_dispatched_again(pair):
    cluster = pair
    # frozen, it still looks alive until its heartbeats are missed; the route picks prefill-0
    # (both idle: the lowest id), then it dies without ever answering
    proc(cluster, "prefill-0").send_signal(signal.SIGSTOP)
    try:
        status, reply, headers = await post(f"{cluster.spec.url}/v1/completions", body(8), timeout_s=BOUND_S * 2)
    finally:
        kill(cluster, "prefill-0")
    assert status == 200, reply
    assert len(reply["choices"][0]["token_ids"]) == 8
    first = await routed(cluster, headers["X-Request-Id"], 0)
    second = await routed(cluster, headers["X-Request-Id"], 1)
    assert first["prefill_id"] == "prefill-0" and second["prefill_id"] == "prefill-1"
    cluster.restart("prefill-0")
    await wait_healthy(cluster, 2, 2)


async def test_past_the_migration_limit_a_stream_ends_with_one_clear_error(pair):
    cluster = pair
    killed: list[str] = []

    async def kill_twice(request_id, events):
        n = len(tokens_of(events))
        if len(killed) == 0 and n >= 10:
            killed.append((await routed(cluster, request_id, 0))["decode_id"])
            kill(cluster, killed[0])
        elif len(killed) == 1 and n >= 40:
            killed.append((await routed(cluster, request_id, 1))["decode_id"])
            kill(cluster, killed[1])

    request_id, events = await stream(cluster, body(2000), kill_twice)
    assert len(killed) == 2 and killed[0] != killed[1]
    errors = [e for e in events if "error" in e]
    assert len(errors) == 1, events[-3:]
    assert "stopped responding" in errors[0]["error"]["message"]
    assert events[-1] == {"done": True}
    path = await collect_request_events(cluster.spec.nats_url, request_id)
    assert [e["kind"] for e in path if e["kind"] in ("completed", "failed", "cancelled")] == ["failed"]
    for name in killed:
        cluster.restart(name)
    await wait_healthy(cluster, 2, 2)


def sigterm_its_decode(cluster, state: dict, then=None):
    """An on-events callback for `stream`: after 5 tokens, SIGTERM the request's decode instance
    (once; its name and when go into `state`), then run `then(request_id, events)`."""
    async def on_events(request_id, events):
        if not state and len(tokens_of(events)) >= 5:
            name = (await routed(cluster, request_id, 0))["decode_id"]
            cluster.procs[name].popen.send_signal(signal.SIGTERM)
            state.update(name=name, at=time.monotonic())
            if then is not None:
                await then(request_id, events)
    return on_events


async def test_a_draining_decode_finishes_its_request_and_gets_no_new_ones(pair, tiny_in):
    cluster = pair
    status, undisturbed, _ = await post(f"{cluster.spec.url}/v1/completions", body(60))
    assert status == 200
    state = {}

    async def route_another(_request_id, _events):  # routed while it drains: the other decode instance gets it
        status, other, headers = await post(f"{cluster.spec.url}/v1/completions", body(4))
        assert status == 200
        state["other"] = (await routed(cluster, headers["X-Request-Id"], 0))["decode_id"]

    request_id, events = await stream(cluster, body(60), sigterm_its_decode(cluster, state, then=route_another))
    assert state["other"] != state["name"]
    assert_greedy_of(undisturbed["choices"][0]["token_ids"], tiny_in, PROMPT, 60, "undisturbed")
    assert_greedy_of(tokens_of(events), tiny_in, PROMPT, 60, "drained")
    path = await collect_request_events(cluster.spec.nats_url, request_id)
    assert not [e for e in path if e["kind"] == "migrated"]  # finished where it was, within the grace
    code = cluster.procs[state["name"]].popen.wait(BOUND_S)
    assert code == 0
    cluster.restart(state["name"])
    await wait_healthy(cluster, 2, 2)


async def test_what_outlives_the_grace_period_is_resumed_elsewhere(pair, tiny_in):
    cluster = pair
    for name in ("decode-0", "decode-1"):  # no grace: whatever a draining instance holds is handed back
        cluster.restart(name, ("--drain-grace", "0"))
    await wait_healthy(cluster, 2, 2)
    state = {}
    status, undisturbed, _ = await post(f"{cluster.spec.url}/v1/completions", body(LONG))
    assert status == 200
    request_id, events = await stream(cluster, body(LONG), sigterm_its_decode(cluster, state))
    assert not [e for e in events if "error" in e], events[-3:]
    assert_greedy_of(undisturbed["choices"][0]["token_ids"], tiny_in, PROMPT, LONG, "undisturbed")
    assert_greedy_of(tokens_of(events), tiny_in, PROMPT, LONG, "resumed")
    path = await collect_request_events(cluster.spec.nats_url, request_id)
    [migrated] = [e for e in path if e["kind"] == "migrated"]
    assert "shutting down" in migrated["data"]["reason"]
    assert (await routed(cluster, request_id, 1))["decode_id"] != state["name"]
    exited = await asyncio.to_thread(cluster.procs[state["name"]].popen.wait, BOUND_S)
    assert exited == 0
    cluster.restart(state["name"])
    await wait_healthy(cluster, 2, 2)


async def test_a_request_that_arrives_while_the_conductor_restarts_waits_for_it(pair):
    # the gateway's route timeout (BOUND_S) outlives the conductor's restart
    cluster = pair
    kill(cluster, "conductor")
    user = f"test-{uuid.uuid4().hex}"
    nc = await bus.connect(cluster.spec.nats_url, "test-received")
    try:
        received = await nc.subscribe(subjects.request_event("received", "*"))
        await bus.flush(nc)
        request = asyncio.create_task(post(f"{cluster.spec.url}/v1/completions", body(8) | {"user": user}))
        while True:  # its `received` event: the gateway holds it, and asks for its route while no conductor listens
            if json.loads((await received.next_msg(timeout=BOUND_S)).data)["data"].get("user") == user:
                break
    finally:
        await nc.drain()
    assert not request.done()
    cluster.restart("conductor")
    status, reply, headers = await request
    assert status == 200, reply
    assert len(reply["choices"][0]["token_ids"]) == 8
    events = await collect_request_events(cluster.spec.nats_url, headers["X-Request-Id"])
    assert [e["kind"] for e in events if e["kind"] in TERMINAL_KINDS] == ["completed"]


async def test_a_restarted_conductor_routes_its_first_request_to_the_instances_it_heard(pair):
    """A conductor takes routes only once it has heard a prefill and a decode instance: asked every
    few milliseconds from the moment it starts, it answers the first route with a (prefill, decode)
    pair, never 503 "no instance is available" for a cluster that is there."""
    from nats.errors import NoRespondersError

    from common import bus
    from schemas import subjects
    from schemas.route import RouteReply, RouteRequest, SamplingParams
    from schemas.tokens import Cancel

    cluster = pair
    kill(cluster, "conductor")
    nc = await bus.connect(cluster.spec.nats_url, "test-first-route")
    try:
        cluster.restart("conductor")
        deadline = time.monotonic() + BOUND_S
        while True:
            route = RouteRequest("first-route", [5, 6, 7, 8, 9], SamplingParams(temperature=0.0, max_tokens=2),
                                 subjects.gateway_tokens("test-first-route"), time.time())
            try:
                msg = await nc.request(subjects.CONDUCTOR_ROUTE, route.to_bytes(), timeout=BOUND_S)
                break
            except NoRespondersError:  # not subscribed yet
                assert time.monotonic() < deadline, "the restarted conductor never took a route"
                await asyncio.sleep(0.005)
        reply = RouteReply.from_bytes(msg.data)
        assert reply.status == 200, reply.reason
        assert reply.prefill_id.startswith("prefill-") and reply.decode_id.startswith("decode-")
        await nc.publish(subjects.REQUEST_CANCEL, Cancel("first-route", 0).to_bytes())
    finally:
        await bus.shutdown(nc)


async def test_no_decode_instance_left_gives_503_with_retry_after(pair):
    cluster = pair
    for name in ("decode-0", "decode-1"):
        if proc(cluster, name).poll() is None:
            proc(cluster, name).send_signal(signal.SIGTERM)
            proc(cluster, name).wait(30)
    deadline = time.monotonic() + BOUND_S
    while time.monotonic() < deadline and cluster.health().get("instances", {}).get("decode", 0) > 0:
        time.sleep(0.2)
    status, reply, headers = await post(f"{cluster.spec.url}/v1/completions",
                                        {"model": "tiny-random", "prompt": "anyone?", "max_tokens": 4})
    assert status == 503, reply
    assert "no decode instance is available" in reply["error"]["message"]
    assert int(headers["Retry-After"]) >= 1
    status, reply, _ = await post(f"{cluster.spec.url}/v1/completions", {"model": "tiny-random"})
    assert status == 400  # validation still answers


# --- one decode instance holding requests in every state when it dies ---------------------------

@pytest.fixture(scope="module")
def rows(tmp_path_factory, tiny_profile):
    """1 prefill + 2 decode instances with one row each (a second request waits for the first),
    admitting everything, with timers that outlive the test's freezes (see the module's docstring)."""
    cluster = start_cluster(tmp_path_factory.mktemp("rehoming"), prefill=1, decode=2, profile=tiny_profile, dtype=DTYPE,
                            admission="none",
                            service_args={"conductor": ["--heartbeat-timeout", "600"],
                                          "gateway": ["--probe-after", "600", "--stall-timeout", "600"],
                                          "decode": ["--max-batch", "1"]})
    yield cluster
    cluster.stop()


@dataclass
class Stream:
    """A streamed completion read in the background: its id as soon as it is routed, its events as they come."""
    request_id: str = ""
    events: list[dict] = field(default_factory=list)
    task: asyncio.Task | None = None

    @property
    def tokens(self) -> list[int]:
        return tokens_of(self.events)

    @property
    def ended(self) -> bool:
        return self.task.done()


async def open_stream(cluster, payload: dict) -> Stream:
    """Stream a completion in the background; returns once the gateway received it, with its id.

    A stream begins with its first token (a request turned away before it gets a plain HTTP
    error), so a request held at a frozen prefill has sent no header yet: its id comes from its
    `received` event, found by the unique `user` this sends."""
    s, user = Stream(), f"test-{uuid.uuid4().hex}"
    nc = await bus.connect(cluster.spec.nats_url, "test-open-stream")
    received = await nc.subscribe(subjects.request_event("received", "*"))

    async def read() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=BOUND_S * 10)) as session:
            async with session.post(f"{cluster.spec.url}/v1/completions",
                                    json=payload | {"stream": True, "user": user}) as resp:
                assert resp.status == 200, await resp.text()
                async for line in resp.content:
                    if line.startswith(b"data: "):
                        data = line[6:].strip()
                        s.events.append({"done": True} if data == b"[DONE]" else json.loads(data))

    s.task = asyncio.create_task(read())
    try:
        while not s.request_id:
            msg = await received.next_msg(timeout=BOUND_S)
            event = json.loads(msg.data)
            if event["data"].get("user") == user:
                s.request_id = event["request_id"]
    finally:
        await nc.drain()
    return s


def gauge(cluster, name: str, metric: str) -> float:
    with urllib.request.urlopen(cluster.procs[name].metrics, timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(metric + " "):
                return float(line.split()[1])
    raise AssertionError(f"{name} has no metric {metric}")


STATES = ("decoding", "waiting for a row", "handed off, not taken", "queued at its prefill")


async def test_a_killed_decode_instance_rehomes_every_request_it_held(rows, tiny_in):
    cluster = rows
    # decode-1 leaves cleanly: every request below goes to decode-0 (the one decode instance)
    proc(cluster, "decode-1").send_signal(signal.SIGTERM)
    assert proc(cluster, "decode-1").wait(BOUND_S) == 0
    await until(lambda: cluster.health().get("instances", {}).get("decode") == 1, "decode-1 has left")

    def request(state: str, salt: str) -> dict:
        return {"model": "tiny-random", "prompt": f"{state}: {PROMPT}", "ignore_eos": True, "temperature": 0,
                "return_token_ids": True, "cache_salt": salt,
                # the decoding one outlasts the others' prefill and check-in by over a thousand steps
                "max_tokens": 1500 if state == "decoding" else 40}

    undisturbed, prompt_tokens = {}, {}
    for state in STATES:  # each in a cache namespace of its own: nothing it stored helps the killed run
        status, reply, _ = await post(f"{cluster.spec.url}/v1/completions", request(state, "undisturbed"))
        assert status == 200, reply
        undisturbed[state], prompt_tokens[state] = reply["choices"][0]["token_ids"], reply["usage"]["prompt_tokens"]

    held: dict[str, Stream] = {}
    decoding = held["decoding"] = await open_stream(cluster, request("decoding", "killed"))
    await until(lambda: len(decoding.tokens) >= 100, "decoding has 100 tokens (a few generated blocks stored)")
    waiting = held["waiting for a row"] = await open_stream(cluster, request("waiting for a row", "killed"))
    await until(lambda: gauge(cluster, "decode-0", "moonbus_decode_waiting") == 1, "decode-0 holds one waiting")
    # its first token comes from its prefill, apart from decode-0's count: the client may not have it yet
    await until(lambda: len(waiting.tokens) >= 1, "the waiting request's first token reached its client")
    proc(cluster, "decode-0").send_signal(signal.SIGSTOP)  # from here it takes nothing in and decodes nothing
    assert not decoding.ended and len(waiting.tokens) == 1  # its prefill's first token only
    handed = held["handed off, not taken"] = await open_stream(cluster, request("handed off, not taken", "killed"))
    await event_of(cluster, handed.request_id, "kv_transferred")  # its KV is on decode-0's node, its task unread
    proc(cluster, "prefill-0").send_signal(signal.SIGSTOP)
    queued = held["queued at its prefill"] = await open_stream(cluster, request("queued at its prefill", "killed"))
    assert (await routed(cluster, queued.request_id, 0))["decode_id"] == "decode-0"
    for s in held.values():
        assert (await routed(cluster, s.request_id, 0))["decode_id"] == "decode-0"

    cluster.restart("decode-1")  # the capacity the requests will move to
    await wait_healthy(cluster, 1, 2)
    stopping = threading.Event()
    supervisor = threading.Thread(target=supervise, args=(cluster, stopping.is_set), daemon=True)
    supervisor.start()  # as in moonbus up: it tells the conductor the moment a worker's process exits
    try:
        at_kill = {state: len(s.tokens) for state, s in held.items()}
        kill(cluster, "decode-0")
        for s in held.values():  # every one is handed back and resumed, the queued one too
            assert (await event_of(cluster, s.request_id, "migrated", attempt=1))["resumed_tokens"] == len(s.tokens)
        proc(cluster, "prefill-0").send_signal(signal.SIGCONT)
        await asyncio.wait_for(asyncio.gather(*(s.task for s in held.values())), BOUND_S * 5)
    finally:
        proc(cluster, "prefill-0").send_signal(signal.SIGCONT)
        stopping.set()
        supervisor.join(10)
    # what each had when its decode instance died: the prefilled ones their first token (the prefill sends it)
    assert at_kill["decoding"] >= 100 and at_kill["queued at its prefill"] == 0
    assert at_kill["waiting for a row"] == at_kill["handed off, not taken"] == 1

    for state, s in held.items():
        assert not [e for e in s.events if "error" in e], (state, s.events[-3:])
        assert s.events[-1] == {"done": True}
        # one stream, no token lost or repeated: greedy tokens, as the undisturbed run's
        assert_greedy_of(undisturbed[state], tiny_in, f"{state}: {PROMPT}", len(undisturbed[state]), state)
        assert_greedy_of(s.tokens, tiny_in, f"{state}: {PROMPT}", len(undisturbed[state]), state)
        path = await collect_request_events(cluster.spec.nats_url, s.request_id)
        assert [e["kind"] for e in path if e["kind"] in TERMINAL_KINDS] == ["completed"], state
        assert (await routed(cluster, s.request_id, 1))["decode_id"] == "decode-1", state
        resumed = await event_of(cluster, s.request_id, "prefilled", attempt=1)
        full = prompt_tokens[state] // BLOCK * BLOCK
        if state == "decoding":  # its prompt and the blocks it generated came from the pool
            assert full < resumed["cached_tokens"] <= prompt_tokens[state] + at_kill[state], resumed
        elif state != "queued at its prefill":  # prefilled once: its prompt's blocks came from the pool
            assert resumed["cached_tokens"] >= (prompt_tokens[state] - 1) // BLOCK * BLOCK > 0, (state, resumed)
    # the supervisor's thread restarted decode-0, which dies with that thread (its parent-death signal): again
    cluster.restart("decode-0")
    await wait_healthy(cluster, 1, 2)


# --- one death, found first by the gateway -----------------------------------------------------

async def test_a_death_the_gateway_finds_first_is_counted_once(tmp_path, tiny_profile):
    """A gateway's probe can find a dead prefill instance before the conductor hears of its exit:
    it resumes the request, the conductor (not knowing yet) sends the next attempt to the same dead
    instance and hands it back for that exit a moment later. One death: with one re-dispatch
    allowed, the request still completes once the instance is back. (Found by a soak that killed
    the only prefill instance every 8 s: 14 requests failed with their re-dispatches spent.) The
    conductor here hears of no exit but the one the test sends, as a supervisor would, so the
    order is fixed; the gateway probes after 15 s of quiet: the steps between two probes (reading
    one event, sending one message) take a fraction of that even on busy cores."""
    cluster = start_cluster(tmp_path, prefill=1, decode=1, profile=tiny_profile, dtype=DTYPE,
                            service_args={"conductor": ["--heartbeat-timeout", "600"],
                                          "gateway": ["--prefill-retries", "1", "--probe-after", "15",
                                                      "--migration-timeout", "600", "--stall-timeout", "600",
                                                      "--route-timeout", str(BOUND_S)]})
    try:
        proc(cluster, "prefill-0").send_signal(signal.SIGSTOP)  # it looks alive: the request is routed there
        s = await open_stream(cluster, body(8))
        assert (await routed(cluster, s.request_id, 0))["prefill_id"] == "prefill-0"
        kill(cluster, "prefill-0")  # dead; the conductor is not told
        found = await event_of(cluster, s.request_id, "migrated", attempt=1)  # the gateway's probe: no responder
        assert found["before_first_token"] and found["counted"], found
        assert (await routed(cluster, s.request_id, 1))["prefill_id"] == "prefill-0"  # the conductor did not know
        supervisor = SupervisorEvents(cluster.spec.nats_url)  # what moonbus up's supervisor says of an exit
        supervisor.ready.wait(BOUND_S)
        supervisor.exited("prefill-0", -9)
        supervisor.close()
        again = await event_of(cluster, s.request_id, "migrated", attempt=2)  # handed back for the same death
        assert "prefill-0 exited" in again["reason"] and not again["counted"], again
        cluster.restart("prefill-0")
        await asyncio.wait_for(s.task, BOUND_S * 5)
        assert len(s.tokens) == 8 and s.events[-1] == {"done": True}
        path = await collect_request_events(cluster.spec.nats_url, s.request_id)
        assert [e["kind"] for e in path if e["kind"] in TERMINAL_KINDS] == ["completed"]
    finally:
        cluster.stop()


async def test_a_request_whose_retries_a_death_spent_gets_429_with_retry_after(tmp_path, tiny_profile):
    """No re-dispatch allowed: the prefill instance holding a request dies before its first token
    and the request's retries are spent. The cluster lost capacity (a supervisor would restart
    the instance), not a kind: the client gets 429 with Retry-After, never 503, which says that no
    instance of a kind exists. The conductor hears of no exit; the gateway's probe finds it."""
    cluster = start_cluster(tmp_path, prefill=1, decode=1, profile=tiny_profile, dtype=DTYPE,
                            service_args={"conductor": ["--heartbeat-timeout", "600"],
                                          "gateway": ["--prefill-retries", "0", "--probe-after", "1",
                                                      "--stall-timeout", "600", "--route-timeout", str(BOUND_S)]})
    try:
        proc(cluster, "prefill-0").send_signal(signal.SIGSTOP)  # it looks alive: the request is routed there
        nc = await bus.connect(cluster.spec.nats_url, "test-routed")
        routed_events = await nc.subscribe(subjects.request_event("routed", "*"))
        answer = asyncio.ensure_future(post(f"{cluster.spec.url}/v1/completions", body(8), timeout_s=BOUND_S * 3))
        await routed_events.next_msg(timeout=BOUND_S)
        await nc.drain()
        kill(cluster, "prefill-0")
        status, reply, headers = await answer
        assert status == 429, reply
        assert int(headers["Retry-After"]) >= 1
        assert reply["error"]["code"] == "overloaded", reply
        assert "resumed 0 times, the most allowed" in reply["error"]["message"], reply
        path = await collect_request_events(cluster.spec.nats_url, headers["X-Request-Id"])
        assert [e["kind"] for e in path if e["kind"] in TERMINAL_KINDS] == ["rejected"]
    finally:
        cluster.stop()
