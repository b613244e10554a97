"""The cache index as a process, over a real nats-server that goes away and comes back.

The node's side is played by this test: it heartbeats as a node's messenger and answers the
index's snapshot requests, so that what the node holds can change while the index cannot hear.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from common import bus
from common.index_follow import SILENCE_RESYNC_S
from schemas import subjects
from schemas.index import IndexQuery, IndexReply
from schemas.pool import SnapshotReply
from schemas.workers import WorkerInfo
from tests.integration.conftest import bare_nats_server
from tools.moonbus.cluster.processes import free_port

NODE = "node-x"


class Broker:
    def __init__(self, port: int) -> None:
        self.port = port
        self.url = f"nats://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = bare_nats_server(self.port)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)


class Node:
    """A node's messenger as the index sees it: heartbeats, and a snapshot of what it holds."""

    def __init__(self, nc) -> None:
        self.nc = nc
        self.keys = [11, 12]
        self.snapshots = 0

    async def on_snapshot(self, msg) -> None:
        self.snapshots += 1
        reply = SnapshotReply(NODE, "epoch-1", len(self.keys), list(self.keys), ["dram"] * len(self.keys))
        await msg.respond(reply.to_bytes())

    async def heartbeat(self) -> None:
        while True:
            if self.nc.is_connected:
                await bus.publish(self.nc, subjects.worker_heartbeat("messenger", "messenger-x"),
                                  WorkerInfo("messenger-x", "messenger", NODE).to_bytes())
            await asyncio.sleep(0.5)


async def held_prefix(nc, keys: list[int]) -> int:
    try:
        msg = await nc.request(subjects.INDEX_QUERY, IndexQuery(keys).to_bytes(), timeout=2)
    except Exception:  # the index not reachable yet: nothing known
        return -1
    node = IndexReply.from_bytes(msg.data).per_node.get(NODE)
    return node.prefix_len if node else 0


async def wait_prefix(nc, keys: list[int], want: int, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while (got := await held_prefix(nc, keys)) != want and time.monotonic() < deadline:
        await asyncio.sleep(0.3)
    return got


@pytest.fixture
async def index_over_a_broker(tmp_path):
    broker = Broker(free_port())
    broker.start()
    log = tmp_path / "cache_index.log"
    with open(log, "w") as out:
        index = subprocess.Popen([sys.executable, "-m", "services.cache_index", "--nats-url", broker.url,
                                  "--instance-id", "cache-index-t", "--home", str(tmp_path), "--node-timeout", "8"],
                                 stdout=out, stderr=subprocess.STDOUT)
    nc = await bus.connect(broker.url, "test-node-x", first_connect_timeout_s=20)
    node = Node(nc)
    await nc.subscribe(subjects.messenger_control(NODE, "snapshot"), cb=node.on_snapshot)
    beating = asyncio.create_task(node.heartbeat())
    try:
        yield broker, node, nc
    finally:
        beating.cancel()
        index.terminate()
        index.wait(timeout=20)
        await nc.close()
        broker.stop()
        print(log.read_text()[-3000:])


async def test_blocks_stored_while_the_broker_was_away_are_in_the_index_once_it_is_back(index_over_a_broker):
    broker, node, nc = index_over_a_broker
    assert await wait_prefix(nc, [11, 12, 13], 2, timeout_s=30) == 2  # first seen: loaded from its snapshot
    first_snapshots = node.snapshots

    # the broker goes away for longer than the silence after which the index reloads a node it hears
    # again (but less than the node timeout: nobody is dropped); meanwhile the node stores a block
    # whose KV event nobody hears. The silence the index measures spans at least this sleep, whatever
    # the machine's speed: it heard nothing before the broker stopped and hears nothing before it is back.
    broker.stop()
    node.keys.append(13)
    await asyncio.sleep(SILENCE_RESYNC_S + 1.0)
    broker.start()

    # both ends reconnect; the index hears the node again after a silence and reloads it
    assert await wait_prefix(nc, [11, 12, 13], 3, timeout_s=20) == 3
    assert node.snapshots > first_snapshots
