"""The global prefix index: block key -> holders {node: tier}, fed by the messengers' KV events.

Layout. Each node gets a small integer slot i (reused after `drop_node`). Per key we keep three
bitmasks, bit i set when node i holds the key in that tier (or in either):

    _masks: key -> (dram_mask, ssd_mask, any_mask)   (any = dram | ssd; a key held nowhere is deleted)

(A tuple, replaced on every change, not a list updated in place: a tuple holds its items inline,
so `match` touches one memory block fewer per key; on a cold cache that is most of its cost.)

`match(keys)` walks the request's keys once, carrying the set of nodes still matching as one int:

    active = every node
    for i, key in enumerate(keys):
        held = any_mask & active
        nodes in active but not in held stop here with prefix length i
        active = held;  if not active: stop
        nodes in ssd_mask & active count one more SSD block   (counted as runs: only when the
                                                               set of SSD holders changes)

so a query costs O(best_len) integer operations, whatever the number of nodes (16 nodes x
200k blocks: ~50 us for a 256-block prompt on one idle core).

Consistency. Each publisher numbers its events 1, 2, 3, ... An event whose seq is not last+1 for
its node is IGNORED: seq <= last is a duplicate; seq > last+1 is a gap, and the result says the
node needs a resync (`load_snapshot(node, seq, entries)` replaces that node's entries exactly, and
the next event expected is seq+1). A node first seen with seq != 1 (e.g. after the index itself
restarted) is a gap too. Until the resync the node's old entries are still served: slightly
stale is better than no cache hits.

Pure: no I/O, no clock; the cache_index service owns NATS and calls into this.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Literal, Mapping

Tier = Literal["dram", "ssd"]
KIND_STORED = "stored"
KIND_EVICTED = "evicted"
KIND_PROMOTED = "promoted"
KIND_DEMOTED = "demoted"
KINDS = (KIND_STORED, KIND_EVICTED, KIND_PROMOTED, KIND_DEMOTED)
TIERS = ("dram", "ssd")
_DRAM, _SSD, _ANY = 0, 1, 2  # (match() spells _SSD and _ANY as literals) index into a key's (dram_mask, ssd_mask, dram_mask | ssd_mask)
_EMPTY = (0, 0, 0)
_NODE_MATCH_CACHE = 4096  # distinct (prefix_len, num_ssd) answers kept by match()


@dataclass(frozen=True)
class KvEvent:
    """One messenger's report that `keys` changed state on `node` (mirrors the wire schema).

    kind: stored (now in `tier`), evicted (gone from `tier`), promoted (ssd -> dram),
    demoted (dram -> ssd); for promoted/demoted `tier` is the destination.
    """

    node: str
    seq: int
    kind: str
    keys: tuple[int, ...]
    tier: str = "dram"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"KvEvent.kind must be one of {KINDS}, got {self.kind!r}")
        if self.tier not in TIERS:
            raise ValueError(f"KvEvent.tier must be one of {TIERS}, got {self.tier!r}")
        if self.seq < 1:
            raise ValueError(f"KvEvent.seq starts at 1, got {self.seq}")


@dataclass(frozen=True, slots=True)
class ApplyResult:
    """What `apply` did with an event: applied, or ignored as a duplicate or because of a gap."""

    status: Literal["applied", "duplicate", "gap"]
    node: str
    expected_seq: int  # the seq the index wanted from this node

    @property
    def resync_needed(self) -> bool:
        return self.status == "gap"


@dataclass(frozen=True, slots=True)
class NodeMatch:
    """How many leading keys of a query one node holds, split by the tier they sit in."""

    prefix_len: int
    num_dram: int
    num_ssd: int


@dataclass(frozen=True)
class PrefixMatch:
    """Answer to `match`: every known node's leading-prefix length, and the best holders."""

    per_node: dict[str, NodeMatch]  # node -> its match (nodes holding nothing have prefix_len 0)
    best_len: int
    best_nodes: list[str] = field(default_factory=list)  # nodes with prefix_len == best_len > 0


