"""Eviction policies over block keys: which unpinned block to drop next.

Policies (select with `make_policy(name)`):

- `lru` (default): evict the least recently used block. An OrderedDict in use order: O(1).
- `lfu`: evict the least frequently used block (insert counts as the first use); ties go to
  the least recently used. A min-heap of (uses, last use, key): O(log n).
- `length-aware`: evict the block deepest in its prompt first (largest block index), because a
  deep block is only useful to a request that also holds every block before it; ties go to the
  least recently used. A min-heap of (-depth, last use, key): O(log n).

The heaps use lazy deletion: a touch pushes a fresh entry and leaves the old one behind; an entry
is live only if it equals the key's current priority, and the heap is rebuilt when stale entries
outnumber live ones, so the cost stays O(log n) amortised.

Time is a logical counter, one tick per operation, owned by each policy instance: no clock.

Pinning: a block in use by a running request must not be evicted. `pin` counts (two requests
pin twice and need two `unpin`s). A pinned key leaves the eviction order altogether, so `victim`
never has to skip over it; the last `unpin` puts it back as a fresh use (the request just read
it). `touch` on a pinned key still counts the use.

`victim()` only names the next key to evict; the caller decides and calls `remove(key)`.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Iterator

DEFAULT_POLICY = "lru"


class UnknownBlock(KeyError):
    """Raised by `touch`, `remove`, `pin` or `unpin` for a key the policy does not hold."""


class NotPinned(ValueError):
    """Raised by `unpin` on a key whose pin count is already zero."""


class EvictionPolicy:
    """The interface every policy implements; subclasses fill in the ordering."""

    name = "base"

    def __init__(self) -> None:
        self._tick = 0  # logical time: one tick per insert/touch/unpin
        self._pins: dict[int, int] = {}  # key -> pin count (> 0); pinned keys are out of the order

    # --- the interface -----------------------------------------------------------------------

    def insert(self, key: int, depth: int = 0) -> None:
        """Start tracking `key` (block index `depth` in its prompt); an existing key is touched."""
        if key in self:
            self.touch(key)
            return
        self._tick += 1
        self._add(key, depth)

    def touch(self, key: int) -> None:
        """Record a use of `key`."""
        if key not in self:
            raise UnknownBlock(key)
        self._tick += 1
        self._use(key, queued=key not in self._pins)

    def remove(self, key: int) -> None:
        """Stop tracking `key`, pinned or not."""
        if key not in self:
            raise UnknownBlock(key)
        self._pins.pop(key, None)
        self._drop(key)

    def pin(self, key: int) -> None:
        """Protect `key` from eviction until a matching `unpin`."""
        if key not in self:
            raise UnknownBlock(key)
        count = self._pins.get(key, 0)
        if count == 0:
            self._dequeue(key)
        self._pins[key] = count + 1

    def unpin(self, key: int) -> None:
        """Release one pin; the last one makes `key` evictable again, as a fresh use."""
        if key not in self:
            raise UnknownBlock(key)
        count = self._pins.get(key, 0)
        if count == 0:
            raise NotPinned(key)
        if count > 1:
            self._pins[key] = count - 1
            return
        del self._pins[key]
        self._tick += 1
        self._use(key, queued=False)

    def pin_count(self, key: int) -> int:
        return self._pins.get(key, 0)

    def victim(self) -> int | None:
        """The key to evict next, never a pinned one; None if nothing is evictable."""
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def __contains__(self, key: object) -> bool:
        raise NotImplementedError

    def __iter__(self) -> Iterator[int]:
        raise NotImplementedError

    # --- what a subclass implements -------------------------------------------------------------

    def _add(self, key: int, depth: int) -> None:
        """Track a new, unpinned key as used now."""
        raise NotImplementedError

    def _use(self, key: int, queued: bool) -> None:
        """Record a use now; put the key (back) into the order unless it is pinned (`queued` says
        whether it is in the order at the moment)."""
        raise NotImplementedError

    def _dequeue(self, key: int) -> None:
        """Take a key out of the order (it is being pinned) but keep its metadata."""
        raise NotImplementedError

    def _drop(self, key: int) -> None:
        """Forget a key entirely."""
        raise NotImplementedError


class LruPolicy(EvictionPolicy):
    """Least recently used first."""

    name = "lru"

    def __init__(self) -> None:
        super().__init__()
        self._order: OrderedDict[int, None] = OrderedDict()  # unpinned keys, oldest use first
        self._pinned_keys: set[int] = set()  # keys out of the order while pinned

    def victim(self) -> int | None:
        return next(iter(self._order), None)

    def __len__(self) -> int:
        return len(self._order) + len(self._pinned_keys)

    def __contains__(self, key: object) -> bool:
        return key in self._order or key in self._pinned_keys

    def __iter__(self) -> Iterator[int]:
        yield from self._order
        yield from self._pinned_keys

    def _add(self, key: int, depth: int) -> None:
        self._order[key] = None

    def _use(self, key: int, queued: bool) -> None:
        if queued:
            self._order.move_to_end(key)
        elif key not in self._pins:  # unpinned just now
            self._pinned_keys.discard(key)
            self._order[key] = None

    def _dequeue(self, key: int) -> None:
        del self._order[key]
        self._pinned_keys.add(key)

    def _drop(self, key: int) -> None:
        if key in self._order:
            del self._order[key]
        else:
            self._pinned_keys.discard(key)


class _HeapPolicy(EvictionPolicy):
    """A min-heap of (priority..., key) with lazy deletion; subclasses define the priority."""

    _COMPACT_MIN = 1024  # never rebuild a heap smaller than this

    def __init__(self) -> None:
        super().__init__()
        self._heap: list[tuple] = []  # (priority..., key); stale entries allowed
        self._live: dict[int, tuple] = {}  # unpinned key -> its current heap entry
        self._meta: dict[int, list[int]] = {}  # key -> [depth, uses, last use tick]

    def victim(self) -> int | None:
        heap, live = self._heap, self._live
        while heap:
            entry = heap[0]
            if live.get(entry[-1]) is entry:
                return entry[-1]
            heapq.heappop(heap)  # stale: the key was touched, pinned or removed since
        return None

    def __len__(self) -> int:
        return len(self._meta)

    def __contains__(self, key: object) -> bool:
        return key in self._meta

    def __iter__(self) -> Iterator[int]:
        return iter(self._meta)

    def _priority(self, meta: list[int], key: int) -> tuple:
        raise NotImplementedError

    def _push(self, key: int) -> None:
        entry = self._priority(self._meta[key], key)
        self._live[key] = entry
        heapq.heappush(self._heap, entry)
        if len(self._heap) > max(self._COMPACT_MIN, 2 * len(self._live)):
            self._heap = list(self._live.values())
            heapq.heapify(self._heap)

    def _add(self, key: int, depth: int) -> None:
        self._meta[key] = [depth, 1, self._tick]
        self._push(key)

    def _use(self, key: int, queued: bool) -> None:
        meta = self._meta[key]
        if queued or key not in self._pins:
            if queued:
                meta[1] += 1  # a real touch; an unpin refreshes recency only
            meta[2] = self._tick
            self._push(key)
        else:
            meta[1] += 1
            meta[2] = self._tick

    def _dequeue(self, key: int) -> None:
        del self._live[key]

    def _drop(self, key: int) -> None:
        del self._meta[key]
        self._live.pop(key, None)


class LfuPolicy(_HeapPolicy):
    """Least frequently used first; ties go to the least recently used."""

    name = "lfu"

    def _priority(self, meta: list[int], key: int) -> tuple:
        return (meta[1], meta[2], key)


class LengthAwarePolicy(_HeapPolicy):
    """Deepest block (largest index in its prompt) first; ties go to the least recently used."""

    name = "length-aware"

    def _priority(self, meta: list[int], key: int) -> tuple:
        return (-meta[0], meta[2], key)


# name -> policy class
POLICIES: dict[str, type[EvictionPolicy]] = {
    LruPolicy.name: LruPolicy,
    LfuPolicy.name: LfuPolicy,
    LengthAwarePolicy.name: LengthAwarePolicy,
}


def make_policy(name: str = DEFAULT_POLICY) -> EvictionPolicy:
    """A fresh, empty policy by name; ValueError lists the valid names."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; valid: {', '.join(POLICIES)}") from None
