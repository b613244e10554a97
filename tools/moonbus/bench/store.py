"""`moonbus bench store`: our two storage tiers against the plainest baseline, side by side.

    DRAM tier   DramSlab put (alloc a slot + copy in) / get (copy a slot out to a buffer)
      vs        numpy copy of the same bytes into / out of a preallocated buffer (memcpy)
    SSD tier    SsdStore put (checksum + one LMDB transaction) / get (LMDB read + verify checksum)
      vs        one file per block: write / read the same bytes in a temp dir

Same bytes, same block count, same fsync policy on both sides (none by default; --fsync makes
both fsync every block). Each measurement is the best of --repeats passes, after one warm-up
pass that faults the pages in. The block is a real KV block: SmolLM2-135M (30 layers, 3 KV heads,
head_dim 64) x --block-tokens tokens in float32. Reads hit the page cache on both SSD sides
(the data was just written): this compares software paths, not drives.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from typing import Callable

import numpy as np
import orjson

from common.kv.blocks import KvLayout, checksum
from common.kv.slab import DramSlab
from services.messenger.ssd import PutStatus, SsdStore, map_size_for


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--blocks", type=int, default=128, help="blocks per pass (default 128)")
    parser.add_argument("--block-tokens", type=int, default=16, help="tokens per block (default 16)")
    parser.add_argument("--repeats", type=int, default=3, help="passes per measurement, best kept")
    parser.add_argument("--dir", default=None, help="directory for the SSD side (default: system temp)")
    parser.add_argument("--shm-dir", default="/dev/shm", help="directory for the slab file")
    parser.add_argument("--fsync", action="store_true", help="fsync every block on both SSD sides")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    layout = KvLayout(num_layers=30, num_kv_heads=3, head_dim=64, block_tokens=args.block_tokens, dtype="float32")
    rng = np.random.default_rng(0)
    payloads = [rng.standard_normal(layout.block_nbytes // 4, dtype=np.float32).tobytes() for _ in range(args.blocks)]
    total = layout.block_nbytes * args.blocks
    rows = _bench_dram(payloads, layout, args) + _bench_ssd(payloads, layout, args)
    for row in rows:
        row["MBps"] = round(total / row.pop("seconds") / 1e6, 1)
    result = {
        "block_nbytes": layout.block_nbytes,
        "blocks": args.blocks,
        "layout": "SmolLM2-135M: 30 layers x 2 x 3 kv heads x %d tokens x 64 dims, float32" % args.block_tokens,
        "fsync": args.fsync,
        "results": _pair_up(rows),
    }
    if args.json:
        sys.stdout.write(orjson.dumps(result).decode() + "\n")
        return 0
    print(f"block {layout.block_nbytes} bytes ({result['layout']}), {args.blocks} blocks per pass, "
          f"best of {args.repeats}, fsync {'on' if args.fsync else 'off'} on both sides")
    print(f"{'tier':<5} {'op':<4} {'ours':<16} {'MB/s':>9}   {'baseline':<16} {'MB/s':>9}   {'ours/base':>9}")
    for r in result["results"]:
        print(f"{r['tier']:<5} {r['op']:<4} {r['ours']:<16} {r['ours_MBps']:>9.1f}   "
              f"{r['baseline']:<16} {r['baseline_MBps']:>9.1f}   {r['ratio']:>9.2f}")
    return 0


def summary(result: dict) -> list[dict]:
    """`make bench`'s rows of this target (tools/moonbus/bench/suite.py)."""
    return [{"row": f"{r['tier']} {r['op']}: {r['ours']} vs {r['baseline']}", "ours": f"{r['ours_MBps']:.0f} MB/s",
             "baseline": f"{r['baseline_MBps']:.0f} MB/s", "ratio": r["ratio"], "goal": None, "met": None}
            for r in result["results"]]


