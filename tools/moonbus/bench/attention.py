"""`moonbus bench engine`'s attention section: decode attention over a batch's paged KV, each way
side by side in one run, against the memory floor of reading that KV once; and a whole decode
step against the floor of reading the weights and that KV once.

attention  one decode step's attention (every layer) for `batch` rows of `context` tokens each, in
           the model's shapes and dtype, every way the engine could run it:
             kernel   the C++ flash-decoding kernel over the paged pool (common/engine/kernels)
             padded   torch: the rows' blocks gathered into one padded tensor, masked matmuls
                      (the engine's fallback where no compiler built the kernel)
             sdpa     torch: the same padded tensor, one scaled_dot_product_attention with a mask
             flex     torch: flex_attention with a block mask over the padded tensor, under
                      torch.compile (dynamic=False: compiled once for these shapes)
             rows     torch: one scaled_dot_product_attention per row over its own tokens (the
                      engine's attention before the pool)
           against the floor: reading that KV once (a sum over the pool's bytes, the bandwidth
           this run measures).
step       one BatchEngine.step() at that batch and context (the kernel) against reading the
           weights and that KV once at that bandwidth.

Every way is timed best of `repeats`, the ways taking turns (tools/moonbus/bench/floors.best).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from common.engine.attention import SPAN_TOKENS, PagedAttention, resolve_backend
from common.engine.batch import BatchEngine
from common.engine.llama import Llama
from common.engine.paged import BLOCK, KvPool
from schemas.route import SamplingParams
from tools.moonbus.bench.floors import best, weight_bytes

STEP_FLOOR_GOAL = 1.5  # issue 36: a step at batch 32, 1,024 tokens each, within 1.5x of its memory floor


def bench(model: Llama, batch: int = 32, context: int = 1024, repeats: int = 3, ways: str = "") -> dict:
    """Per way: seconds for one step's attention over every layer; the floor; the step."""
    wanted = set(filter(None, ways.split(","))) or {"kernel", "padded", "sdpa", "flex", "rows"}
    layers, heads, kv_heads, dim = model.num_layers, model.num_heads, model.num_kv_heads, model.head_dim
    blocks = KvPool.blocks_for(context)
    pool = KvPool(layers, kv_heads, dim, batch * blocks, model.dtype)
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        pool.k.copy_(torch.randn(pool.k.shape, generator=g) * 0.5)
        pool.v.copy_(torch.randn(pool.v.shape, generator=g) * 0.5)
        tables = torch.arange(batch * blocks, dtype=torch.int32).view(batch, blocks)
        positions = torch.full((batch,), context - 1, dtype=torch.long)
        q = (torch.randn(batch, heads, dim, generator=g)).to(model.dtype)
        k = (torch.randn(batch, kv_heads, dim, generator=g)).to(model.dtype)
        v = (torch.randn(batch, kv_heads, dim, generator=g)).to(model.dtype)
    fns = {way: _way(way, model, pool, tables, positions, q, k, v) for way in
           ("kernel", "padded", "sdpa", "flex", "rows") if way in wanted}
    fns = {way: fn for way, fn in fns.items() if fn is not None}
    slab = torch.cat((pool.k.flatten(), pool.v.flatten()))
    kv_bytes = slab.numel() * slab.element_size()
    names = list(fns)
    with torch.inference_mode():
        times = best([fns[n] for n in names] + [lambda: slab.sum()], repeats)
    floor = times[-1]
    bandwidth = kv_bytes / floor
    out = {"batch": batch, "context": context, "dtype": str(model.dtype).removeprefix("torch."),
           "threads": torch.get_num_threads(), "kv_MB": kv_bytes / 1e6, "floor_s": floor,
           "bandwidth_GBps": bandwidth / 1e9, "ways": {n: t for n, t in zip(names, times)}}
    out["step"] = _step(model, batch, context, repeats, bandwidth, kv_bytes)
    return out


