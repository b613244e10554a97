"""`moonbus bench engine`'s join section: what a request joining a running batch costs the batch.

The decode service reads a joining request's KV file into the blocks it will run in on a thread
(`BatchEngine.load_file`) while the batch steps, and joins it between two steps
(`BatchEngine.add`). Measured here on a batch of `rows` requests of `context` tokens, for each
joining length: the batch's wait (the add), the load on its thread, and one step alone against
one step while a load runs beside it (the two share the machine's cores and memory bandwidth).
"""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path

import torch

from common import kvfiles
from common.engine.batch import BatchEngine
from common.engine.llama import Llama
from schemas.route import SamplingParams

SAMPLING = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def bench(model: Llama, shm_dir: str, rows: int = 12, context: int = 1024, lengths: tuple[int, ...] = (512, 2048),
          repeats: int = 3) -> list[dict]:
    joins = len(lengths) * repeats
    engine = BatchEngine(model, rows + joins + 1, rows * (context + 64) + joins * (max(lengths) + SAMPLING.max_tokens))
    for i in range(rows):
        engine.add(f"r{i}", _kv(model, context, i), 100 + i, SAMPLING)
    engine.step()
    out = []
    with tempfile.TemporaryDirectory(dir=shm_dir, prefix="moonbus-bench-join-") as tmp:
        for n in lengths:
            waits, loads, alone, beside = [], [], [], []
            for r in range(repeats):
                kv = _kv(model, n, 1000 + r)
                handle = kvfiles.write(Path(tmp), "bench", f"out-join-{n}-{r}.kv", kv)
                alone.append(_timed(engine.step))
                loaded: dict = {}

                def load() -> None:
                    started = time.perf_counter()
                    loaded["row"] = engine.load_file(f"join-{n}-{r}", Path(tmp), handle, SAMPLING,
                                                     remove=True)  # as decode loads
                    loaded["s"] = time.perf_counter() - started

                thread = threading.Thread(target=load)
                thread.start()
                beside.append(_timed(engine.step))
                thread.join()
                loads.append(loaded["s"])
                waits.append(_timed(lambda: engine.add(f"join-{n}-{r}", loaded["row"], 5, SAMPLING)))
            out.append({"rows": rows, "context": context, "tokens": n, "kv_MB": round(kv.nbytes / 1e6, 1),
                        "join_wait_ms": 1e3 * min(waits),
                        "join_wait_max_ms": 1e3 * max(waits), "load_ms": 1e3 * min(loads),
                        "step_ms": 1e3 * min(alone), "step_beside_load_ms": 1e3 * min(beside)})
    return out


def _kv(model: Llama, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(model.num_layers, 2, model.num_kv_heads, n, model.head_dim, generator=g) * 0.1).to(model.dtype)


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def print_rows(rows: list[dict]) -> None:
    if not rows:
        return
    r0 = rows[0]
    print(f"\njoin: a request joining a running batch of {r0['rows']} rows of {r0['context']} tokens "
          f"(best of the runs; the load runs on its own thread)")
    print(f"{'tokens':>6} {'KV MB':>6} {'batch waits ms':>14} {'(max)':>7} {'load ms':>8} {'step ms':>8} "
          f"{'step beside a load ms':>22}")
    for r in rows:
        print(f"{r['tokens']:>6} {r['kv_MB']:>6} {r['join_wait_ms']:>14.2f} {r['join_wait_max_ms']:>7.2f} {r['load_ms']:>8.1f} "
              f"{r['step_ms']:>8.1f} {r['step_beside_load_ms']:>22.1f}")
