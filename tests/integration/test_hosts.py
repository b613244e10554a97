"""Nodes on separate hosts: each host a network namespace with its own address (tools/netns).

Layout (tools/netns/cluster.py): a control host (gateway, conductor, cache_index) and three node
hosts, each running one server of a 3-server NATS cluster (JetStream on each, the events stream
replicated R3, auth on: per-role users, authenticated routes):

    node-a: messenger + prefill-0    node-b: messenger + decode-0    node-c: messenger + prefill-1 + decode-1

Every service is given all three NATS servers and binds to its host's address; KV between nodes
goes over TCP between host addresses. Under a steady load the tests pull one host's cable for
~10 s, and kill one NATS server; every request must end exactly once (one terminal event in
MOONBUS_EVENTS each) and outcomes are printed (completed / 429 / 503 / failed).
"""

from __future__ import annotations

import asyncio
import collections
import random
import subprocess
import time

import aiohttp
import pytest

from common import models
from tools.moonbus.traces.measures import RequestResult
from tests import required
from tests.integration.conftest import TINY, assert_greedy, collect_request_events, post
from tools.moonbus.traces import replay
from tools.moonbus.soak import verdict as sv
from tools.netns import net

pytestmark = pytest.mark.integration

HOSTS = ("ctl", "node-a", "node-b", "node-c")
RATE = 4.0  # requests per second in the steady load (Poisson), about half what 2 shared cores serve
MAX_TOKENS = 12
CUT_S = 10.0
ENDS_S = 60.0  # the judge waits this long for the next event while a request has not ended: a hang, not a slow machine
STALL_S = 20.0  # below every bus call's timeout (30 s and more): what a lost reply used to cost


@pytest.fixture(scope="module")
def hosts(tmp_path_factory, tiny_profile):
    why = net.usable()
    if why:
        required.missing("hosts", f"nodes on separate hosts need network namespaces: {why}")
    if subprocess.run(["pgrep", "-x", "dockerd"], capture_output=True).returncode == 0:
        print("note: dockerd is running; the harness's FORWARD ACCEPT rule keeps the bridge open")
    from tools.netns.cluster import HostsCluster, HostsSpec

    network = net.Network(HOSTS)
    network.create()
    cluster = None
    try:
        spec = HostsSpec(home=tmp_path_factory.mktemp("hosts"), model=TINY, profile=tiny_profile, network=network,
                         service_args={"gateway": ["--probe-after", "2"]})
        cluster = HostsCluster(spec)
        cluster.start(ready_timeout_s=300)  # stops what it started if it fails
        yield cluster
    finally:
        if cluster is not None:
            cluster.stop(grace_s=10)
        network.teardown()


@pytest.fixture(scope="module")
def tiny(hosts):
    ref = models.prepare(TINY, hosts.spec.home)
    return models.load_tokenizer(ref), models.load_model(ref, models.resolve_dtype(hosts.spec.dtype))


# --- test 1 ---------------------------------------------------------------------------------
async def test_kv_crosses_hosts_and_greedy_output_matches(hosts, tiny):
    """Prefill on one host, decode on another: the KV goes between host addresses, output exact."""
    tokenizer, model = tiny
    crossed = []
    for i in range(6):
        prompt = f"host request {i}: the moon and its cake " * 3
        status, body, headers = await post(f"{hosts.spec.url}/v1/completions", {
            "model": TINY, "prompt": prompt, "max_tokens": 16, "temperature": 0, "return_token_ids": True})
        assert status == 200, body
        assert_greedy(body["choices"][0]["token_ids"], model, tokenizer(prompt)["input_ids"], 16, what=prompt[:20])
        events = await collect_request_events(hosts.spec.nats_url, headers["X-Request-Id"])
        moved = [e["data"] for e in events if e["kind"] == "kv_transferred"]
        assert len(moved) == 1, [e["kind"] for e in events]
        if moved[0]["src_node"] != moved[0]["dest_node"]:
            crossed.append((moved[0]["src_node"], moved[0]["dest_node"], moved[0]["transport"]))
        if len(crossed) >= 2:
            break
    print(f"KV handoffs between hosts (src, dest, transport): {crossed}")
    assert crossed, "no request had its prefill and decode on different hosts"
    assert all(transport == "tcp" for _, _, transport in crossed)