class PrefixIndex:
    """Global key -> holders map with per-publisher sequence checking."""

    def __init__(self) -> None:
        self._masks: dict[int, tuple[int, int, int]] = {}  # key -> (dram_mask, ssd_mask, any_mask) (bit = node slot)
        self._slot: dict[str, int] = {}  # node -> bit index
        self._node_at: dict[int, str] = {}  # bit index -> node
        self._free_slots: list[int] = []  # bit indices freed by drop_node, reused first
        self._last_seq: dict[str, int] = {}  # node -> last seq applied
        self._all = 0  # mask of every known node
        self._node_matches: dict[tuple[int, int], NodeMatch] = {}  # (prefix_len, num_ssd) -> shared NodeMatch

    # --- feeding ----------------------------------------------------------------------------------

    def apply(self, event: KvEvent) -> ApplyResult:
        """Apply one event if it is the next of its publisher; else ignore it and say why."""
        last = self._last_seq.get(event.node, 0)
        expected = last + 1
        if event.seq <= last:
            return ApplyResult("duplicate", event.node, expected)
        if event.seq != expected:
            return ApplyResult("gap", event.node, expected)
        bit = 1 << self._slot_of(event.node)
        self._last_seq[event.node] = event.seq
        if event.kind == KIND_STORED:
            self._set(event.keys, bit, _DRAM if event.tier == "dram" else _SSD)
        elif event.kind == KIND_EVICTED:
            self._clear(event.keys, bit, _DRAM if event.tier == "dram" else _SSD)
        elif event.kind == KIND_PROMOTED:
            self._clear(event.keys, bit, _SSD)
            self._set(event.keys, bit, _DRAM)
        else:  # demoted
            self._clear(event.keys, bit, _DRAM)
            self._set(event.keys, bit, _SSD)
        return ApplyResult("applied", event.node, expected)

    def load_snapshot(self, node: str, seq: int, entries: Mapping[int, str]) -> None:
        """Replace everything `node` holds by `entries` (# key -> tier), as of its event `seq`."""
        for tier in entries.values():
            if tier not in TIERS:
                raise ValueError(f"snapshot tier must be one of {TIERS}, got {tier!r}")
        bit = 1 << self._slot_of(node)
        self._forget_bit(bit)
        for key, tier in entries.items():
            self._set((key,), bit, _DRAM if tier == "dram" else _SSD)
        self._last_seq[node] = seq

    def drop_node(self, node: str) -> None:
        """Forget a node entirely (it left or died); its next event will ask for a resync."""
        slot = self._slot.pop(node, None)
        self._last_seq.pop(node, None)
        if slot is None:
            return
        bit = 1 << slot
        self._forget_bit(bit)
        del self._node_at[slot]
        self._free_slots.append(slot)
        self._all &= ~bit

    # --- queries ------------------------------------------------------------------------------------

    @property
    def nodes(self) -> list[str]:
        return list(self._slot)

    def __len__(self) -> int:
        """Number of distinct keys held by at least one node."""
        return len(self._masks)

    def num_holdings(self) -> int:
        """(key, node) pairs held, over every key (O(keys): for metrics, read at scrape time)."""
        return sum(masks[_ANY].bit_count() for masks in self._masks.values())

    def last_seq(self, node: str) -> int:
        return self._last_seq.get(node, 0)

    def holders(self, key: int) -> dict[str, str]:
        """# node -> tier, for one key."""
        masks = self._masks.get(key)
        if masks is None:
            return {}
        out: dict[str, str] = {}
        for slot, node in self._node_at.items():
            if masks[_DRAM] >> slot & 1:
                out[node] = "dram"
            elif masks[_SSD] >> slot & 1:
                out[node] = "ssd"
        return out

    def node_entries(self, node: str) -> dict[int, str]:
        """# key -> tier, everything one node holds (O(total keys): for tests and debugging)."""
        slot = self._slot.get(node)
        if slot is None:
            return {}
        bit = 1 << slot
        return {
            key: ("dram" if masks[_DRAM] & bit else "ssd")
            for key, masks in self._masks.items()
            if masks[_ANY] & bit
        }

    def match(self, keys: Iterable[int]) -> PrefixMatch:
        """For every node, how many leading `keys` it holds (any tier), and who holds the most."""
        active = self._all
        lengths: dict[int, int] = {}  # slot -> prefix length, for nodes that stopped matching
        ssd_counts: dict[int, int] = {}  # slot -> SSD blocks within its prefix
        ssd_open: dict[int, int] = {}  # slot -> where its current run of SSD blocks began
        on_ssd = 0  # slots whose current block is on SSD: counted as runs, not per block
        n = 0
        # map(get, ...) keeps the per-key lookup in C; this loop is the conductor's hot path,
        # and in the common case (nothing changes) it costs two ANDs and two compares per key.
        for masks in map(self._masks.get, keys):
            if masks is None:
                break
            held = masks[2] & active  # 2 = _ANY, 1 = _SSD: constants, not global lookups, per key
            if held != active:
                _record(active & ~held, n, lengths)
                active = held
                if not active:
                    break
            ssd = masks[1] & active
            if ssd != on_ssd:
                _switch_runs(on_ssd, ssd, n, ssd_open, ssd_counts)
                on_ssd = ssd
            n += 1
        if on_ssd:
            _switch_runs(on_ssd, 0, n, ssd_open, ssd_counts)
        # Nodes still in `active` hold all n keys (not recorded in `lengths`: that is the common case,
        # every node holding the shared first block); the others stopped earlier, so n is the best.
        best_len = n if active else max(lengths.values(), default=0)
        per_node: dict[str, NodeMatch] = {}
        best_nodes: list[str] = []
        # NodeMatch is frozen, so equal ones can be shared: building one costs ~1 us (16 per
        # query), a lookup keyed by all of its fields ~0.1 us. Bounded: cleared when it grows.
        made = self._node_matches
        get_length, get_ssd = lengths.get, ssd_counts.get
        for slot, node in self._node_at.items():
            length = n if active >> slot & 1 else get_length(slot, 0)
            num_ssd = get_ssd(slot, 0)
            nm = made.get((length, num_ssd))
            if nm is None:
                if len(made) >= _NODE_MATCH_CACHE:
                    made.clear()
                nm = made[(length, num_ssd)] = NodeMatch(length, length - num_ssd, num_ssd)
            per_node[node] = nm
            if length == best_len and best_len > 0:
                best_nodes.append(node)
        return PrefixMatch(per_node, best_len, best_nodes)

    # --- internals --------------------------------------------------------------------------------

    def _slot_of(self, node: str) -> int:
        slot = self._slot.get(node)
        if slot is None:
            slot = self._free_slots.pop() if self._free_slots else len(self._slot)
            self._slot[node] = slot
            self._node_at[slot] = node
            self._all |= 1 << slot
        return slot

    def _set(self, keys: Iterable[int], bit: int, tier: int) -> None:
        table = self._masks
        get = table.get
        clear = ~bit
        for key in keys:
            dram, ssd, _ = get(key, _EMPTY)
            if tier == _DRAM:
                dram, ssd = dram | bit, ssd & clear  # a node holds a key in one tier only
            else:
                dram, ssd = dram & clear, ssd | bit
            table[key] = (dram, ssd, dram | ssd)

    def _clear(self, keys: Iterable[int], bit: int, tier: int) -> None:
        table = self._masks
        clear = ~bit
        for key in keys:
            masks = table.get(key)
            if masks is None:
                continue
            dram, ssd, _ = masks
            if tier == _DRAM:
                dram &= clear
            else:
                ssd &= clear
            if dram | ssd:
                table[key] = (dram, ssd, dram | ssd)
            else:
                del table[key]

    def _forget_bit(self, bit: int) -> None:
        """Clear one node from every key: O(total keys), only on resync or node loss."""
        table = self._masks
        clear = ~bit
        changed = [(key, masks) for key, masks in table.items() if masks[_ANY] & bit]
        for key, (dram, ssd, any_) in changed:
            if any_ & clear:
                table[key] = (dram & clear, ssd & clear, any_ & clear)
            else:
                del table[key]


def _record(mask: int, length: int, lengths: dict[int, int]) -> None:
    """Set `length` for every node slot whose bit is set in `mask`."""
    while mask:
        low = mask & -mask
        lengths[low.bit_length() - 1] = length
        mask ^= low


def _switch_runs(old: int, new: int, n: int, open_at: dict[int, int], counts: dict[int, int]) -> None:
    """Close the SSD runs of slots in `old` but not `new` at index n; open those only in `new`."""
    closing = old & ~new
    while closing:
        low = closing & -closing
        slot = low.bit_length() - 1
        counts[slot] = counts.get(slot, 0) + n - open_at.pop(slot)
        closing ^= low
    opening = new & ~old
    while opening:
        low = opening & -opening
        open_at[low.bit_length() - 1] = n
        opening ^= low
