"""The fleet the live-route benchmark plays over NATS (tools/moonbus/bench/route.py): prompts and
the blocks each node holds, and fake prefill/decode instances and messengers.

The conductors and the cache index cannot tell these from real processes on the bus:
  - every prefill and decode instance sends a heartbeat (schemas.workers.WorkerInfo with the
    cluster's Layout and a PrefillReport / DecodeReport) every 150 ms, like the real ones, each
    on its own phase (independent processes do not beat in step);
  - every node's messenger sends a heartbeat about every second (phases spread too) and answers
    the cache index's snapshot request (subjects.messenger_control(node, "snapshot")) with the
    blocks its node holds, which is how the real cache index fills itself when it first hears a
    messenger.
Nothing here runs a model or holds KV bytes: a route dispatched to a fake prefill instance lands
on a subject nobody reads, and the benchmark cancels it as soon as the reply arrives.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

from common.kv.blocks import block_keys
from common.decide.perf import Profile
from tools.moonbus.traces.rows import TraceRow, block_token_ids, scaled_input_length
from schemas import subjects
from schemas.pool import SnapshotReply
from schemas.workers import Coming, DecodeReport, Joined, Layout, PrefillReport, WorkerInfo

BLOCK_TOKENS = 16
VOCAB_SIZE = 259  # tiny-random's, as `moonbus replay` draws prompt ids
HEARTBEAT_S = 0.15  # prefill and decode instances (their --heartbeat-interval default)
MESSENGER_EVERY = 7  # messenger heartbeats every 7th tick, about every second (their default)
LOAD_VARIANTS = 8  # load reports each instance cycles through


class PromptBuilder:
    """`tools.moonbus.traces.rows.prompt_token_ids(row, 16, vocab_size=259)`, with each trace block's tokens
    drawn once: rows share most of their blocks, and one draw costs ~100 us (a seeded numpy
    generator), which would make 200k blocks take half a minute. The integration test checks
    that both give the same prompts."""

    def __init__(self, block_tokens: int = BLOCK_TOKENS, vocab_size: int = VOCAB_SIZE) -> None:
        self.block_tokens = block_tokens
        self.vocab_size = vocab_size
        self._blocks: dict[int, list[int]] = {}  # trace hash id -> its tokens

    def __call__(self, row: TraceRow) -> list[int]:
        length = scaled_input_length(row, self.block_tokens)
        tokens: list[int] = []
        for hash_id in row.hash_ids[: -(-length // self.block_tokens)]:
            block = self._blocks.get(hash_id)
            if block is None:
                block = self._blocks[hash_id] = block_token_ids(hash_id, self.block_tokens, self.vocab_size)
            tokens.extend(block)
        return tokens[:length]


def store_blocks(rows: list[TraceRow], nodes: tuple[str, ...], target: int,
                 prompts: PromptBuilder) -> tuple[dict[str, list[int]], int]:
    """Store row i's block keys on nodes[i % len(nodes)] until `target` (node, key) entries are
    held, so shared prefixes end up on several nodes. Keys are the conductor's: block_keys of the
    prompt but its last token. Returns node -> keys (in order, no repeats) and the rows used."""
    held: dict[str, dict[int, None]] = {node: {} for node in nodes}  # node -> ordered set of keys
    total = 0
    for i, row in enumerate(rows):
        if total >= target:
            return {node: list(keys) for node, keys in held.items()}, i
        keys = held[nodes[i % len(nodes)]]
        before = len(keys)
        keys.update(dict.fromkeys(block_keys(prompts(row)[:-1], BLOCK_TOKENS)))
        total += len(keys) - before
    raise ValueError(f"{len(rows)} trace rows hold only {total:,} blocks; need {target:,} and rows left to query with")


@dataclass(frozen=True)
class Member:
    instance_id: str
    role: str  # prefill | decode | messenger
    node: str


def prefill_reports(rng: random.Random, decode_ids: list[str], instance_id: str) -> list[PrefillReport]:
    """A queue of 0-1 s of predicted work and up to 4 requests held, each bound for a decode instance."""
    out = []
    for v in range(LOAD_VARIANTS):
        queue_s = rng.uniform(0.0, 1.0)
        coming = [Coming(f"{instance_id}-v{v}-r{j}", rng.choice(decode_ids), rng.uniform(0.0, queue_s),
                         rng.randint(100, 1_000)) for j in range(rng.randint(0, 4))]
        tokens = sum(c.tokens for c in coming)
        out.append(PrefillReport(queue_s, tokens, 0, [c.request_id for c in coming], coming))
    return out


def decode_reports(rng: random.Random, perf: Profile, instance_id: str) -> list[DecodeReport]:
    """A batch of 4-32 decoding requests, up to 4 more waiting for room."""
    out = []
    for v in range(LOAD_VARIANTS):
        running, waiting = rng.randint(4, 32), rng.randint(0, 4)
        joined = [Joined(f"{instance_id}-v{v}-r{j}", rng.uniform(0.0, 10.0), rng.randint(100, 2_000))
                  for j in range(running + waiting)]
        context = sum(j.tokens for j in joined[:running])
        out.append(DecodeReport(running, context, sum(j.tokens for j in joined) + 16 * len(joined), None,
                                perf.decode.step_seconds(running, context), joined))
    return out


def beat_schedule(workers: int, messengers: int) -> list[tuple[float, int, int]]:
    """One messenger period (MESSENGER_EVERY heartbeat intervals) of heartbeats: (offset s, sender,
    tick), in time order; sender i < workers is worker i, -1-j is messenger j. Each sender beats on
    its own phase, spread evenly over its interval, as independent processes do (each one's timer
    starts when it does), not all at one instant."""
    sends = [(tick * HEARTBEAT_S + i * HEARTBEAT_S / workers, i, tick)
             for tick in range(MESSENGER_EVERY) for i in range(workers)]
    period = MESSENGER_EVERY * HEARTBEAT_S
    sends += [(j * period / messengers, -1 - j, 0) for j in range(messengers)]
    return sorted(sends)


class FakeFleet:
    """P prefill + D decode instances on one node each, plus one messenger per node, on `nc`."""

    def __init__(self, nc, layout: Layout, perf: Profile, num_prefill: int, num_decode: int,
                 blocks: dict[str, list[int]], seed: int = 0) -> None:
        self.nc = nc
        self.prefill = [Member(f"prefill-{i:02d}", "prefill", f"node-{i:02d}") for i in range(num_prefill)]
        self.decode = [Member(f"decode-{i:02d}", "decode", f"node-{num_prefill + i:02d}") for i in range(num_decode)]
        self.messengers = [Member(f"messenger-{m.node}", "messenger", m.node) for m in self.prefill + self.decode]
        self.blocks = blocks  # node -> keys it holds (prefill nodes; decode nodes hold none)
        # NOTE: heartbeats are encoded once, here: each tick then costs the timing client in this
        # process a few microseconds per publish instead of building dataclasses (sent_at is then
        # the build time; nobody steers by it)
        rng = random.Random(seed)
        decode_ids = [m.instance_id for m in self.decode]
        now = time.time()
        self._beats: list[tuple[str, list[bytes]]] = []  # per instance: its subject, its load variants encoded
        for m in self.prefill:
            self._beats.append((subjects.worker_heartbeat(m.role, m.instance_id),
                                [self._info(m, layout, now, prefill=r).to_bytes()
                                 for r in prefill_reports(rng, decode_ids, m.instance_id)]))
        for m in self.decode:
            self._beats.append((subjects.worker_heartbeat(m.role, m.instance_id),
                                [self._info(m, layout, now, decode=r).to_bytes()
                                 for r in decode_reports(rng, perf, m.instance_id)]))
        self._messenger_beats = [(subjects.worker_heartbeat(m.role, m.instance_id), self._info(m, layout, now).to_bytes())
                                 for m in self.messengers]
        self._subs: list = []
        self._task: asyncio.Task | None = None

    @staticmethod
    def _info(m: Member, layout: Layout, now: float, **report) -> WorkerInfo:
        return WorkerInfo(m.instance_id, m.role, m.node, layout.model, incarnation="bench", layout=layout,
                          sent_at=now, **report)

    @property
    def num_instances(self) -> int:
        return len(self.prefill) + len(self.decode)

    @property
    def heartbeats_per_s(self) -> float:
        return (self.num_instances + len(self.messengers) / MESSENGER_EVERY) / HEARTBEAT_S

    async def start(self) -> None:
        """Answer snapshot requests first: the cache index asks as soon as it hears a messenger."""
        for m in self.messengers:
            snapshot = self._snapshot(m.node)
            if len(snapshot) > self.nc.max_payload:
                raise ValueError(f"node {m.node}'s snapshot is {len(snapshot):,} bytes, over the broker's "
                                 f"{self.nc.max_payload:,}: store the blocks on more nodes")
            self._subs.append(await self.nc.subscribe(subjects.messenger_control(m.node, "snapshot"),
                                                      cb=self._responder(snapshot)))
        self._task = asyncio.create_task(self._beat(), name="fleet-heartbeats")

    def _snapshot(self, node: str) -> bytes:
        keys = self.blocks.get(node, [])
        return SnapshotReply(node, "bench", 0, keys, ["dram"] * len(keys)).to_bytes()

    def _responder(self, snapshot: bytes):
        async def respond(msg) -> None:
            await msg.respond(snapshot)
        return respond

    async def _beat(self) -> None:
        loop = asyncio.get_running_loop()
        sends, period = beat_schedule(len(self._beats), len(self._messenger_beats)), MESSENGER_EVERY * HEARTBEAT_S
        start, rounds = loop.time(), 0
        while True:
            for offset, i, tick in sends:
                await asyncio.sleep(max(0.0, start + rounds * period + offset - loop.time()))
                if i >= 0:
                    subject, variants = self._beats[i]
                    await self.nc.publish(subject, variants[(rounds * MESSENGER_EVERY + tick) % LOAD_VARIANTS])
                else:
                    await self.nc.publish(*self._messenger_beats[-1 - i])
            rounds += 1

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for sub in self._subs:
            await sub.unsubscribe()