# --- the steady load ------------------------------------------------------------------------
async def steady_load(cluster, duration_s: float, fault=None) -> list[tuple[float, RequestResult]]:
    """Streaming requests at RATE per second for `duration_s` (open loop: a stuck request does not
    hold back the next), while `fault(t0)` runs; returns (send time from t0, result) for every
    request, all of them ended."""
    vocab = models.read_shape(models.prepare(TINY, cluster.spec.home)).vocab_size
    rng = random.Random(13)
    t0 = time.perf_counter()

    async def one(session: aiohttp.ClientSession, i: int, prompt: list[int]) -> tuple[float, RequestResult]:
        sent = time.perf_counter() - t0
        return sent, await replay.send_one(session, cluster.spec.url, TINY, i, prompt, MAX_TOKENS, sent, t0)

    timeout = aiohttp.ClientTimeout(total=150)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        faulting = asyncio.create_task(fault(t0)) if fault is not None else None
        tasks = []
        while time.perf_counter() - t0 < duration_s:
            prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(24, 72))]
            tasks.append(asyncio.create_task(one(session, len(tasks), prompt)))
            await asyncio.sleep(rng.expovariate(RATE))
        if faulting is not None:
            await faulting
        return list(await asyncio.gather(*tasks))


async def terminal_events(nats_url: str, results: list[tuple[float, RequestResult]]) -> sv.EventLog:
    """Every request event in MOONBUS_EVENTS, read from the start (duplicates by stream sequence
    are not second ends) until each request of `results` that got an id has its terminal event and
    nothing more is stored (the gateways' last ones may still be on their way), or ENDS_S passed
    without another event: the events stream is the judge of exactly-once."""
    from nats.js.api import ConsumerConfig, DeliverPolicy

    from common import bus
    from schemas import subjects
    from schemas.events import Event

    ids = {r.request_id for _, r in results if r.request_id}
    log = sv.EventLog()
    nc = await bus.connect(nats_url, "test-hosts-judge", first_connect_timeout_s=20)
    try:
        sub = await nc.jetstream().subscribe(subjects.request_event("*", "*"), ordered_consumer=True,
                                             config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL))
        while True:
            try:
                msg = await sub.next_msg(timeout=ENDS_S)
            except asyncio.TimeoutError:
                return log  # the judge names what never ended
            log.add(Event.from_bytes(msg.data), msg.metadata.sequence.stream)
            if msg.metadata.num_pending == 0 and ids <= log.terminal.keys():
                return log
    finally:
        await bus.shutdown(nc)


def judge(title: str, results: list[tuple[float, RequestResult]], log: sv.EventLog) -> dict[str, int]:
    """Print per-request outcomes; assert every request ended exactly once and none failed."""
    outcomes = [sv.classify(r) for _, r in results]
    counts = sv.count_outcomes(outcomes)
    twice, never = sv.exactly_once([r for _, r in results], outcomes, log.terminal)
    print(f"\n{title}: {len(results)} requests: " + ", ".join(f"{k} {v}" for k, v in counts.items())
          + f"; ended twice {len(twice)}, never ended {len(never)}; migrated {sum(log.migrated.values())}")
    refusals = collections.Counter(f"{o.kind}: {r.error}" for (_, r), o in zip(results, outcomes)
                                   if o.kind in (sv.REJECTED_429, sv.UNAVAILABLE_503))
    for why, n in refusals.most_common():
        print(f"  {n} x {why}")
    for (sent, r), o in zip(results, outcomes):
        if o.kind == sv.FAILED:
            print(f"  failed: sent at {sent:.1f} s, {r.request_id or '(no id)'}: {o.reason}")
    assert not twice, twice
    assert not never, never
    assert counts[sv.FAILED] == 0, [o.reason for o in outcomes if o.kind == sv.FAILED]
    return counts


async def health(cluster) -> dict:
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3)) as session:
            async with session.get(f"{cluster.spec.url}/health") as resp:
                return await resp.json()
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return {}


async def wait_whole(cluster, timeout_s: float = 60.0) -> float:
    """Seconds until the gateway sees every instance again."""
    start = time.monotonic()
    want = {"prefill": cluster.spec.num_prefill, "decode": cluster.spec.num_decode,
            "messenger": cluster.spec.num_messengers}
    while time.monotonic() - start < timeout_s:
        instances = (await health(cluster)).get("instances", {})
        if all(instances.get(k, 0) >= n for k, n in want.items()):
            return time.monotonic() - start
        await asyncio.sleep(0.5)
    raise AssertionError(f"instances not back after {timeout_s} s: {await health(cluster)}")


async def resynced_nodes(nats_url: str, since: float) -> list[str]:
    """Nodes the cache index reloaded from their messenger after `since` (wall clock)."""
    from nats.js.api import ConsumerConfig, DeliverPolicy

    from common import bus
    from schemas import subjects
    from schemas.events import Event

    nc = await bus.connect(nats_url, "test-hosts-resync", first_connect_timeout_s=20)
    nodes = []
    try:
        sub = await nc.jetstream().subscribe(subjects.instance_event("resynced", "*"), ordered_consumer=True,
                                             config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL))
        while True:
            try:
                event = Event.from_bytes((await sub.next_msg(timeout=2.0)).data)
            except asyncio.TimeoutError:
                return nodes
            if event.ts >= since:
                nodes.append(event.data["node"])
    finally:
        await bus.shutdown(nc)


