"""`moonbus cachesim`: replay a trace through the KV pool's own eviction code, with no model.

One node, one pool (`common.decide.pool.TieredPool`, DRAM capacity in blocks, no SSD unless
--ssd-capacity-blocks). For every request in arrival order:

    keys  = chained keys of its hash ids (one key per 512-token trace block)
    hits += number of LEADING keys held (stop at the first miss: a prefix cache is useless past it)
    put every key (held ones are touched, new ones inserted, evicting by --policy)

Block hit ratio = hits / all blocks. `inf` capacity = the number of distinct blocks in the trace,
so nothing is ever evicted. Several capacities give one row each (one replay per capacity).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, dataclass
from typing import Sequence

import orjson

from common.kv.blocks import block_keys_from_hash_ids
from common.decide.eviction import DEFAULT_POLICY, POLICIES
from common.decide.pool import NoRoom, TieredPool
from tools.moonbus.traces.rows import TRACE_BLOCK_TOKENS, add_trace_arguments, load_trace

INF = "inf"


@dataclass(frozen=True)
class SimResult:
    """The outcome of one replay at one capacity."""

    capacity_blocks: int | str  # an int, or "inf"
    policy: str
    num_requests: int
    num_blocks: int
    num_hits: int
    num_dram_hits: int
    num_ssd_hits: int

    @property
    def hit_ratio(self) -> float:
        return self.num_hits / self.num_blocks if self.num_blocks else 0.0


def simulate(
    requests: Sequence[Sequence[int]],
    capacity_blocks: int | str,
    policy: str = DEFAULT_POLICY,
    ssd_capacity_blocks: int = 0,
) -> SimResult:
    """Replay requests given as block-key lists through one `TieredPool`."""
    if capacity_blocks == INF:
        dram = max(1, len({key for keys in requests for key in keys}))
    else:
        dram = int(capacity_blocks)
    pool = TieredPool(dram, ssd_capacity_blocks, policy)
    num_blocks = num_dram = num_ssd = 0
    for keys in requests:
        found = pool.lookup_prefix(keys)
        num_blocks += len(keys)
        num_ssd += found.num_ssd
        num_dram += found.num_hits - found.num_ssd
        actions = pool.put((key, depth) for depth, key in enumerate(keys))
        if any(type(action) is NoRoom for action in actions):  # impossible here: nothing is pinned
            raise RuntimeError("pool reported NoRoom with no pinned blocks")
    return SimResult(capacity_blocks, policy, len(requests), num_blocks, num_dram + num_ssd, num_dram, num_ssd)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_trace_arguments(parser)
    parser.add_argument(
        "--capacity-blocks", nargs="+", required=True, type=_capacity, metavar="N|inf",
        help=f"DRAM capacity in trace blocks ({TRACE_BLOCK_TOKENS} tokens each); several values give a table",
    )
    parser.add_argument("--policy", choices=list(POLICIES), default=DEFAULT_POLICY, help="eviction policy")
    parser.add_argument("--ssd-capacity-blocks", type=int, default=0, metavar="N", help="SSD tier (default: none)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    rows = load_trace(args.trace, args.limit)
    requests = [block_keys_from_hash_ids(row.hash_ids) for row in rows]
    results = [simulate(requests, cap, args.policy, args.ssd_capacity_blocks) for cap in args.capacity_blocks]
    elapsed = time.perf_counter() - started
    if args.json:
        out = {
            "trace": str(args.trace),
            "rows": len(rows),
            "block_tokens": TRACE_BLOCK_TOKENS,
            "policy": args.policy,
            "ssd_capacity_blocks": args.ssd_capacity_blocks,
            "results": [asdict(r) | {"hit_ratio": round(r.hit_ratio, 6)} for r in results],
            "elapsed_s": round(elapsed, 3),
        }
        sys.stdout.write(orjson.dumps(out).decode() + "\n")
        return 0
    print(
        f"trace {args.trace}: {len(rows)} requests, {results[0].num_blocks if results else 0} blocks "
        f"of {TRACE_BLOCK_TOKENS} tokens; policy {args.policy}; one node, "
        + (f"SSD {args.ssd_capacity_blocks} blocks" if args.ssd_capacity_blocks else "no SSD")
    )
    ssd = args.ssd_capacity_blocks > 0
    header = f"{'capacity_blocks':>15}  {'hits':>9}  {'blocks':>9}  {'hit_ratio':>9}"
    print(header + (f"  {'dram_hits':>9}  {'ssd_hits':>9}" if ssd else ""))
    for r in results:
        line = f"{r.capacity_blocks!s:>15}  {r.num_hits:>9}  {r.num_blocks:>9}  {r.hit_ratio:>9.4f}"
        print(line + (f"  {r.num_dram_hits:>9}  {r.num_ssd_hits:>9}" if ssd else ""))
    print(f"({elapsed:.2f} s)")
    return 0


def _capacity(text: str) -> int | str:
    if text.lower() == INF:
        return INF
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"capacity must be a positive integer or 'inf', got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"capacity must be positive, got {value}")
    return value