def _bench_dram(payloads: list[bytes], layout: KvLayout, args: argparse.Namespace) -> list[dict]:
    n = len(payloads)
    path = os.path.join(args.shm_dir, f"moonbus-bench-{os.getpid()}.slab")
    slab = DramSlab.create(path, n, layout.block_nbytes)
    plain = np.empty((n, layout.block_nbytes), dtype=np.uint8)  # the memcpy baseline's memory
    out = np.empty(layout.block_nbytes, dtype=np.uint8)
    sources = [np.frombuffer(p, dtype=np.uint8) for p in payloads]
    slots: list[int] = []

    def slab_put() -> None:
        for slot in slots:
            slab.free(slot)
        slots.clear()
        for p in payloads:
            slot = slab.alloc()
            slab.write(slot, p)
            slots.append(slot)

    def slab_get() -> None:
        for slot in slots:
            slab.read_into(slot, out)

    def memcpy_put() -> None:
        for i, src in enumerate(sources):
            np.copyto(plain[i], src)

    def memcpy_get() -> None:
        for i in range(n):
            np.copyto(out, plain[i])

    try:
        return [
            _row("dram", "put", "slab", slab_put, args.repeats),
            _row("dram", "put", "memcpy", memcpy_put, args.repeats),
            _row("dram", "get", "slab", slab_get, args.repeats),
            _row("dram", "get", "memcpy", memcpy_get, args.repeats),
        ]
    finally:
        slab.close()
        slab.unlink()


def _bench_ssd(payloads: list[bytes], layout: KvLayout, args: argparse.Namespace) -> list[dict]:
    root = tempfile.mkdtemp(prefix="moonbus-bench-", dir=args.dir)
    store = SsdStore(os.path.join(root, "lmdb"), map_size_for(len(payloads), layout.block_nbytes), sync=args.fsync)
    files_dir = os.path.join(root, "files")
    os.makedirs(files_dir)
    fsync = args.fsync

    def lmdb_put() -> None:
        for key, p in enumerate(payloads):
            if store.put(key, p, checksum(p)) is not PutStatus.OK:
                raise RuntimeError("LMDB map full during the benchmark")

    def lmdb_get() -> None:
        for key in range(len(payloads)):
            store.get(key)

    def file_put() -> None:
        for key, p in enumerate(payloads):
            with open(os.path.join(files_dir, str(key)), "wb") as f:
                f.write(p)
                if fsync:
                    f.flush()
                    os.fsync(f.fileno())

    def file_get() -> None:
        for key in range(len(payloads)):
            with open(os.path.join(files_dir, str(key)), "rb") as f:
                f.read()

    try:
        return [
            _row("ssd", "put", "lmdb", lmdb_put, args.repeats),
            _row("ssd", "put", "file-per-block", file_put, args.repeats),
            _row("ssd", "get", "lmdb", lmdb_get, args.repeats),
            _row("ssd", "get", "file-per-block", file_get, args.repeats),
        ]
    finally:
        store.close()
        shutil.rmtree(root, ignore_errors=True)


def _row(tier: str, op: str, name: str, fn: Callable[[], None], repeats: int) -> dict:
    fn()  # warm-up: fault pages in, create files, fill the LMDB free pages
    best = min(_timed(fn) for _ in range(max(1, repeats)))
    return {"tier": tier, "op": op, "name": name, "seconds": best}


def _timed(fn: Callable[[], None]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def _pair_up(rows: list[dict]) -> list[dict]:
    """Rows come as (ours, baseline) pairs; fold each pair into one comparison."""
    pairs = []
    for ours, base in zip(rows[::2], rows[1::2]):
        pairs.append({
            "tier": ours["tier"], "op": ours["op"],
            "ours": ours["name"], "ours_MBps": ours["MBps"],
            "baseline": base["name"], "baseline_MBps": base["MBps"],
            "ratio": round(ours["MBps"] / base["MBps"], 3) if base["MBps"] else None,
        })
    return pairs