# --- test 2 ---------------------------------------------------------------------------------
async def test_a_host_cut_off_for_ten_seconds_and_back(hosts):
    """node-c (a prefill, a decode, a NATS server) loses its cable for 10 s under load."""
    await wait_whole(hosts)
    timeline = {}

    async def cut_and_restore(t0: float) -> None:
        await asyncio.sleep(6.0)
        timeline["cut_wall"] = time.time()
        hosts.cut("node-c")
        timeline["cut_at"] = time.perf_counter() - t0
        await asyncio.sleep(CUT_S)
        hosts.restore("node-c")
        timeline["restored_at"] = time.perf_counter() - t0
        timeline["restored_wall"] = time.time()

    try:
        results = await steady_load(hosts, 28.0, cut_and_restore)
    finally:
        hosts.restore("node-c")
    back_s = await wait_whole(hosts)
    counts = judge(f"node-c cut at {timeline['cut_at']:.1f} s for {CUT_S:.0f} s", results,
                   await terminal_events(hosts.spec.nats_url, results))
    during = [r for sent, r in results if timeline["cut_at"] <= sent < timeline["restored_at"]]
    print(f"sent while node-c was away: {len(during)}, completed {sum(sv.classify(r).kind == sv.COMPLETED for r in during)}; "
          f"every instance seen again {back_s:.1f} s after the load")
    assert counts[sv.COMPLETED] > 0
    assert any(sv.classify(r).kind == sv.COMPLETED for r in during), "nothing was served while node-c was away"
    # the returning node heartbeats again (wait_whole) and the cache index reloaded it
    deadline = time.monotonic() + 20
    while "node-c" not in (nodes := await resynced_nodes(hosts.spec.nats_url, timeline["cut_wall"])):
        assert time.monotonic() < deadline, f"node-c was not resynced; resynced since the cut: {nodes}"
        await asyncio.sleep(1.0)
    print(f"cache index resynced since the cut: {nodes}")


async def stream_leader(nats_url: str) -> str:
    """The NATS server leading MOONBUS_EVENTS, after checking that the stream keeps 3 copies."""
    from common import bus
    from schemas import subjects

    nc = await bus.connect(nats_url, "test-hosts-stream", first_connect_timeout_s=20)
    try:
        info = await nc.jetstream().stream_info(subjects.EVENTS_STREAM)
    finally:
        await bus.shutdown(nc)
    assert info.config.num_replicas == 3 and len(info.cluster.replicas or []) == 2, info.cluster
    return info.cluster.leader


# --- test 3 ---------------------------------------------------------------------------------
async def test_a_nats_server_killed_under_load(hosts):
    """The NATS server leading the events stream is killed (SIGKILL) under load; the other two
    elect a new leader and serving continues."""
    await wait_whole(hosts)
    victim = await stream_leader(hosts.spec.nats_url)  # the hardest one to lose: the stream elects anew
    timeline = {}

    async def kill_server(t0: float) -> None:
        await asyncio.sleep(6.0)
        hosts.procs[victim].popen.kill()
        timeline["killed_at"] = time.perf_counter() - t0

    try:
        results = await steady_load(hosts, 16.0, kill_server)
        after = [r for sent, r in results if sent >= timeline["killed_at"]]
        counts = judge(f"{victim} killed at {timeline['killed_at']:.1f} s", results,
                       await terminal_events(hosts.spec.nats_url, results))
        served = sum(sv.classify(r).kind == sv.COMPLETED for r in after)
        waits = sorted(r.end_s - sent for sent, r in results)
        print(f"sent after the kill: {len(after)}, completed {served}; request time p50 {waits[len(waits) // 2]:.2f} s, "
              f"longest {waits[-1]:.2f} s")
        assert counts[sv.COMPLETED] > 0 and served > 0, "serving did not continue after the kill"
        # a request or reply lost while a service reconnected costs one attempt of the call
        # (bus.ATTEMPT_S) or one probe (--probe-after 2 here), never a whole bus timeout (30 s or more)
        assert waits[-1] < STALL_S, [(round(sent, 1), round(r.end_s - sent, 1), r.request_id)
                                      for sent, r in results if r.end_s - sent >= STALL_S]
    finally:
        hosts.restart(victim)  # the cluster is whole again for whatever runs next