def _way(way: str, model: Llama, pool: KvPool, tables, positions, q, k, v):
    layers, scale = model.num_layers, model.scale
    if way in ("kernel", "padded", "rows"):
        try:
            cache = PagedAttention(pool, tables, positions, resolve_backend(way))
        except Exception:  # noqa: BLE001 - a kernel that cannot load here: its row says so
            return None
        attend = cache.attend_rows

        def run() -> None:
            for layer in range(layers):
                attend(q, k, v, layer, scale)
        return run
    width = int(positions.max()) // BLOCK + 1
    valid = torch.arange(width * BLOCK)[None, :] <= positions[:, None]  # [B, T]
    gathered = [PagedAttention(pool, tables, positions, "padded")._gathered(layer, width) for layer in range(layers)]
    if way == "sdpa":
        mask = valid[:, None, None, :]

        def run() -> None:
            for keys, values in gathered:
                F.scaled_dot_product_attention(q[:, :, None], keys, values, attn_mask=mask, scale=scale,
                                               enable_gqa=keys.shape[1] != q.shape[1])
        return run
    if way == "flex":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        lengths = positions + 1

        def visible(b, h, q_idx, kv_idx):
            return kv_idx < lengths[b]

        block_mask = create_block_mask(visible, B=q.shape[0], H=None, Q_LEN=1, KV_LEN=width * BLOCK, device="cpu")
        compiled = torch.compile(flex_attention, dynamic=False)
        qs = q[:, :, None].contiguous()

        def run() -> None:
            for keys, values in gathered:
                compiled(qs, keys.contiguous(), values.contiguous(), block_mask=block_mask, scale=scale,
                         enable_gqa=keys.shape[1] != q.shape[1])
        try:
            started = time.perf_counter()
            with torch.inference_mode():
                run()  # compiles
            run.compile_s = time.perf_counter() - started
        except Exception:  # noqa: BLE001 - flex attention cannot compile on this CPU/torch: its row says so
            return None
        return run
    raise ValueError(f"unknown way {way!r}")


def _step(model: Llama, batch: int, context: int, repeats: int, bandwidth: float, kv_bytes: int) -> dict:
    """One engine step at batch x context against reading the weights and that KV once."""
    greedy = SamplingParams(temperature=0.0, max_tokens=repeats + 4, ignore_eos=True)
    engine = BatchEngine(model, batch, batch * (context + repeats + 8))
    kv = (torch.randn(model.num_layers, 2, model.num_kv_heads, context, model.head_dim) * 0.5).to(model.dtype)
    for i in range(batch):
        engine.add(f"r{i}", kv, 5, greedy)
    [step_s] = best([engine.step], repeats)
    weights = weight_bytes(model)
    floor = (weights + kv_bytes) / bandwidth
    return {"seconds": step_s, "weights_MB": weights / 1e6, "floor_s": floor, "vs_floor": step_s / floor,
            "goal_met": step_s / floor <= STEP_FLOOR_GOAL, "span_tokens": SPAN_TOKENS, "attention": engine.attention}


def summary_rows(result: dict | None) -> list[dict]:
    if not result:
        return []
    rows = [{"row": f"decode attention, batch {result['batch']} x {result['context']} tokens ({result['dtype']}): "
                    f"{way} vs reading the KV once", "ours": f"{1e3 * s:.1f} ms", "baseline": f"{1e3 * result['floor_s']:.1f} ms",
             "ratio": s / result["floor_s"], "goal": None, "met": None} for way, s in result["ways"].items()]
    step = result["step"]
    rows.append({"row": f"decode step, batch {result['batch']} x {result['context']} tokens: vs reading the weights and "
                        f"KV once", "ours": f"{1e3 * step['seconds']:.1f} ms", "baseline": f"{1e3 * step['floor_s']:.1f} ms",
                 "ratio": step["vs_floor"], "goal": f"<= {STEP_FLOOR_GOAL}x", "met": step["goal_met"]})
    return rows


def print_rows(result: dict | None) -> None:
    if not result:
        return
    print(f"\nattention: one decode step's attention, every layer, batch {result['batch']} x {result['context']} "
          f"tokens, {result['dtype']}, {result['threads']} thread(s); KV {result['kv_MB']:.0f} MB read once in "
          f"{1e3 * result['floor_s']:.1f} ms ({result['bandwidth_GBps']:.1f} GB/s)")
    for way, s in sorted(result["ways"].items(), key=lambda kv: kv[1]):
        print(f"  {way:<8} {1e3 * s:>8.1f} ms  {s / result['floor_s']:>6.2f}x the floor")
    step = result["step"]
    print(f"  step     {1e3 * step['seconds']:>8.1f} ms  {step['vs_floor']:>6.2f}x reading the weights "
          f"({step['weights_MB']:.0f} MB) and the KV once ({1e3 * step['floor_s']:.1f} ms); goal <= {STEP_FLOOR_GOAL}x: "
          f"{'met' if step['goal_met'] else 'NOT met'}")
