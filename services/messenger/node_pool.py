"""One node's KV pool: TieredPool's decisions executed on the DRAM slab and the LMDB store.

TieredPool (common/decide/pool.py) decides what is stored, demoted, promoted or evicted; this class
carries the decisions out on real storage and turns them into numbered KV events for the cache
index. Single-threaded: the messenger calls it from its event loop only.

Life of a block written by a worker:

    reserve(hold, keys)  -> slots (pool: Stored, pinned; hidden from lookups until written)
    worker writes the payloads into the slots, in place
    commit(hold, blocks) -> checksums recorded, unpinned, `stored` events
    release(hold)        -> whatever the hold still pins is unpinned; unwritten reservations dropped

A hold is "<holder>/<request_id>" (schemas.pool): pins belong to one process's work on one
request, so the prefill and the decode of a request on one node never release each other's, and
`release_holder` frees everything a dead process pinned.

Every payload's checksum is kept (key -> checksum) and checked when a block moves between tiers
or nodes; a mismatch drops the block (a miss: the worker recomputes) and is reported.
"""

from __future__ import annotations

import logging
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from common import security
from common.kv import blocks as kvblocks
from common.kv.blocks import ChecksumMismatch, KvLayout
from common.decide.pool import (DRAM, SSD, Demoted, Evicted, NoRoom, PoolAction, Promoted, Stored, TieredPool,
                                change_of, runs)
from schemas.pool import KvEventData, SlotRef
from common.kv.slab import DramSlab
from services.messenger.ssd import PutStatus, SsdStore, map_size_for

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolEvent:
    kind: str  # stored | evicted | promoted | demoted | corrupt
    data: KvEventData


