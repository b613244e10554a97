"""What `moonbus bench transfer` moves, and how one pattern is timed and its every run checked.

A pattern is one transfer the system makes, in byte offsets into buffers of the same layout at
both ends (the sender's source, the receiver's region):

    size:N       one write of N bytes at offset 0, then one completion (a KV block, a request's KV, 64 MiB)
    handoff:T    the streamed handoff of a T-token request: one write per layer slice (its 2 x kv-heads
                 runs, where common/kv/slices.SliceGeometry puts them), back to back, then one completion
    pull:N       N blocks of the peer's region, at scattered slots, read into scattered local slots in
                 one read, each checked against the checksum the source announced (the messenger's pull)

Every case of a pattern moves exactly those bytes in that order; each case (transfer_peers.py,
transfer_socket.py) says whether it checks their integrity (xxh3) inside the timed section.

Every run is checked, outside the timed section: before a run the bytes to move are stamped with
the run's number every STAMP_STRIDE bytes (`stamp`), so no run's bytes equal an earlier run's, and
after it the destination must hold exactly this run's bytes (a push: the receiver's checksum of
what it holds; a pull: the local slots, which are zeroed before each case's turn). The cases take
turns within a run, in rotating order, so machine noise hits them alike; each pattern runs until
every case had MIN_CASE_SECONDS (at least `repeats` runs, at most MAX_RUNS), after one warm-up run.
"""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import xxhash

from common.kv.slices import SliceGeometry, meta

GIB = 1 << 30
STAMP_STRIDE = 256  # bytes: every piece of every pattern is longer, so every piece changes each run
# A short transfer's time is mostly scheduling noise on a small machine: each pattern runs until
# every case had about this much time (or MAX_RUNS), so that the median settles.
MIN_CASE_SECONDS = 0.5
MAX_RUNS = 400

Run = Callable[[list[int]], None]  # one transfer; a pull's argument: each block's announced checksum


@dataclass(frozen=True)
class Pattern:
    name: str  # "size:block", "handoff:2048", "pull:16"
    label: str  # what it is, for the report
    writes: tuple[tuple[tuple[int, int], ...], ...] = ()  # push: each write's (offset, nbytes) pieces
    metas: tuple[dict, ...] = ()  # push: what each write carries (a slice's layer and tokens), as the service sends it
    reads: tuple[tuple[int, int, int], ...] = ()  # pull: (offset at the peer, local offset, nbytes) per block
    goal: str = ""  # which of the transport's goals it judges: "" | "throughput" | "round trip"

    @property
    def kind(self) -> str:
        return "pull" if self.reads else "push"

    @property
    def nbytes(self) -> int:
        return sum(n for w in self.writes for _, n in w) + sum(n for _, _, n in self.reads)

    @property
    def messages(self) -> int:
        """Writes (push) or blocks (pull) per run."""
        return len(self.writes) or len(self.reads)

    @property
    def peer_ranges(self) -> list[tuple[int, int]]:
        """(offset, nbytes) at the peer of every byte moved, in order."""
        return [p for w in self.writes for p in w] or [(off, n) for off, _, n in self.reads]

    @property
    def peer_extent(self) -> int:
        return max(off + n for off, n in self.peer_ranges)

    @property
    def local_extent(self) -> int:
        return max((off + n for _, off, n in self.reads), default=0)


def size_pattern(name: str, nbytes: int, goal: str = "") -> Pattern:
    return Pattern(f"size:{name}", f"one write of {nbytes:,} bytes, then one completion", (((0, nbytes),),), goal=goal)


def handoff_pattern(shape: tuple[int, int, int, int, int], itemsize: int) -> Pattern:
    """One request's KV [L, 2, H, T, D] streamed as the prefill does: a write per layer slice."""
    geometry = SliceGeometry(shape, itemsize)
    layers, tokens = geometry.num_layers, geometry.num_tokens
    writes = tuple(tuple(geometry.runs(layer, 0, tokens)) for layer in range(layers))
    label = (f"{tokens}-token request's handoff: {layers} slice writes of {geometry.nbytes // layers:,} bytes "
             f"({2 * geometry.num_kv_heads} runs each), back to back, then one completion")
    return Pattern(f"handoff:{tokens}", label, writes, tuple(meta(layer, 0, tokens) for layer in range(layers)),
                   goal="throughput")


def pull_pattern(blocks: int, block_nbytes: int, seed: int) -> Pattern:
    """`blocks` blocks from scattered slots of a peer slab of 4x as many, into scattered local slots."""
    rng = np.random.default_rng(seed + blocks)
    src = rng.permutation(4 * blocks)[:blocks]
    dst = rng.permutation(2 * blocks)[:blocks]
    reads = tuple((int(s) * block_nbytes, int(d) * block_nbytes, block_nbytes) for s, d in zip(src, dst))
    return Pattern(f"pull:{blocks}", f"{blocks} blocks of {block_nbytes:,} bytes read in one read from scattered "
                                     f"slots, each checked against its announced checksum", reads=reads,
                   goal="throughput")


