"""Simulated instances and links: prefill (queue + the node's KV pool), decode (a batch), NIC.

Each instance sits on its own node, named after it. Prefill nodes hold the KV pool (a real
`TieredPool`, so eviction is the live code); their pool actions become `KvEvent`s for the real
`PrefixIndex`, exactly as messengers publish them. Each instance reports its load the way a live
one does (`info(t)`: a WorkerInfo with its PrefillReport / DecodeReport), and the simulator's
conductor keeps the live conductor's bookkeeping, common.decide.cluster_state.ClusterState.
"""

from __future__ import annotations

from collections import deque

from common.decide.admission import has_room, kv_reservation
from common.decide.perf import queue_ends
from common.decide.queue_order import FairOrder
from common.decide.pool import TieredPool, change_of, runs
from schemas.workers import Coming, DecodeReport, Joined, Measured, PrefillReport, WorkerInfo
from common.decide.index import KvEvent, PrefixIndex
from common.decide.policy import DecodeCandidate
from tools.sim.decode import DecodeBatch
from tools.sim.request import SimRequest

class Nic:
    """A node's network link, shared by what it sends and receives: FIFO, one transfer at a time.

    Congestion = waiting for what is already booked on either end's link.
    """

    __slots__ = ("bytes_s", "free_at")

    def __init__(self, bytes_s: float) -> None:
        self.bytes_s = bytes_s
        self.free_at = 0.0

    def queued_bytes(self, now: float) -> int:
        return int(max(0.0, self.free_at - now) * self.bytes_s)


def transfer(src: Nic, dst: Nic, t: float, nbytes: float) -> float:
    """Book nbytes from src to dst starting no earlier than t; returns when the last byte lands."""
    start = max(t, src.free_at, dst.free_at)
    done = start + nbytes / min(src.bytes_s, dst.bytes_s)
    src.free_at = dst.free_at = done
    return done


class PoolNode:
    """A node's KV pool, publishing its actions to the index with per-node sequence numbers."""

    def __init__(self, node: str, dram_blocks: int, eviction: str, index: PrefixIndex, ssd_blocks: int = 0) -> None:
        self.node = node
        self.pool = TieredPool(dram_blocks, ssd_blocks, eviction)
        self.index = index
        self.seq = 0

    def local_prefix(self, keys: list[int]) -> int:
        return self.pool.lookup_prefix(keys).num_hits

    def store(self, keys: list[int]) -> None:
        """Put every key (held ones are touched) and tell the index, one event per run of a kind."""
        actions = self.pool.put((key, depth) for depth, key in enumerate(keys))
        for kind, tier, run in runs(c for c in map(change_of, actions) if c is not None):
            self._publish(kind, tier, run)

    def _publish(self, kind: str, tier: str, keys: list[int]) -> None:
        self.seq += 1
        result = self.index.apply(KvEvent(self.node, self.seq, kind, tuple(keys), tier))
        if result.status != "applied":  # cannot happen: one publisher, in order
            raise RuntimeError(f"index refused event {self.seq} of {self.node}: {result.status}")


class PrefillInstance:
    """A prefill queue in the live instance's order (`FairOrder`), reporting what it holds the
    way a live prefill instance does."""

    draining = False  # an autoscaled cluster's instance being removed: it finishes its queue, takes nothing new

    def __init__(self, instance_id: str, pool: PoolNode, nic: Nic) -> None:
        self.instance_id = instance_id
        self.node = pool.node
        self.pool = pool
        self.nic = nic
        self.queue: FairOrder[SimRequest] = FairOrder()
        self.current: SimRequest | None = None  # being prefilled
        self.busy = False
        self.busy_s = 0.0  # seconds spent prefilling, for utilisation
        self.prefills_done = 0
        self.measured = (0, 0.0, 0, 0)  # (seq, seconds, tokens, prefix tokens) of its latest prefill

    def info(self, t: float) -> WorkerInfo:
        """Its report, as a live prefill instance sends it: the booked work ahead and, per request,
        the decode instance it goes to and when its prefill should end (the conductor's prediction)."""
        held = ([self.current] if self.current is not None else []) + self.queue.items()
        running_for = max(0.0, t - self.current.prefill_start_s) if self.current is not None else None
        ends = queue_ends((r.decision.prefill_s + r.decision.transfer_s for r in held), running_for)
        coming = [Coming(str(r.index), r.decode.instance_id, end, r.input_tokens, r.max_tokens)
                  for r, end in zip(held, ends) if r.output_tokens > 1]
        seq, seconds, tokens, prefix = self.measured
        return WorkerInfo(self.instance_id, "prefill", self.node, draining=self.draining, prefill=PrefillReport(
            ends[-1] if ends else 0.0, sum(r.input_tokens for r in self.queue.items()),
            self.current.input_tokens if self.current is not None else 0, [str(r.index) for r in held], coming,
            Measured(seq, seconds, tokens, prefix) if seq else None))

    def claim_gpu(self, t: float) -> float:
        """When a prefill asked for at t may start (a prefill-only GPU is free at once)."""
        return t

    def release_gpu(self, t: float) -> None:
        return None


class DecodeInstance:
    """A decode batch and the requests whose KV arrived, waiting for room (first come first served);
    what is routed here but not arrived yet is the conductor's to count."""

    draining = False  # as PrefillInstance.draining: it serves what was routed to it, nothing new

    def __init__(self, instance_id: str, nic: Nic, batch: DecodeBatch, kv_tokens: int | None, node: str = "") -> None:
        self.instance_id = instance_id
        self.node = node or instance_id
        self.nic = nic
        self.batch = batch
        self.kv_tokens = kv_tokens
        self.waiting: deque[SimRequest] = deque()
        self.on_change = None  # set by the simulator: the instance's report is due again

    def changed(self) -> None:
        if self.on_change is not None:
            self.on_change(self)

    @staticmethod
    def needed(r: SimRequest) -> int:
        """Its reservation as a live decode instance counts it: the prompt's KV and every step it may
        still run (the first token came from prefill)."""
        return kv_reservation(r.input_tokens, r.max_tokens, 1)

    def reserved(self) -> int:
        return sum(self.needed(r) for r in self.batch.members)

    def has_room(self, r: SimRequest) -> bool:
        return has_room(len(self.batch.members), None, self.reserved(), self.needed(r), self.kv_tokens)

    def kv_free(self) -> int | None:
        return None if self.kv_tokens is None else self.kv_tokens - self.reserved()

    def own_state(self, step_factor: float = 1.0) -> DecodeCandidate:
        """What the decode instance itself checks when a KV arrives: its running batch only, at the
        speed it has been measured to run."""
        b = self.batch
        return DecodeCandidate(self.instance_id, self.node, len(b.members), b.context, self.kv_free(), step_factor)

    def info(self, t: float) -> WorkerInfo:
        """Its report, as a live decode instance sends it: the batch, each member since its join,
        then those waiting for room."""
        b = self.batch
        joined = [Joined(str(r.index), t - r.kv_arrival_s, r.input_tokens, 1 + b.steps - r.join_steps, r.max_tokens)
                  for r in b.members]
        joined += [Joined(str(r.index), 0.0, r.input_tokens, 1, r.max_tokens) for r in self.waiting]
        measured = Measured(b.steps, b.s, b.context, batch=len(b.members)) if b.steps and b.members else None
        reserved = self.reserved()
        return WorkerInfo(self.instance_id, "decode", self.node, draining=self.draining, decode=DecodeReport(
            len(b.members), b.context, reserved, None if self.kv_tokens is None else self.kv_tokens - reserved,
            0.0, joined, measured))
