"""`moonbus bench engine`: the decode and prefill engines against their baselines, side by side in one run.

decode   BatchEngine tokens/s (one forward per iteration for the whole batch) at batch 1, 8, 32
  vs     transformers `generate()` (greedy) over the same prompts as one batch, same process.
         Both sides are timed from the first generated token to the last (prefill excluded),
         every row produces --new-tokens tokens. Also shown: a per-request forward loop (one
         forward per request per iteration, what continuous batching replaces). Goal: ours >= 0.9
         of generate(). And: the same engine on the dense weights (`packed=False`, what it ran
         before `Llama.packed`), so each row also shows the packed weights' speed-up.
prefill  LayerwisePrefill with a FileSink in /dev/shm (each layer's KV written by a background
         thread while the next layer computes; timed until every layer is in the file)
  vs     compute-only prefill (the plain transformers forward; goal: ours <= 1.10x)
  and    store-after-compute (forward, then kv_from_cache + kvfiles.write: no overlap).
ttft     a long prompt chunked by --prefill-chunk, on one instance (all torch threads) vs
         `--pipeline-group 2` run as 2 worker threads with 1 torch thread each (chunk i on
         worker i mod 2, chunk i+1 layer l overlapping chunk i layer l+1). A one-instance row
         with 1 torch thread shows what each stage alone gets.
         SmolLM2 allows 8192 positions, tiny-random 4096; the default 4096 tokens keeps the run
         short on 2 cores (--ttft-tokens up to the model's context).

join     a request joining a running batch: the batch's wait for it, its KV load on a thread,
         and a step alone vs beside a load (tools/moonbus/bench/join.py).

attention  decode attention over a batch's paged KV every way the engine could run it (the C++
         kernel, padded matmuls, padded SDPA, flex attention under torch.compile, one SDPA per
         row) against reading that KV once; and a whole step against reading the weights and
         that KV once (tools/moonbus/bench/attention.py), in the workers' dtype.

floors   the engines against what the machine can do: a batch-1 decode step vs copying the
         weights once, a prefill vs its matmuls alone, both vs transformers' own path, per dtype
         (tools/moonbus/bench/floors.py).

Measurements of one section are interleaved (best of --repeats), so machine noise hits both
sides alike. NOTE: on a 2-core machine two workers cannot beat one instance that already uses
both cores; the pipeline row shows overlap only when each stage has cores of its own.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import orjson
import torch

from common import kvfiles, machine, models
from common.engine import reference
from common.config import default_home
from schemas.route import SamplingParams
from common.engine.batch import BatchEngine
from common.engine.llama import Llama
from common.engine.layerwise import FileSink, LayerwisePrefill, pipelined_prefill
from tools.moonbus.bench import attention, floors, join

GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
DECODE_GOAL = 0.9
PREFILL_GOAL = 1.10


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=models.SMOLLM2, help="SmolLM2-135M-Instruct (default) or tiny-random")
    parser.add_argument("--home", default=str(default_home()), help="model cache directory")
    parser.add_argument("--batches", default="1,8,32", help="decode batch sizes (default 1,8,32)")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="decode: prompt length per row")
    parser.add_argument("--new-tokens", type=int, default=16, help="decode: tokens generated per row")
    parser.add_argument("--prefill-tokens", type=int, default=512, help="prefill: prompt length")
    parser.add_argument("--ttft-tokens", type=int, default=4096, help="ttft: long prompt length")
    parser.add_argument("--prefill-chunk", type=int, default=1024, help="ttft: chunk tokens")
    parser.add_argument("--repeats", type=int, default=3, help="runs per measurement, best kept")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch default)")
    parser.add_argument("--shm-dir", default="/dev/shm", help="where the FileSink writes")
    parser.add_argument("--floor-tokens", type=int, default=1024, help="floors: the prefill's prompt length")
    parser.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                        help="attention and floors: the engines' dtype, as the workers run (auto: bfloat16 where the CPU has it)")
    parser.add_argument("--compare-float32", action="store_true",
                        help="floors: also run them in float32 (the bfloat16 speed-up), when the dtype is bfloat16")
    parser.add_argument("--attention-batch", type=int, default=32, help="attention: rows in the batch")
    parser.add_argument("--attention-context", type=int, default=1024, help="attention: each row's context tokens")
    parser.add_argument("--attention-ways", default="",
                        help="attention: which ways (default all: kernel,padded,sdpa,flex,rows)")
    parser.add_argument("--skip", default="",
                        help="comma-separated sections to skip: decode,prefill,ttft,join,attention,floors")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    ref = models.prepare(args.model, Path(args.home))
    model = models.load_model(ref)
    threads = torch.get_num_threads()
    max_context = model.config.max_position_embeddings
    if args.ttft_tokens > max_context:
        raise SystemExit(f"--ttft-tokens {args.ttft_tokens} exceeds {ref.name}'s context {max_context}")
    skip = set(filter(None, args.skip.split(",")))
    result = {"model": ref.name, "torch_threads": threads, "cpus": os.cpu_count(), "max_context": max_context,
              "machine": machine.describe(), "decode": [], "prefill": [], "ttft": [], "join": [], "attention": None,
              "floors": []}
    with torch.inference_mode():
        if "decode" not in skip:
            result["decode"] = [_bench_decode(model, b, args) for b in map(int, args.batches.split(","))]
        if "prefill" not in skip:
            result["prefill"] = _bench_prefill(model, args)
        if "ttft" not in skip:
            result["ttft"] = _bench_ttft(model, args, threads)
        if "join" not in skip:
            result["join"] = join.bench(Llama.from_hf(model), args.shm_dir, repeats=args.repeats)
    if "attention" not in skip:
        worker = Llama.load(ref.path, models.resolve_dtype(args.dtype))
        result["attention"] = attention.bench(worker, args.attention_batch, args.attention_context, args.repeats,
                                              args.attention_ways)
    if "floors" not in skip:
        dtype = models.resolve_dtype(args.dtype)
        dtypes = [dtype] + (["float32"] if args.compare_float32 and dtype != "float32" else [])
        result["floors"] = [floors.bench(ref, d, args.floor_tokens, args.repeats) for d in dtypes]
    if args.json:
        sys.stdout.write(orjson.dumps(result).decode() + "\n")
    else:
        _print(result, args)
    return 0


def summary(result: dict) -> list[dict]:
    """`make bench`'s rows of this target (tools/moonbus/bench/suite.py)."""
    rows = [{"row": f"decode, batch {r['batch']}: BatchEngine vs generate()", "ours": f"{r['ours_tps']:.0f} tok/s",
             "baseline": f"{r['generate_tps']:.0f} tok/s", "ratio": r["ratio"], "goal": f">= {DECODE_GOAL}x",
             "met": r["goal_met"]} for r in result["decode"]]
    rows += [{"row": f"decode, batch {r['batch']}: packed weights vs dense (speed-up)", "ours": f"{r['ours_tps']:.0f} tok/s",
              "baseline": f"{r['dense_tps']:.0f} tok/s", "ratio": r["ours_tps"] / r["dense_tps"], "goal": None,
              "met": None} for r in result["decode"]]
    base = next((r for r in result["prefill"] if r["case"].startswith("compute-only")), None)
    rows += [{"row": f"prefill {r['tokens']} tokens: {r['case']} vs compute-only", "ours": f"{r['seconds']:.3f} s",
              "baseline": f"{base['seconds']:.3f} s" if base else None, "ratio": r["vs_compute_only"],
              "goal": None if r["goal_met"] is None else f"<= {PREFILL_GOAL}x", "met": r["goal_met"]}
             for r in result["prefill"] if r is not base]
    first = result["ttft"][0] if result["ttft"] else None
    rows += [{"row": f"ttft {r['tokens']} tokens: {r['case']} vs {first['case']}", "ours": f"{r['ttft_s']:.2f} s",
              "baseline": f"{first['ttft_s']:.2f} s", "ratio": r["vs_one_instance"], "goal": None, "met": None}
             for r in result["ttft"][1:]]
    rows += [{"row": f"join {r['tokens']} tokens into a batch of {r['rows']}: the batch's wait vs one step",
              "ours": f"{r['join_wait_ms']:.2f} ms", "baseline": f"{r['step_ms']:.1f} ms",
              "ratio": r["join_wait_ms"] / r["step_ms"], "goal": None, "met": None} for r in result.get("join", [])]
    return rows + attention.summary_rows(result.get("attention")) + floors.summary_rows(result.get("floors", []))


