"""`moonbus profile`: measure the deployed model's prefill and decode times and fit the predictors.

Prefill is timed over a grid of (input length, cached prefix length) through the same code the
prefill instance runs (a prefix's KV is loaded, the rest computed); decode step time over
(batch size, context). Every third point is held out of the fit and the error on it reported.
The conductor and the decode instances load the profile from $MOONBUS_HOME/profiles/<model>-<dtype>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from common import cores, models, profiles
from common.config import default_home
from common.decide.perf import DecodeModel, DecodeSample, PrefillModel, PrefillSample, Profile
from schemas.route import SamplingParams
from common.engine.batch import BatchEngine
from common.engine.layerwise import LayerwisePrefill
from common.engine.llama import Llama
from tools.moonbus.cluster import up


# NOTE: past 2048 tokens SmolLM2's prefill grows faster than the fit of a grid that stopped there
# (c2 came out 0): its 2,708-token chat prompts ran 1.23-1.40x their prediction live, where shorter
# prompts of 128-2047 tokens ran 0.85-1.06x (docs/benchmarks.md, 2026-12-07 late morning), and every request queued behind
# one was predicted that much early. Measured to 4096 (1.70 ms per token at 1024, 1.89 at 2048,
# 2.91 at 4096, float32 on 2 cores), the fit has c2 > 0 (held-out error 3%, max 7%). It adds about
# a minute to a first start here.
MAX_INPUT = 4096


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=models.SMOLLM2)
    parser.add_argument("--home", type=Path, default=default_home())
    parser.add_argument("--out", type=Path, help="default: $MOONBUS_HOME/profiles/<model>-<dtype>.json")
    parser.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                        help="as the workers run (auto: bfloat16 where the CPU has it)")
    parser.add_argument("--max-input", type=int, default=MAX_INPUT,
                        help="longest prompt measured (capped by the model's context)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = default), as the workers run")
    parser.add_argument("--prefill-threads", type=int, default=0,
                        help="torch threads while prefill is timed, as prefill instances run (0 = --threads)")
    parser.add_argument("--decode-threads", type=int, default=0,
                        help="torch threads while decode steps are timed, as decode instances run (0 = --threads)")
    parser.add_argument("--repeats", type=int, default=2, help="timings per point (the fastest is kept)")
    parser.add_argument("--quick", action="store_true", help="a small grid (what `moonbus up` runs the first time)")
    parser.add_argument("--json", action="store_true")


def prefill_grid(max_input: int, quick: bool) -> list[tuple[int, int]]:
    sizes = [n for n in (32, 128, 256, 512, 1024, 1536, 2048, 3072, 4096) if n <= max_input]
    if quick:
        sizes = sizes[::2] if len(sizes) > 4 else sizes
    return [(n, p) for n in sizes for p in (0, n // 4, n // 2, (3 * n) // 4) if n - p >= 1]


def decode_grid(max_context: int, quick: bool) -> list[tuple[int, int]]:
    batches = (1, 4, 8) if quick else (1, 2, 4, 8, 16, 32)
    contexts = [c for c in ((64, 256) if quick else (64, 256, 1024)) if c <= max_context]
    return [(b, c) for b in batches for c in contexts]


def random_ids(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def time_prefill(prefill: LayerwisePrefill, n: int, p: int, repeats: int, vocab: int) -> float:
    """The prefill instance's path: the prefix's KV loaded, the rest computed layer by layer."""
    ids = random_ids(n, vocab, n)
    prefix_kv = prefill.run(ids[: p + 1]).kv[:, :, :, :p] if p else None
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        prefill.run(ids, prefix_kv)
        best = min(best, time.perf_counter() - started)
    return best


def time_decode_step(prefill: LayerwisePrefill, model, batch: int, context: int, repeats: int, vocab: int) -> float:
    """One iteration of the decode instance's batch engine over `batch` requests of `context` tokens."""
    engine = BatchEngine(model, batch, batch * (context + repeats + 1))
    kv = prefill.run(random_ids(context, vocab, context)).kv
    for i in range(batch):
        engine.add(f"r{i}", kv, 5, SamplingParams(temperature=0, max_tokens=repeats + 2))
    engine.step()  # warm: the first step's pages and caches are a running instance's long since
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        engine.step()
        best = min(best, time.perf_counter() - started)
    return best


