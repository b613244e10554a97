"""Simulated instances and links: prefill (queue + the node's KV pool), decode (a batch), NIC.

Each instance sits on its own node, named after it. Prefill nodes hold the KV pool (a real
`TieredPool`, so eviction is the live code); their pool actions become `KvEvent`s for the real
`PrefixIndex`, exactly as messengers publish them.
"""

from __future__ import annotations

from collections import deque

from common.kv.pool import Demoted, Evicted, NoRoom, Promoted, Stored, TieredPool
from services.cache_index.index import KvEvent, PrefixIndex
from services.conductor.admission import DecodeLoad
from services.conductor.policy import DecodeCandidate, PrefillCandidate
from tools.sim.decode import DecodeBatch
from tools.sim.request import SimRequest

# pool action type -> (KvEvent kind, tier); Evicted's tier comes from the action
_EVENT_KIND = {Stored: "stored", Demoted: "demoted", Promoted: "promoted", Evicted: "evicted"}


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

    def __init__(self, node: str, dram_blocks: int, eviction: str, index: PrefixIndex) -> None:
        self.node = node
        self.pool = TieredPool(dram_blocks, 0, eviction)
        self.index = index
        self.seq = 0

    def local_prefix(self, keys: list[int]) -> int:
        return self.pool.lookup_prefix(keys).num_hits

    def store(self, keys: list[int]) -> None:
        """Put every key (held ones are touched) and tell the index, one event per run of a kind."""
        actions = self.pool.put((key, depth) for depth, key in enumerate(keys))
        run_kind, run_tier, run_keys = None, "dram", []
        for action in actions:
            cls = type(action)
            if cls is NoRoom:
                continue
            kind = _EVENT_KIND[cls]
            tier = action.tier if cls is Evicted else ("ssd" if cls is Demoted else "dram")
            if (kind, tier) != (run_kind, run_tier) and run_keys:
                self._publish(run_kind, run_tier, run_keys)
                run_keys = []
            run_kind, run_tier = kind, tier
            run_keys.append(action.key)
        if run_keys:
            self._publish(run_kind, run_tier, run_keys)

    def _publish(self, kind: str, tier: str, keys: list[int]) -> None:
        self.seq += 1
        result = self.index.apply(KvEvent(self.node, self.seq, kind, tuple(keys), tier))
        if result.status != "applied":  # cannot happen: one publisher, in order
            raise RuntimeError(f"index refused event {self.seq} of {self.node}: {result.status}")


class PrefillInstance:
    """A FIFO prefill queue; `predicted_free` is when its booked work ends, as the conductor predicts."""

    def __init__(self, instance_id: str, pool: PoolNode, nic: Nic) -> None:
        self.instance_id = instance_id
        self.node = pool.node
        self.pool = pool
        self.nic = nic
        self.queue: deque[SimRequest] = deque()
        self.busy = False
        self.predicted_free = 0.0
        self.busy_s = 0.0  # seconds spent prefilling, for utilisation
        self.prefills_done = 0

    def candidate(self, now: float) -> PrefillCandidate:
        return PrefillCandidate(self.instance_id, self.node, max(0.0, self.predicted_free - now))

    def claim_gpu(self, t: float) -> float:
        """When a prefill asked for at t may start (a prefill-only GPU is free at once)."""
        return t

    def release_gpu(self, t: float) -> None:
        return None


class DecodeInstance:
    """A decode batch plus the requests routed here whose KV has not arrived (reserved)."""

    def __init__(self, instance_id: str, nic: Nic, batch: DecodeBatch, kv_tokens: int | None) -> None:
        self.instance_id = instance_id
        self.node = instance_id
        self.nic = nic
        self.batch = batch
        self.kv_tokens = kv_tokens
        self.pending: dict[int, tuple[float, int]] = {}  # request index -> (predicted prefill end, context)
        self.reserved = 0  # context tokens of pending requests
        self._candidate: DecodeCandidate | None = None
        self._load: DecodeLoad | None = None

    def changed(self) -> None:
        self._candidate = None
        self._load = None

    def reserve(self, r: SimRequest) -> None:
        self.pending[r.index] = (r.predicted_end_s, r.input_tokens)
        self.reserved += r.input_tokens
        self.changed()

    def unreserve(self, r: SimRequest) -> None:
        if self.pending.pop(r.index, None) is not None:
            self.reserved -= r.input_tokens
            self.changed()

    def kv_free(self, with_reserved: bool = True) -> int | None:
        if self.kv_tokens is None:
            return None
        return self.kv_tokens - self.batch.context - (self.reserved if with_reserved else 0)

    def candidate(self) -> DecodeCandidate:
        """What the conductor sees: the batch plus the requests already routed here."""
        if self._candidate is None:
            b = self.batch
            self._candidate = DecodeCandidate(self.instance_id, self.node, len(b.members) + len(self.pending),
                                              b.context + self.reserved, self.kv_free())
        return self._candidate

    def own_state(self) -> DecodeCandidate:
        """What the decode instance itself checks when a KV arrives: its running batch only."""
        b = self.batch
        return DecodeCandidate(self.instance_id, self.node, len(b.members), b.context, self.kv_free(False))

    def load(self) -> DecodeLoad:
        """Admission's view: join times and contexts of the batch, predicted ends of pending prefills."""
        if self._load is None:
            members = self.batch.members  # in join order, so join times ascend
            pending = sorted(self.pending.values())
            self._load = DecodeLoad(self.instance_id, tuple(r.kv_arrival_s for r in members),
                                    tuple(r.input_tokens for r in members),
                                    tuple(p[0] for p in pending), tuple(p[1] for p in pending))
        return self._load
