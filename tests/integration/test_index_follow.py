"""A conductor's own copy of the prefix index (common/index_follow.py, `--prefix-index local`).

First the follower alone, in this process, over a real nats-server: the test plays one node's
messenger (heartbeats, numbered KV events, snapshots it answers when it chooses), so that a gap, a
restart (a new epoch) and the time before a node is synced can be made exactly. Then a real
cluster (2 prefill nodes, tiny-random): its conductor routes a repeated prompt to the prefill
instance that holds its prefix with the cache index stopped, and follows a messenger's restart.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import pytest

from common import bus, runner
from common.index_follow import IndexFollower, Resynced
from common.kv.blocks import block_keys
from schemas import subjects
from schemas.events import Event
from schemas.pool import KvEventData, SnapshotReply
from schemas.workers import WorkerInfo
from tests.integration.conftest import bare_nats_server, start_cluster
from tests.integration.test_kv_pool import complete, messenger_entries, routed_prefill_node, text_of
from tests.wait import until
from tools.moonbus.cluster.processes import free_port

pytestmark = pytest.mark.integration
NODE = "node-x"
BLOCK = 16


class Messenger:
    """One node's messenger as a follower sees it: what it holds, its epoch and event numbers."""

    def __init__(self, nc, epoch: str = "epoch-1") -> None:
        self.nc = nc
        self.epoch, self.seq = epoch, 0
        self.held: dict[int, str] = {}  # key -> tier
        self.answer = asyncio.Event()  # snapshots are answered while set
        self.answer.set()
        self.asked = self.snapshots = 0

    async def on_snapshot(self, msg) -> None:
        self.asked += 1
        await self.answer.wait()
        self.snapshots += 1
        reply = SnapshotReply(NODE, self.epoch, self.seq, list(self.held), list(self.held.values()))
        await msg.respond(reply.to_bytes())

    async def heartbeat(self, leaving: bool = False) -> None:
        info = WorkerInfo("messenger-x", "messenger", NODE, leaving=leaving)
        await self.nc.publish(subjects.worker_heartbeat("messenger", "messenger-x"), info.to_bytes())
        await bus.flush(self.nc)

    async def store(self, keys: list[int], lost: bool = False) -> None:
        """Store `keys` in DRAM: the next event number, published unless `lost`."""
        self.seq += 1
        self.held.update(dict.fromkeys(keys, "dram"))
        if not lost:
            data = KvEventData(NODE, self.epoch, self.seq, keys, "dram").to_dict()
            event = Event("stored", time.time(), "messenger", "messenger-x", "", data)
            await self.nc.publish(subjects.kv_event("stored", NODE), event.to_bytes())
            await bus.flush(self.nc)

    def restart(self) -> None:
        """A new process: a new epoch, numbers from 1 again, its DRAM gone."""
        self.epoch, self.seq, self.held = f"epoch-{int(self.epoch[6:]) + 1}", 0, {}


@pytest.fixture
async def follower():
    """(IndexFollower, Messenger, resyncs seen) over a fresh nats-server."""
    port = free_port()
    server = bare_nats_server(port)
    url = f"nats://127.0.0.1:{port}"
    mine, theirs = await bus.connect(url, "test-follower"), await bus.connect(url, "test-messenger")
    tasks = runner.TaskGroup(asyncio.Event())
    resyncs: list[Resynced] = []

    async def resynced(done: Resynced) -> None:
        resyncs.append(done)

    following = IndexFollower(mine, tasks, resync_timeout_s=5.0, node_timeout_s=5.0, on_resynced=resynced)
    await bus.receive(mine, subjects.KV_EVENTS_ALL, Event, following.on_kv_event)
    messenger = Messenger(theirs)
    await theirs.subscribe(subjects.messenger_control(NODE, "snapshot"), cb=messenger.on_snapshot)
    await bus.flush(theirs)
    try:
        yield following, messenger, resyncs
    finally:
        await tasks.cancel_all()
        await mine.close()
        await theirs.close()
        server.kill()
        server.wait(timeout=10)


def heard(follower: IndexFollower) -> None:
    follower.heard(WorkerInfo("messenger-x", "messenger", NODE))