def run(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = {role: n or torch.get_num_threads() for role, n in (("prefill", args.prefill_threads),
                                                                  ("decode", args.decode_threads))}
    ref = models.prepare(args.model, args.home.resolve())
    shape = models.read_shape(ref)
    dtype = models.resolve_dtype(args.dtype)
    model = Llama.load(ref.path, dtype)  # as the workers load it
    prefill = LayerwisePrefill(model)
    max_input = min(args.max_input, shape.max_context - 1)
    prefill_samples, decode_samples = [], []
    torch.set_num_threads(threads["prefill"])
    for n, p in prefill_grid(max_input, args.quick):
        prefill_samples.append(PrefillSample(n, p, time_prefill(prefill, n, p, args.repeats, shape.vocab_size)))
        print(f"prefill n={n:5d} p={p:5d}  {prefill_samples[-1].seconds * 1000:9.2f} ms", file=sys.stderr, flush=True)
    torch.set_num_threads(threads["decode"])
    for b, c in decode_grid(shape.max_context // 2, args.quick):
        decode_samples.append(DecodeSample(b, b * c, time_decode_step(prefill, model, b, c, args.repeats, shape.vocab_size)))
        print(f"decode  batch={b:3d} context={b * c:6d}  {decode_samples[-1].seconds * 1000:9.2f} ms", file=sys.stderr, flush=True)
    prefill_fit = PrefillModel.fit(s for i, s in enumerate(prefill_samples) if i % 3 != 2)
    decode_fit = DecodeModel.fit(s for i, s in enumerate(decode_samples) if i % 3 != 2)
    prefill_err = prefill_fit.error_report(s for i, s in enumerate(prefill_samples) if i % 3 == 2)
    decode_err = decode_fit.error_report(s for i, s in enumerate(decode_samples) if i % 3 == 2)
    device = (f"cpu x{threads['prefill']} threads" if threads["prefill"] == threads["decode"]
              else f"cpu, prefill x{threads['prefill']} threads, decode x{threads['decode']}")
    profile = Profile(prefill_fit, decode_fit, model=ref.name, device=device,
                      kv_bytes_per_token=shape.kv_bytes_per_token(dtype),
                      meta={"source": "moonbus profile", "dtype": dtype, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                            "threads": threads, "engine": up.engine_key(),
                            "omp_wait": cores.wait_setting(os.environ),
                            "held_out_error": {"prefill": _err(prefill_err), "decode": _err(decode_err)}})
    out = args.out or profiles.profile_path(args.home.resolve(), ref.name, dtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    profiles.save(profile, out)
    summary = {"model": ref.name, "profile": str(out), "prefill_points": len(prefill_samples),
               "decode_points": len(decode_samples), "prefill_held_out_error": _err(prefill_err),
               "decode_held_out_error": _err(decode_err)}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"profile of {ref.name} written to {out}")
        print(f"  prefill: {len(prefill_samples)} points; held-out error mean {summary['prefill_held_out_error']['mean_rel']:.1%}, "
              f"max {summary['prefill_held_out_error']['max_rel']:.1%}")
        print(f"  decode:  {len(decode_samples)} points; held-out error mean {summary['decode_held_out_error']['mean_rel']:.1%}, "
              f"max {summary['decode_held_out_error']['max_rel']:.1%}")
    return 0


def _err(err) -> dict:
    return {"mean_rel": err.mean_rel, "max_rel": err.max_rel, "num_samples": err.num_samples}
