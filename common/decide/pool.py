"""One node's two-tier KV pool, as pure accounting: which block lives in which tier.

Tiers are exclusive: a block is either in DRAM or on SSD, never both.

    put(new key)   DRAM full? evict DRAM's victim:  SSD tier?  -> Demoted(victim) to SSD
                                                                 (SSD full? Evicted(ssd victim, ssd) first)
                                                   no SSD     -> Evicted(victim, dram)
                   then Stored(key, dram)
    put(SSD key)   = promote(key): make room in DRAM as above, then Promoted(key)
    put(DRAM key)  touch only, no action

Each operation returns the `PoolAction`s it took, IN THE ORDER TO EXECUTE THEM on real storage
(a demotion frees the DRAM slot that the following store or promotion reuses). The live messenger
executes them on the shm slab and LMDB and publishes them as KV events; the simulator and
`moonbus cachesim` only count them.

Pinned blocks (in use by a running request) are never evicted or demoted. When DRAM is full of
pinned blocks a new block cannot be placed: the result is a `NoRoom(key)` action, nothing is
evicted and nothing raises. When SSD is full of pinned blocks, a DRAM victim is dropped instead
of demoted.

During a promotion the demotions come first, so the SSD briefly holds one block over its
capacity (the promoted block leaves it right after): give the LMDB map one block of headroom.

Capacities are in blocks; `capacity_in_blocks(bytes, layout)` converts.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import groupby
from typing import Iterable, Literal, Union

from common.kv.blocks import KvLayout
from common.decide.eviction import DEFAULT_POLICY, UnknownBlock, make_policy

Tier = Literal["dram", "ssd"]
DRAM: Tier = "dram"
SSD: Tier = "ssd"


@dataclass(frozen=True, slots=True)
class Stored:
    """A new block was placed in `tier` (always DRAM from `put`)."""

    key: int
    tier: Tier


@dataclass(frozen=True, slots=True)
class Demoted:
    """A block moved DRAM -> SSD to make room in DRAM."""

    key: int


@dataclass(frozen=True, slots=True)
class Promoted:
    """A block moved SSD -> DRAM (an SSD hit)."""

    key: int


@dataclass(frozen=True, slots=True)
class Evicted:
    """A block was dropped from `tier` (from SSD, or from DRAM when it could not be demoted)."""

    key: int
    tier: Tier


@dataclass(frozen=True, slots=True)
class NoRoom:
    """`key` could not be placed in DRAM: every DRAM block is pinned. Nothing was evicted."""

    key: int


PoolAction = Union[Stored, Demoted, Promoted, Evicted, NoRoom]
Change = tuple[str, Tier, int]  # (KV event kind, tier, key): one block's change, as the index hears it


def change_of(action: PoolAction) -> Change | None:
    """What the prefix index hears of an action executed as the pool decided it (None: NoRoom)."""
    if isinstance(action, Stored):
        return "stored", action.tier, action.key
    if isinstance(action, Demoted):
        return "demoted", SSD, action.key
    if isinstance(action, Promoted):
        return "promoted", DRAM, action.key
    if isinstance(action, Evicted):
        return "evicted", action.tier, action.key
    return None


def runs(changes: Iterable[Change]) -> list[tuple[str, Tier, list[int]]]:
    """Consecutive changes of one kind and tier, each run one KV event (kind, tier, keys), in order:
    the live messenger and the simulator number and publish these alike."""
    return [(kind, tier, [key for _, _, key in run]) for (kind, tier), run in groupby(changes, key=lambda c: c[:2])]


@dataclass(frozen=True, slots=True)
class PrefixLookup:
    """How many LEADING keys the pool holds, and the tier of each of them."""

    num_hits: int
    tiers: list[Tier]

    @property
    def num_dram(self) -> int:
        return sum(1 for t in self.tiers if t == DRAM)

    @property
    def num_ssd(self) -> int:
        return sum(1 for t in self.tiers if t == SSD)


def capacity_in_blocks(capacity_bytes: int, layout: KvLayout) -> int:
    """How many whole blocks of `layout` fit in `capacity_bytes`."""
    if capacity_bytes < 0:
        raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
    return capacity_bytes // layout.block_nbytes


class TieredPool:
    """Accounting of one node's DRAM + SSD block pool (ssd_capacity_blocks=0: no SSD tier)."""

    def __init__(self, dram_capacity_blocks: int, ssd_capacity_blocks: int = 0, policy: str = DEFAULT_POLICY) -> None:
        if dram_capacity_blocks < 0 or ssd_capacity_blocks < 0:
            raise ValueError(
                f"capacities must be >= 0, got dram={dram_capacity_blocks} ssd={ssd_capacity_blocks}"
            )
        self.dram_capacity_blocks = dram_capacity_blocks
        self.ssd_capacity_blocks = ssd_capacity_blocks
        self.policy_name = policy
        self._dram = make_policy(policy)  # eviction order of DRAM blocks
        self._ssd = make_policy(policy)  # eviction order of SSD blocks
        self._depth: dict[int, int] = {}  # key -> block index in its prompt (kept across moves)

    # --- queries -----------------------------------------------------------------------------

    @property
    def num_dram(self) -> int:
        return len(self._dram)

    @property
    def num_ssd(self) -> int:
        return len(self._ssd)

    def __len__(self) -> int:
        return len(self._depth)

    def __contains__(self, key: object) -> bool:
        return key in self._depth

    def tier_of(self, key: int) -> Tier | None:
        if key in self._dram:
            return DRAM
        if key in self._ssd:
            return SSD
        return None

    def pin_count(self, key: int) -> int:
        return self._policy_of(key).pin_count(key)

    def lookup_prefix(self, keys: Iterable[int]) -> PrefixLookup:
        """Count the leading keys held in either tier, stopping at the first miss. No side effects."""
        tiers: list[Tier] = []
        dram, ssd = self._dram, self._ssd
        for key in keys:
            if key in dram:
                tiers.append(DRAM)
            elif key in ssd:
                tiers.append(SSD)
            else:
                break
        return PrefixLookup(len(tiers), tiers)

    def snapshot(self) -> dict[int, Tier]:
        """Every held key with its tier (what a cache index resync loads). # key -> tier"""
        held: dict[int, Tier] = {key: DRAM for key in self._dram}
        held.update((key, SSD) for key in self._ssd)
        return held

    # --- updates -------------------------------------------------------------------------------

    def put(self, keys_with_depth: Iterable[tuple[int, int]]) -> list[PoolAction]:
        """Place blocks given as (key, depth) in DRAM; held ones are touched (SSD ones promoted)."""
        actions: list[PoolAction] = []
        for key, depth in keys_with_depth:
            if key in self._dram:
                self._dram.touch(key)
            elif key in self._ssd:
                self._promote(key, actions)
            elif self._make_dram_room(actions):
                self._dram.insert(key, depth)
                self._depth[key] = depth
                actions.append(Stored(key, DRAM))
            else:
                actions.append(NoRoom(key))
        return actions

    def touch(self, keys: Iterable[int]) -> None:
        """Record a use of each held key (unknown keys are ignored: they may have been evicted)."""
        for key in keys:
            if key in self._dram:
                self._dram.touch(key)
            elif key in self._ssd:
                self._ssd.touch(key)

    def promote(self, key: int) -> list[PoolAction]:
        """Move an SSD block to DRAM (no-op if already in DRAM). Raises `UnknownBlock` if absent."""
        actions: list[PoolAction] = []
        if key in self._dram:
            self._dram.touch(key)
        elif key in self._ssd:
            self._promote(key, actions)
        else:
            raise UnknownBlock(key)
        return actions

    def pin(self, keys: Iterable[int]) -> None:
        """Pin every key (counted). All or nothing: `UnknownBlock` if any key is not held."""
        keys = list(keys)
        for key in keys:
            if key not in self._depth:
                raise UnknownBlock(key)
        for key in keys:
            self._policy_of(key).pin(key)

    def unpin(self, keys: Iterable[int]) -> None:
        """Release one pin of each key (`NotPinned` if a key has none)."""
        for key in keys:
            self._policy_of(key).unpin(key)

    def discard(self, keys: Iterable[int]) -> list[PoolAction]:
        """Drop blocks wherever they are (e.g. a corrupt payload); unknown keys are ignored."""
        actions: list[PoolAction] = []
        for key in keys:
            tier = self.tier_of(key)
            if tier is not None:
                self._policy(tier).remove(key)
                del self._depth[key]
                actions.append(Evicted(key, tier))
        return actions

    # --- internals -------------------------------------------------------------------------------

    def _policy(self, tier: Tier):
        return self._dram if tier == DRAM else self._ssd

    def _policy_of(self, key: int):
        tier = self.tier_of(key)
        if tier is None:
            raise UnknownBlock(key)
        return self._policy(tier)

    def _promote(self, key: int, actions: list[PoolAction]) -> None:
        if not self._make_dram_room(actions, leaving_ssd=key):
            actions.append(NoRoom(key))
            self._ssd.touch(key)
            return
        self._move(key, self._ssd, self._dram)
        actions.append(Promoted(key))

    def _make_dram_room(self, actions: list[PoolAction], leaving_ssd: int | None = None) -> bool:
        """Free one DRAM slot if DRAM is full; False if every DRAM block is pinned.

        `leaving_ssd` is a block about to leave SSD (a promotion): its place counts as free.
        """
        if len(self._dram) < self.dram_capacity_blocks:
            return True
        victim = self._dram.victim()
        if victim is None:
            return False
        if self.ssd_capacity_blocks > 0 and self._make_ssd_room(actions, leaving_ssd):
            self._move(victim, self._dram, self._ssd)
            actions.append(Demoted(victim))
        else:
            self._dram.remove(victim)
            del self._depth[victim]
            actions.append(Evicted(victim, DRAM))
        return True

    def _make_ssd_room(self, actions: list[PoolAction], leaving: int | None) -> bool:
        """Free one SSD slot if SSD is full; False if every SSD block is pinned.

        A block `leaving` SSD (being promoted) frees its place, so no eviction is needed then.
        """
        used = len(self._ssd) - (1 if leaving is not None else 0)
        if used < self.ssd_capacity_blocks:
            return True
        victim = self._ssd.victim()
        if victim is None:
            return False
        self._ssd.remove(victim)
        del self._depth[victim]
        actions.append(Evicted(victim, SSD))
        return True

    def _move(self, key: int, source, target) -> None:
        pins = source.pin_count(key)
        source.remove(key)
        target.insert(key, self._depth[key])
        for _ in range(pins):
            target.pin(key)