# ---------------------------------------------------------------------------- the bytes


def make_buffer(capacity: int, seed: int) -> np.ndarray:
    """`capacity` bytes (a multiple of 8) of seeded random content: every receiver and the sender's
    source start equal, so a pull's expected bytes are the sender's own source, stamped alike."""
    return np.random.default_rng(seed).integers(0, 256, capacity, dtype=np.uint8)


def stamp(buf: np.ndarray, run: int) -> None:
    """Write the run's number every STAMP_STRIDE bytes: this run's bytes differ from every other's."""
    buf[: buf.nbytes // 8 * 8].view(np.uint64)[:: STAMP_STRIDE // 8] = run


def digest(buf: memoryview | np.ndarray, ranges: list[tuple[int, int]]) -> int:
    """xxh3-64 of the ranges' bytes, in order."""
    view = memoryview(buf).cast("B")
    h = xxhash.xxh3_64()
    for off, n in ranges:
        h.update(view[off:off + n])
    return h.intdigest()


# ---------------------------------------------------------------------------- timing


@dataclass
class Case:
    """One way of making a pattern's transfer: `run` does it (verifying inside if `integrity` says so)."""

    name: str
    integrity: str  # what is checked inside the timed section: "xxh3 both ends", "xxh3 on arrival", "none"
    run: Run
    peer: object  # its receiver: digest(ranges) and stamp(run) of the receiver's memory (transfer_peers.Peer)
    seconds: list[float] = field(default_factory=list)
    verified: int = 0  # runs whose bytes were checked and right (the warm-up included)
    errors: list[str] = field(default_factory=list)


def measure(pattern: Pattern, cases: list[Case], source: np.ndarray, local: np.ndarray, repeats: int,
            runs_so_far: itertools.count, case_seconds: float = MIN_CASE_SECONDS) -> list[dict]:
    """Time `cases` on `pattern` in turns and check every run; one row per case."""
    if not cases:
        return []
    slowest = max(_turn(pattern, c, source, local, next(runs_so_far)) for c in cases)  # the warm-up run
    runs = max(repeats, min(MAX_RUNS, int(case_seconds / max(slowest, 1e-6))))
    for c in cases:
        c.seconds.clear()  # NOTE: the warm-up's time is not kept; its check is
    for i in range(runs):
        run = next(runs_so_far)
        if pattern.kind == "push":
            stamp(source[:pattern.peer_extent], run)
        k = i % len(cases)  # the first case of a run meets the machine's state cold: rotate who goes first
        for c in cases[k:] + cases[:k]:
            c.seconds.append(_turn(pattern, c, source, local, run, stamped=True))
    return [_row(pattern, c, runs) for c in cases]


def _turn(pattern: Pattern, case: Case, source: np.ndarray, local: np.ndarray, run: int, stamped: bool = False) -> float:
    """One run of one case, timed; then its bytes checked. Returns the seconds (inf when it failed)."""
    expected: list[int] = []
    if pattern.kind == "push":
        if not stamped:
            stamp(source[:pattern.peer_extent], run)
    else:  # NOTE: the peer and `source` start equal (make_buffer) and are stamped alike, so the source's
        # bytes are the peer's: what the source node announces in its pin reply
        case.peer.stamp(run)
        stamp(source, run)
        expected = [digest(source, [(off, n)]) for off, _, n in pattern.reads]
        for _, off, n in pattern.reads:
            local[off:off + n] = 0
    started = time.perf_counter()
    try:
        case.run(expected)
    except Exception as exc:  # a failed transfer is a row that says so, not a crash of the whole bench
        case.errors.append(f"{type(exc).__name__}: {exc}")
        return float("inf")
    seconds = time.perf_counter() - started
    if pattern.kind == "push":
        ok = case.peer.digest(pattern.peer_ranges) == digest(source, pattern.peer_ranges)
    else:
        ok = [digest(local, [(off, n)]) for _, off, n in pattern.reads] == expected
    case.verified += ok
    if not ok:
        case.errors.append(f"run {run}: the destination does not hold the bytes sent")
    return seconds


def _row(pattern: Pattern, c: Case, runs: int) -> dict:
    seconds = statistics.median(c.seconds)
    ok = seconds != float("inf")
    return {"pattern": pattern.name, "kind": pattern.kind, "case": c.name, "integrity": c.integrity,
            "bytes": pattern.nbytes, "messages": pattern.messages, "runs": runs,
            "seconds": seconds if ok else None, "gib_s": pattern.nbytes / seconds / GIB if ok else None,
            "runs_checked": runs + 1, "runs_verified": c.verified,  # the warm-up run is checked too
            "intact": c.verified == runs + 1 and not c.errors,
            "errors": c.errors[:3]}
