"""Two real messenger processes on rxe0, talking through the host's nats-server: a block pull over rdma.

    the test                    node-a's messenger (--transport rdma)    node-b's messenger (--transport auto)
    reserve on node-a, write BLOCKS random blocks into its slab, commit
    pull(node-a, keys) on node-b  ----------------------------------->  pin on node-a, RDMA READ straight
                                                                         into node-b's reserved slots,
                                                                         checksums verified, commit
    look the keys up on node-b; its slab's slots must equal what was written, byte for byte

Their heartbeats (WorkerInfo.transport) say which backends each runs and the pull's reply
(PoolReply.transport) how the blocks came: rdma. The model is a local checkpoint directory holding
only config.json: the messenger reads the KV shape from it and imports no torch (the guest has none).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import nats
import pytest
from nats.errors import TimeoutError as NatsTimeout

from common import bus
from common.kv import blocks as kvblocks
from common.kv.slab import DramSlab
from schemas import subjects
from schemas.codec import Wire
from schemas.pool import (
    CommitRequest, LookupReply, LookupRequest, PoolReply, PullRequest, ReleaseRequest, ReserveReply, ReserveRequest,
    SlotRef,
)
from schemas.workers import WorkerInfo

BLOCKS = 48
BLOCK_TOKENS = 16
# 4 layers x (K, V) x 4 KV heads x head dim 64 x 16 tokens x float32 = 128 KiB a block: 6 MiB pulled,
# several 1 MiB work requests
MODEL_CONFIG = {"num_attention_heads": 4, "num_key_value_heads": 4, "hidden_size": 256, "num_hidden_layers": 4,
                "intermediate_size": 512, "max_position_embeddings": 1024, "vocab_size": 256}
HOLDER = "rdma-test:1"  # the pins this test makes, as a worker's would be named
# hang guards, not budgets: a messenger's start under qemu's emulation takes seconds on a quiet host
# and minutes on a loaded one (120 s ran out once while the suite ran beside two busy loops); a
# messenger that exits fails the wait at once
START_S = 600.0
REQUEST_S = 300.0


class Messenger:
    """One `python -m services.messenger` process of node `node`, its log in `log_path`."""

    def __init__(self, tmp: Path, model: Path, nats_url: str, node: str, transport: str) -> None:
        self.node = node
        self.instance = f"messenger-{node}"
        self.log_path = tmp / f"{self.instance}.log"
        argv = [sys.executable, "-m", "services.messenger", "--nats-url", nats_url, "--instance-id", self.instance,
                "--node", node, "--shm-dir", str(tmp / "shm" / node), "--home", str(tmp / "home"),
                "--model", str(model), "--block-tokens", str(BLOCK_TOKENS), "--transport", transport,
                "--dram-blocks", str(2 * BLOCKS), "--ssd-blocks", "0", "--transfer-host", "127.0.0.1",
                # NOTE: the sweep drops pins of holders it does not see heartbeating after the peer
                # timeout; the test's own pins must outlive a slow step under emulation
                "--peer-timeout", "60", "--insecure"]  # the guest's loopback: no cluster secret
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # our own child, by its pid

    def wait(self) -> int:
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@pytest.fixture
def messengers(tmp_path, nats_url):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(MODEL_CONFIG))
    pair = [Messenger(tmp_path, model, nats_url, "node-a", "rdma"),
            Messenger(tmp_path, model, nats_url, "node-b", "auto")]
    try:
        yield pair
    finally:
        for m in pair:  # both at once: each flushes its events and drains NATS on the way out
            m.stop()
        codes = [m.wait() for m in pair]
        for m in pair:  # in the captured output of a failed test
            print(f"--- {m.instance} (exit {m.proc.returncode})\n{m.log()[-4000:]}")
    assert codes == [0, 0], "a messenger did not shut down cleanly (its log is above)"


async def test_a_block_pull_between_two_messengers_goes_over_rdma(messengers, nats_url):
    a, b = messengers
    nc = await nats.connect(nats_url, connect_timeout=10, max_reconnect_attempts=3)
    try:
        await bus.ensure_events_stream(nc)  # as the conductor would: the messengers' events are stored
        beats = await heartbeats(nc, messengers)
        assert beats[a.instance].transport == "rdma" and set(beats[a.instance].endpoints) == {"rdma"}
        assert beats[b.instance].transport == "rdma,tcp"  # auto: this host has an RDMA device

        rng = random.Random(11)
        keys = [rng.getrandbits(63) for _ in range(BLOCKS)]
        written = await store_blocks(nc, a.node, keys, rng)

        pull = await request(nc, b.node, "pull", PullRequest("pull-1", a.node, keys, holder=HOLDER), PoolReply)
        assert pull.ok, pull.error
        assert (pull.num_blocks, pull.nbytes, pull.transport) == (BLOCKS, BLOCKS * len(written[0]), "rdma")

        found = await request(nc, b.node, "lookup", LookupRequest("check-1", keys, HOLDER), LookupReply)
        assert [ref.key for ref in found.blocks] == keys
        slab = DramSlab.attach(found.slab_path)
        try:
            landed = [slab.read(ref.slot) for ref in found.blocks]
        finally:
            slab.close()
        assert [ref.checksum for ref in found.blocks] == [kvblocks.checksum(p) for p in written]
        assert landed == written
        await request(nc, b.node, "release", ReleaseRequest("check-1", keys, HOLDER), PoolReply)
        print(f"pulled {BLOCKS} blocks ({pull.nbytes} bytes) node-a -> node-b over {pull.transport} "
              f"in {pull.seconds * 1000:.0f} ms (under emulation)")
    finally:
        await nc.drain()


async def heartbeats(nc, messengers: list[Messenger]) -> dict[str, WorkerInfo]:
    """The first heartbeat of every messenger, returned once each has sent another after all the
    first ones were out (a heartbeat interval later: each has seen the other's)."""
    seen: dict[str, WorkerInfo] = {}
    again: set[str] = set()
    sub = await nc.subscribe(subjects.WORKER_HEARTBEAT_ALL)
    deadline = time.monotonic() + START_S
    try:
        while len(again) < len(messengers):
            for m in messengers:
                assert m.proc.poll() is None, f"{m.instance} exited {m.proc.returncode}:\n{m.log()[-4000:]}"
            left = deadline - time.monotonic()
            silent = {m.instance for m in messengers} - (again if len(seen) == len(messengers) else set(seen))
            assert left > 0, f"no heartbeat (or none after the first ones) from {sorted(silent)}"
            try:
                msg = await sub.next_msg(timeout=min(left, 1.0))
            except NatsTimeout:
                continue
            info = WorkerInfo.from_bytes(msg.data)
            if info.role != "messenger":
                continue
            if len(seen) == len(messengers):
                again.add(info.instance_id)
            seen.setdefault(info.instance_id, info)
    finally:
        await sub.unsubscribe()
    return seen


async def store_blocks(nc, node: str, keys: list[int], rng: random.Random) -> list[bytes]:
    """Write blocks into `node`'s pool as a worker does (reserve, write the slots in place, commit)."""
    reserved = await request(nc, node, "reserve", ReserveRequest("store-1", keys, 0, HOLDER), ReserveReply)
    assert [ref.key for ref in reserved.slots] == keys, "the pool had no room"
    slab = DramSlab.attach(reserved.slab_path)
    try:
        payloads = [rng.randbytes(slab.slot_nbytes) for _ in keys]
        for ref, payload in zip(reserved.slots, payloads):
            slab.write(ref.slot, payload)
    finally:
        slab.close()
    done = [SlotRef(ref.key, ref.slot, kvblocks.checksum(p)) for ref, p in zip(reserved.slots, payloads)]
    committed = await request(nc, node, "commit", CommitRequest("store-1", done, HOLDER), PoolReply)
    assert committed.ok and committed.num_blocks == len(keys), committed
    await request(nc, node, "release", ReleaseRequest("store-1", keys, HOLDER), PoolReply)
    return payloads


async def request(nc, node: str, op: str, body: Wire, reply_type: type[Wire]) -> Wire:
    msg = await nc.request(subjects.messenger_control(node, op), body.to_bytes(), timeout=REQUEST_S)
    reply = reply_type.from_bytes(msg.data)
    assert not getattr(reply, "error", ""), f"{op} on {node}: {reply.error}"
    return reply