class NodePool:
    def __init__(self, node: str, layout: KvLayout, shm_dir: Path, dram_blocks: int,
                 ssd_dir: Path | None, ssd_blocks: int, policy: str) -> None:
        self.node = node
        self.layout = layout
        self.epoch = uuid.uuid4().hex[:12]
        # NOTE: the slab's name carries the epoch: workers still mapping a dead messenger's slab see
        # a new path in the next reply and re-attach (common/pool_client.py), never the old memory.
        security.private_dir(shm_dir)
        for stale in shm_dir.glob("slab*"):  # a previous messenger's: it holds nothing we know
            stale.unlink(missing_ok=True)
        self.slab_path = shm_dir / f"slab-{self.epoch}"
        self.slab = DramSlab.create(str(self.slab_path), dram_blocks, layout.block_nbytes)
        self.ssd: SsdStore | None = None
        if ssd_blocks > 0 and ssd_dir is not None:
            # NOTE: the SSD tier starts empty: its checksums and depths were not kept across restarts
            for stale in ("data.mdb", "lock.mdb"):
                (ssd_dir / stale).unlink(missing_ok=True)
            self.ssd = SsdStore(str(ssd_dir), map_size_for(ssd_blocks, layout.block_nbytes))
        self.pool = TieredPool(dram_blocks, ssd_blocks if self.ssd is not None else 0, policy)
        self.seq = 0
        self.slots: dict[int, int] = {}  # key -> DRAM slot
        self.checksums: dict[int, int] = {}  # key -> payload checksum (written blocks only)
        self.unwritten: set[int] = set()  # reserved keys whose payload is not written yet
        self.holds: dict[str, list[int]] = {}  # hold ("<holder>/<request_id>") -> keys it pins
        self._events: list[tuple[str, str, int]] = []  # (kind, tier, key) of the current operation

    # --- operations -------------------------------------------------------------------------
    def lookup(self, hold: str, keys: list[int]) -> tuple[list[SlotRef], list[PoolEvent]]:
        """Pin the longest written prefix of `keys`, promoting SSD blocks into DRAM on the way."""
        found: list[SlotRef] = []
        for key in keys:
            tier = self.pool.tier_of(key)
            if tier is None or key in self.unwritten:
                break
            if tier == SSD and not self._promote(key):
                break
            self.pool.pin([key])
            self.holds.setdefault(hold, []).append(key)
            self.pool.touch([key])
            found.append(SlotRef(key, self.slots[key], self.checksums[key]))
        return found, self.take_events()

    def reserve(self, hold: str, keys: list[int], first_depth: int) -> tuple[list[SlotRef], list[PoolEvent]]:
        """Slots for the keys not held yet (pinned and hidden until committed)."""
        new = [(k, first_depth + i) for i, k in enumerate(keys) if k not in self.pool]
        self.pool.touch(k for k in keys if k in self.pool)
        reserved: list[SlotRef] = []
        for key, depth in new:
            # NOTE: one key at a time, pinned at once, so a later key's eviction cannot pick it
            actions = self.pool.put([(key, depth)])
            for action in actions:
                if not isinstance(action, (Stored, NoRoom)):
                    self._execute(action)
            if not isinstance(actions[-1], Stored):
                break  # every DRAM block is pinned: store nothing deeper than this
            self.slots[key] = self._alloc_slot()
            self.unwritten.add(key)
            self.pool.pin([key])
            self.holds.setdefault(hold, []).append(key)
            reserved.append(SlotRef(key, self.slots[key]))
        return reserved, self.take_events()

    def commit(self, hold: str, written: list[SlotRef]) -> list[PoolEvent]:
        held = self.holds.get(hold, [])
        for ref in written:
            if ref.key not in self.unwritten or self.slots.get(ref.key) != ref.slot or ref.key not in held:
                continue
            self.unwritten.discard(ref.key)
            self.checksums[ref.key] = ref.checksum
            self.pool.unpin([ref.key])
            held.remove(ref.key)
            self._events.append(change_of(Stored(ref.key, DRAM)))
        return self.take_events()

    def release(self, hold: str, corrupt: list[int] = ()) -> list[PoolEvent]:
        """Unpin what `hold` pins (reservations never written are dropped), then drop the blocks
        the holder found corrupt when it read them (they leave the pool and the index)."""
        for key in self.holds.pop(hold, []):
            if key not in self.pool:
                continue
            self.pool.unpin([key])
            if key in self.unwritten:  # reserved, never written: drop it quietly (never announced)
                self.unwritten.discard(key)
                self.pool.discard([key])
                self.slab.free(self.slots.pop(key))
        for key in corrupt:
            if key in self.pool and key not in self.unwritten and not self.pool.pin_count(key):
                self._drop_corrupt(key)
        return self.take_events(reader=hold.split("/", 1)[-1] if corrupt else "")

    def release_holder(self, holder: str) -> list[PoolEvent]:
        """Release every hold of one process (it died, or restarted under a new incarnation)."""
        events: list[PoolEvent] = []
        for hold in [h for h in self.holds if h.split("/", 1)[0] == holder]:
            events += self.release(hold)
        return events

    def holders(self) -> dict[str, int]:
        """hold -> blocks it pins (a leak check: empty once the node is idle)."""
        return {hold: len(keys) for hold, keys in self.holds.items() if keys}

    @property
    def num_pinned(self) -> int:
        return len(Counter(k for keys in self.holds.values() for k in keys))

    def read_block(self, key: int) -> bytes | None:
        """A written block's payload (checksum verified), or None if absent or corrupt."""
        tier = self.pool.tier_of(key)
        if tier is None or key in self.unwritten:
            return None
        try:
            if tier == DRAM:
                payload = bytes(self.slab.view(self.slots[key]))
                kvblocks.verify(payload, self.checksums[key], key)
                return payload
            return self.ssd.get(key) if self.ssd is not None else None
        except ChecksumMismatch:
            self._drop_corrupt(key)  # its events go out with the caller's take_events()
            return None

    def drop_corrupt(self, key: int) -> list[PoolEvent]:
        self._drop_corrupt(key)
        return self.take_events()

    def _drop_corrupt(self, key: int) -> None:
        """A corrupt block leaves the pool: a `corrupt` event (audit) and an `evicted` one (the index)."""
        log.error("node %s: block %016x failed its checksum; dropped (it will be recomputed)", self.node, key)
        tier = self.pool.tier_of(key) or DRAM
        self._events.append(("corrupt", tier, key))
        for action in self.pool.discard([key]):
            self._execute(action)

    def snapshot(self) -> tuple[int, dict[int, str]]:
        held = {k: t for k, t in self.pool.snapshot().items() if k not in self.unwritten}
        return self.seq, held

    def close(self) -> None:
        self.slab.close()
        self.slab.unlink()
        if self.ssd is not None:
            self.ssd.close()

    # --- executing the pool's decisions -------------------------------------------------------
    def _promote(self, key: int) -> bool:
        actions = self.pool.promote(key)
        for action in actions:
            self._execute(action)
        return self.pool.tier_of(key) == DRAM

    def _execute(self, action: PoolAction) -> None:
        key = action.key
        if isinstance(action, Demoted):
            slot = self.slots.pop(key)
            view = self.slab.view(slot)
            try:
                status = self.ssd.put(key, view, self.checksums[key]) if self.ssd is not None else PutStatus.FULL
            except Exception as exc:  # a disk or LMDB error: the block is lost, its slot is not
                log.error("node %s: SSD write of block %016x failed (%s); block dropped", self.node, key, exc)
                status = PutStatus.FULL
            finally:
                view.release()  # NOTE: a view left to an exception's traceback would pin the mmap
                self.slab.free(slot)
            if status is PutStatus.FULL:  # LMDB full despite the accounting: drop instead of crashing
                log.warning("node %s: SSD tier full or failing; block dropped instead of demoted", self.node)
                self.pool.discard([key])
                self.checksums.pop(key, None)
                self._events.append(("evicted", DRAM, key))
            else:
                self._events.append(change_of(action))
        elif isinstance(action, Promoted):
            self._execute_promotion(key)
        elif isinstance(action, Evicted):
            if action.tier == DRAM:
                self.slab.free(self.slots.pop(key))
            elif self.ssd is not None:
                try:
                    self.ssd.delete(key)
                except Exception as exc:  # the record stays on disk; the pool has forgotten it
                    log.error("node %s: SSD delete of block %016x failed: %r", self.node, key, exc)
            self.checksums.pop(key, None)
            self._events.append(change_of(action))

    def _execute_promotion(self, key: int) -> None:
        try:
            payload = self.ssd.get(key) if self.ssd is not None else None
        except Exception:  # ChecksumMismatch, or a disk/LMDB error: a miss
            payload = None
        if payload is None:  # corrupt or lost: the pool already moved it, so drop it
            log.error("node %s: block %016x unreadable on SSD; dropped", self.node, key)
            self.pool.discard([key])
            self.checksums.pop(key, None)
            self._events.append(("corrupt", SSD, key))
            self._events.append(("evicted", SSD, key))
            return
        slot = self._alloc_slot()
        self.slab.write(slot, payload)
        self.slots[key] = slot
        self.ssd.delete(key)
        self._events.append(change_of(Promoted(key)))

    def _alloc_slot(self) -> int:
        slot = self.slab.alloc()
        if slot is None:  # the pool's accounting and the slab's free list disagree: a bug
            raise RuntimeError(f"node {self.node}: no free DRAM slot although the pool made room")
        return slot

    def take_events(self, reader: str = "") -> list[PoolEvent]:
        """Group this operation's changes into numbered events (one per run of kind and tier);
        `corrupt` ones (audit only, not numbered) name the request whose read found them."""
        out: list[PoolEvent] = []
        for kind, tier, keys in runs(self._events):
            if kind == "corrupt":
                out.append(PoolEvent(kind, KvEventData(self.node, self.epoch, 0, keys, tier, reader)))
                continue
            self.seq += 1
            out.append(PoolEvent(kind, KvEventData(self.node, self.epoch, self.seq, keys, tier)))
        self._events.clear()
        return out