async def test_a_node_holds_nothing_until_it_is_synced_then_every_event_is_applied(follower):
    following, messenger, resyncs = follower
    messenger.held = {11: "dram", 12: "ssd"}
    messenger.answer.clear()  # the snapshot is slow to come
    heard(following)
    await until(lambda: messenger.asked, "the follower asks for the snapshot")
    assert following.holders([11, 12]) == {} and NODE in following.syncing
    messenger.answer.set()
    await until(lambda: following.holders([11, 12]) == {NODE: 2}, "the first snapshot")
    assert [(r.node, r.reason, r.blocks) for r in resyncs] == [(NODE, "first seen", 2)]
    await messenger.store([13, 14])
    await until(lambda: following.holders([11, 12, 13, 14, 15]) == {NODE: 4}, "the stored event")
    assert following.index.node_entries(NODE) == {11: "dram", 12: "ssd", 13: "dram", 14: "dram"}
    assert messenger.snapshots == 1  # events in order need no snapshot


async def test_a_gap_in_the_numbers_reloads_the_node_exactly(follower):
    following, messenger, resyncs = follower
    heard(following)
    await until(lambda: resyncs, "the first snapshot")
    await messenger.store([21])
    await messenger.store([22], lost=True)  # seq 2 never arrives
    await messenger.store([23])  # seq 3: a gap
    await until(lambda: len(resyncs) == 2, "the resync after the gap")
    assert resyncs[1].reason == "gap: expected seq 2, got 3" and resyncs[1].seq == 3
    assert following.index.node_entries(NODE) == messenger.held == {21: "dram", 22: "dram", 23: "dram"}
    assert following.holders([21, 22, 23]) == {NODE: 3}
    await messenger.store([24])  # and it follows on from the snapshot's number
    await until(lambda: following.index.last_seq(NODE) == 4, "the next event")
    assert len(resyncs) == 2 and following.holders([21, 22, 23, 24]) == {NODE: 4}


async def test_a_restarted_messenger_new_epoch_replaces_what_its_node_held(follower):
    following, messenger, resyncs = follower
    heard(following)
    await until(lambda: resyncs, "the first snapshot")
    await messenger.store([31, 32])
    await until(lambda: following.holders([31, 32]) == {NODE: 2}, "the stored event")
    messenger.restart()  # its DRAM is gone; its first event is seq 1 of a new epoch
    await messenger.store([41])
    await until(lambda: len(resyncs) == 2, "the resync on the new epoch")
    assert resyncs[1].reason == "new epoch"
    assert following.epochs[NODE] == "epoch-2"
    assert following.index.node_entries(NODE) == {41: "dram"}
    assert following.holders([31, 32]) == {} and following.holders([41]) == {NODE: 1}


async def test_a_messenger_that_leaves_takes_its_node_out(follower):
    following, messenger, resyncs = follower
    messenger.held = {51: "dram"}
    heard(following)
    await until(lambda: following.holders([51]) == {NODE: 1}, "the first snapshot")
    following.heard(WorkerInfo("messenger-x", "messenger", NODE, leaving=True))
    assert following.holders([51]) == {} and NODE not in following.index.nodes
    heard(following)  # back: first seen again, reloaded
    await until(lambda: following.holders([51]) == {NODE: 1}, "the reload")
    assert [r.reason for r in resyncs] == ["first seen", "first seen"]


async def test_a_node_whose_snapshot_failed_is_asked_again_at_its_next_heartbeat(follower):
    following, messenger, resyncs = follower
    late = WorkerInfo("messenger-y", "messenger", "node-y")
    following.heard(late)  # its messenger heartbeats before it answers snapshots: no responders
    await until(lambda: "node-y" not in following.syncing, "the failed snapshot")
    assert following.holders([61]) == {} and "node-y" not in following.epochs and not resyncs

    async def answer(msg) -> None:
        await msg.respond(SnapshotReply("node-y", "epoch-1", 0, [61], ["dram"]).to_bytes())

    await messenger.nc.subscribe(subjects.messenger_control("node-y", "snapshot"), cb=answer)
    await bus.flush(messenger.nc)
    following.heard(late)  # its next heartbeat, a second later
    await until(lambda: following.holders([61]) == {"node-y": 1}, "the snapshot asked again")
    assert [(r.node, r.reason) for r in resyncs] == [("node-y", "not synced yet")]