# ---------------------------------------------------------------------------- decode


def _prompts(batch: int, n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(100, min(vocab, 30_000), (batch, n), generator=torch.Generator().manual_seed(seed))


class _FirstTokenClock:
    """A generate() streamer that notes when the first generated token comes out (the prompt comes first)."""

    def __init__(self) -> None:
        self.puts, self.first = 0, 0.0

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def _time_generate(model, prompts: torch.Tensor, new_tokens: int) -> float:
    clock = _FirstTokenClock()
    model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                   do_sample=False, streamer=clock, pad_token_id=model.config.pad_token_id or 0)
    return time.perf_counter() - clock.first


def _starts(model, prompts: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
    out = []
    for row in prompts.tolist():
        cache, logits = reference.prefill(model, row)
        out.append((reference.kv_from_cache(cache), int(torch.argmax(logits))))
    return out


def _time_batch(batch: BatchEngine, starts, new_tokens: int) -> tuple[float, float]:
    """(seconds from the first token to the last, seconds to add every row). Leaves `batch` empty.

    NOTE: the engine is reused across repeats, as a service keeps it: the first run grows its
    buffer, later runs add into a warm one (best of, so add ms/req is the warm figure).
    """
    t0 = time.perf_counter()
    for i, (kv, first) in enumerate(starts):
        batch.add(str(i), kv, first, GREEDY)
    t1 = time.perf_counter()
    for _ in range(new_tokens - 1):
        batch.step()
    elapsed = time.perf_counter() - t1
    for i in range(len(starts)):
        batch.remove(str(i))
    return elapsed, t1 - t0


def _time_loop(model, starts, new_tokens: int) -> float:
    caches = [(reference.cache_from_kv(kv), first) for kv, first in starts]
    t0 = time.perf_counter()
    for _ in range(new_tokens - 1):
        caches = [(c, int(torch.argmax(reference.decode_step(model, tok, c)))) for c, tok in caches]
    return time.perf_counter() - t0


def _bench_decode(model, batch: int, args: argparse.Namespace) -> dict:
    prompts = _prompts(batch, args.prompt_tokens, model.config.vocab_size)
    starts = _starts(model, prompts)
    tokens = batch * (args.new_tokens - 1)
    gen, ours, dense, add, loop = [], [], [], [], []
    llama = Llama.from_hf(model)
    room = batch * llama.max_context  # every row may run to the model's context
    engine_ = BatchEngine(llama, max_batch=batch, kv_budget_tokens=room)
    dense_ = BatchEngine(llama, max_batch=batch, kv_budget_tokens=room, packed=False)  # before Llama.packed
    for _ in range(args.repeats):
        gen.append(_time_generate(model, prompts, args.new_tokens))
        s, a = _time_batch(engine_, starts, args.new_tokens)
        ours.append(s)
        add.append(a)
        dense.append(_time_batch(dense_, starts, args.new_tokens)[0])
    loop.append(_time_loop(model, starts, args.new_tokens))
    row = {"batch": batch, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
           "ours_tps": tokens / min(ours), "generate_tps": tokens / min(gen), "loop_tps": tokens / min(loop),
           "dense_tps": tokens / min(dense), "add_ms_per_request": 1e3 * min(add) / batch}
    row["ratio"] = row["ours_tps"] / row["generate_tps"]
    row["goal_met"] = row["ratio"] >= DECODE_GOAL
    return row


# ---------------------------------------------------------------------------- prefill


def _bench_prefill(model, args: argparse.Namespace) -> list[dict]:
    ids = _prompts(1, args.prefill_tokens, model.config.vocab_size, seed=1)[0].tolist()
    shm = Path(args.shm_dir)
    layerwise = LayerwisePrefill(Llama.from_hf(model))
    shape = None

    def compute_only() -> None:
        reference.prefill(model, ids)

    def layerwise_only() -> None:
        layerwise.run(ids)

    def layerwise_store() -> None:
        nonlocal shape
        shape = shape or (model.config.num_hidden_layers, 2, layerwise.num_kv_heads, len(ids), layerwise.head_dim)
        sink = FileSink(shm / f"moonbus-bench-{os.getpid()}.kv", shape)
        layerwise.run(ids, sink=sink)
        (shm / sink.path.name).unlink()

    def store_after() -> None:
        cache, _ = reference.prefill(model, ids)
        handle = kvfiles.write(shm, "bench", f"moonbus-bench-{os.getpid()}-after.kv", reference.kv_from_cache(cache))
        kvfiles.remove(shm, handle)

    cases = {"compute-only (transformers forward)": compute_only, "layer-wise, no sink": layerwise_only,
             "layer-wise store (FileSink, overlapped)": layerwise_store, "store after compute": store_after}
    best = {name: float("inf") for name in cases}
    layerwise_store()  # warm-up: the first /dev/shm file faults its pages in
    for _ in range(args.repeats):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    base = best["compute-only (transformers forward)"]
    kv_mb = model.config.num_hidden_layers * 2 * layerwise.num_kv_heads * layerwise.head_dim * 4 * len(ids) / 1e6
    return [{"case": name, "tokens": len(ids), "kv_MB": round(kv_mb, 1), "seconds": s, "vs_compute_only": s / base,
             "goal_met": (s / base <= PREFILL_GOAL) if "overlapped" in name else None} for name, s in best.items()]


# ---------------------------------------------------------------------------- ttft


def _bench_ttft(model, args: argparse.Namespace, threads: int) -> list[dict]:
    ids = _prompts(1, args.ttft_tokens, model.config.vocab_size, seed=2)[0].tolist()
    chunked = LayerwisePrefill(Llama.from_hf(model), chunk_tokens=args.prefill_chunk)
    rows = []
    cases = [(1, threads, f"1 instance, {threads} thread(s)"), (2, 1, "pipeline-group 2, 1 thread each")]
    if threads > 1:
        cases.append((1, 1, "1 instance, 1 thread"))
    for group, per_worker, label in cases:
        torch.set_num_threads(per_worker)
        t0 = time.perf_counter()
        if group == 1:
            chunked.run(ids)
        else:
            pipelined_prefill(chunked, ids, group, threads_per_worker=per_worker)
        rows.append({"case": label, "group": group, "tokens": len(ids), "chunk": args.prefill_chunk,
                     "threads_per_instance": per_worker, "ttft_s": time.perf_counter() - t0})
        torch.set_num_threads(threads)
    for row in rows:
        row["vs_one_instance"] = row["ttft_s"] / rows[0]["ttft_s"]
    return rows


def _print(result: dict, args: argparse.Namespace) -> None:
    print(f"model {result['model']} (context {result['max_context']}), torch threads {result['torch_threads']}, "
          f"{result['cpus']} cpus, best of {args.repeats}")
    if result["decode"]:
        print(f"\ndecode: tokens/s over {args.new_tokens - 1} steps after the first token, prompt {args.prompt_tokens} tokens")
        print(f"{'batch':>5} {'ours':>9} {'generate':>9} {'ratio':>6} {'goal>=0.9':>9} {'per-request':>11} "
              f"{'add ms/req (warm)':>17} {'dense':>9} {'packed/dense':>12}")
        for r in result["decode"]:
            print(f"{r['batch']:>5} {r['ours_tps']:>9.1f} {r['generate_tps']:>9.1f} {r['ratio']:>6.2f} "
                  f"{str(r['goal_met']):>9} {r['loop_tps']:>11.1f} {r['add_ms_per_request']:>17.2f} "
                  f"{r['dense_tps']:>9.1f} {r['ours_tps'] / r['dense_tps']:>12.2f}")
    if result["prefill"]:
        r0 = result["prefill"][0]
        print(f"\nprefill: {r0['tokens']} tokens, KV {r0['kv_MB']} MB")
        print(f"{'case':<42} {'seconds':>8} {'x compute-only':>14} {'goal<=1.10':>10}")
        for r in result["prefill"]:
            goal = "" if r["goal_met"] is None else str(r["goal_met"])
            print(f"{r['case']:<42} {r['seconds']:>8.3f} {r['vs_compute_only']:>14.3f} {goal:>10}")
    if result["ttft"]:
        r0 = result["ttft"][0]
        print(f"\nttft: {r0['tokens']}-token prompt, chunks of {r0['chunk']} (one run each)")
        print(f"{'case':<36} {'ttft s':>8} {'x one instance':>14}")
        for r in result["ttft"]:
            print(f"{r['case']:<36} {r['ttft_s']:>8.2f} {r['vs_one_instance']:>14.2f}")
    join.print_rows(result["join"])
    attention.print_rows(result["attention"])
    if result["floors"]:
        print("\nfloors: the engines against this machine's best (tools/moonbus/bench/floors.py)")
        for row in floors.summary_rows(result["floors"]):
            met = "" if row["met"] is None else f"  goal {row['goal']}: {'met' if row['met'] else 'NOT met'}"
            print(f"  {row['row']:<78} {row['ours']:>10} vs {row['baseline']:>10}  {row['ratio']:.2f}x{met}")