# --- a real cluster --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def local_index_cluster(tmp_path_factory, tiny_profile):
    cluster = start_cluster(tmp_path_factory.mktemp("index-follow"), prefill=2, profile=tiny_profile,
                            service_args={"conductor": ["--prefix-index", "local"]})
    yield cluster
    cluster.stop()


def conductor_metric(cluster, name: str) -> float:
    """The sum of one metric's samples on the conductor (0 when it has none yet)."""
    with urllib.request.urlopen(cluster.procs["conductor"].metrics, timeout=5) as resp:
        lines = resp.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith((name + " ", name + "{")))


async def conductor_matches_messengers(cluster) -> bool:
    """The conductor's copy holds exactly as many (block, node) pairs as the messengers report."""
    try:
        held = sum([len(await messenger_entries(cluster, node)) for node in ("node-p0", "node-p1", "node-d0")])
    except Exception:  # a messenger being restarted
        return False
    return held > 0 and conductor_metric(cluster, "moonbus_conductor_index_holdings") == held


async def routed(cluster, request_id: str) -> dict:
    from nats.js.api import ConsumerConfig, DeliverPolicy

    nc = await bus.connect(cluster.spec.nats_url, "test-routed")
    try:
        sub = await nc.jetstream().subscribe(subjects.request_event("routed", request_id), ordered_consumer=True,
                                             config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL))
        return json.loads((await sub.next_msg(timeout=10)).data)["data"]
    finally:
        await nc.drain()


async def test_a_repeated_prompt_goes_to_its_holder_without_asking_the_cache_index(local_index_cluster, tiny):
    cluster = local_index_cluster
    tokenizer, _ = tiny
    prompt = text_of(500, seed=21)
    held = len(block_keys(tokenizer(prompt)["input_ids"][:-1], BLOCK))
    first = await complete(cluster, prompt)
    holder = (await routed(cluster, first["id"]))["prefill_id"]
    await until(lambda: conductor_matches_messengers(cluster), "the conductor's copy matches the messengers")
    cache_index = cluster.procs["cache_index"].popen
    cache_index.terminate()  # nobody answers index queries now: a remote index would find nothing
    cache_index.wait(20)
    for _ in range(3):
        again = await complete(cluster, prompt)
        route = await routed(cluster, again["id"])
        assert route["prefill_id"] == holder and route["pull"] is None
        assert route["prefix_blocks"] == route["best_len"] == held
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == held * BLOCK
        assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]


async def test_the_conductor_follows_a_messenger_restart(local_index_cluster, tiny):
    cluster = local_index_cluster
    tokenizer, _ = tiny
    prompt = text_of(400, seed=22)
    held = len(block_keys(tokenizer(prompt)["input_ids"][:-1], BLOCK))
    first = await complete(cluster, prompt)
    node = await routed_prefill_node(cluster, first["id"])
    await until(lambda: conductor_matches_messengers(cluster), "the conductor's copy matches the messengers")
    before = await routed(cluster, (await complete(cluster, prompt))["id"])
    assert local_blocks(before, node) == held
    resyncs = conductor_metric(cluster, "moonbus_conductor_index_resyncs_total")
    cluster.restart("messenger-p" + node[-1])  # it leaves (dropped), comes back empty (reloaded)

    async def reloaded() -> bool:  # dropped when it left, then reloaded (empty) once heard again
        return conductor_metric(cluster, "moonbus_conductor_index_resyncs_total") > resyncs \
            and await conductor_matches_messengers(cluster)

    await until(reloaded, "the conductor reloads the restarted node")
    after = await routed(cluster, (await complete(cluster, prompt))["id"])
    assert local_blocks(after, node) == 0  # its blocks went with its DRAM: no longer believed held there


def local_blocks(route: dict, node: str) -> int:
    """How many leading blocks the conductor believed `node` held when it routed."""
    return {c["node"]: c["local_blocks"] for c in route["prefill_costs"]}[node]
