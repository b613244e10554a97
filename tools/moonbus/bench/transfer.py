"""`moonbus bench transfer`: our point-to-point transport against a plain socket and Mooncake's, side by side.

throughput  the same bytes from this process to a receiving process over loopback, three ways
            (tools/moonbus/bench/transfer_peers.py): ours (common/transport over tcp: a
            registered region, `write` + a call that returns once the bytes landed verified),
            a plain blocking socket (sendall / recv_into a preallocated buffer, one byte back),
            and the Mooncake Transfer Engine in TCP mode (P2PHANDSHAKE, `transfer_sync_write`)
            when it is installed (`make bench-transfer` installs it). Sizes: one KV block,
            one --request-tokens request's KV (the model's KV layout), and 64 MiB.
handoff     the tail of the streamed handoff per prompt length (--tail-tokens): the last
            layer's slice written + the completion notice, through the service's own code
            (tools/moonbus/bench/transfer_tail.py), next to one decoder layer's compute time.

Every measurement is the median of at least --repeats runs (short transfers run until each case
had MIN_CASE_SECONDS), after one warm-up; the cases take turns within each run, so machine noise
hits them alike. Our rows are one per --streams value (connections per peer; ours_tcp is one,
ours_tcp_xN stripes each write of 4 MiB or more over N); the goals are judged on the first. After each size the receivers' checksums of what
they hold are compared with the source's: a row that did not arrive intact says so, and the
command exits 1. Goals (issue 10): ours >= 0.8x the plain socket and >= 1.0x Mooncake TE; the
tail one slice plus a constant, whatever the prompt's length.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import orjson
import xxhash

from common import models
from common.config import DEFAULT_BLOCK_TOKENS, default_home
from schemas.transfer import MAX_STRIPES
from tools.moonbus.bench.transfer_peers import MooncakePeer, OursPeer, RawSocketPeer, mooncake_missing
from tools.moonbus.bench.transfer_tail import layer_compute_seconds, measure_tail

GIB = 1 << 30
RAW_GOAL = 0.8  # ours / plain socket
MOONCAKE_GOAL = 1.0  # ours / Mooncake TE
# A short transfer's time is mostly scheduling noise on a small machine: each size is run until
# every case had about this much time (or MAX_RUNS), so that the median settles.
MIN_CASE_SECONDS = 0.5
MAX_RUNS = 400
_UNITS = {"k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=models.SMOLLM2, help="whose KV layout sizes the block and the request "
                                                                "(default SmolLM2-135M-Instruct; or tiny-random)")
    parser.add_argument("--home", default=str(default_home()), help="model cache directory")
    parser.add_argument("--sizes", default="block,request,64MiB",
                        help="transfer sizes: block, request, or bytes with an optional KiB/MiB/GiB suffix "
                             "(default block,request,64MiB)")
    parser.add_argument("--block-tokens", type=int, default=DEFAULT_BLOCK_TOKENS, help="tokens per KV block")
    parser.add_argument("--request-tokens", type=int, default=2048, help="the request whose KV is one size")
    parser.add_argument("--tail-tokens", default="1024,2048,4096,8192",
                        help="prompt lengths of the handoff tail rows ('' skips them)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="runs per measurement at least (short transfers run more, up to "
                             f"{MIN_CASE_SECONDS:g} s per case), median kept")
    parser.add_argument("--streams", default="1,2",
                        help="connections per peer of our tcp rows: a write of 4 MiB or more is striped over "
                             "them (--tcp-streams of the services; the first is the goals' row; default 1,2)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on the last line")


def parse_size(text: str, named: dict[str, int]) -> int:
    text = text.strip().lower()
    if text in named:
        return named[text]
    digits = text.rstrip("kmgib")
    unit = text[len(digits):]
    if not digits.isdigit() or (unit and unit not in _UNITS) or int(digits) <= 0:
        raise argparse.ArgumentTypeError(f"size {text!r} is not {', '.join(named)} or bytes[KiB|MiB|GiB]")
    return int(digits) * _UNITS.get(unit, 1)


def run(args: argparse.Namespace) -> int:
    ref = models.prepare(args.model, Path(args.home))
    shape = models.read_shape(ref)
    layout = shape.kv_layout(args.block_tokens)
    named = {"block": layout.block_nbytes, "request": args.request_tokens * layout.bytes_per_token}
    sizes = [parse_size(s, named) for s in args.sizes.split(",") if s.strip()]
    tail_tokens = [int(t) for t in args.tail_tokens.split(",") if t.strip()]
    if any(not 0 < t <= shape.max_context for t in tail_tokens):
        raise SystemExit(f"--tail-tokens must be within 1..{shape.max_context} ({ref.name}'s context)")
    repeats = max(1, args.repeats)
    secret = os.urandom(32)  # the cluster-secret handshake runs as in a cluster (once per connection)
    missing = mooncake_missing()
    streams = [int(n) for n in args.streams.split(",") if n.strip()]
    if not streams or any(not 1 <= n <= MAX_STRIPES for n in streams):
        raise SystemExit(f"--streams: connections per peer, each 1..{MAX_STRIPES}")
    rows = throughput_rows(sizes, repeats, secret, missing, streams) if sizes else []
    if tail_tokens:
        rows += tail_rows(ref, layout, tail_tokens, repeats, secret)
    result = {"model": ref.name, "layout": layout.signature, "bytes_per_token": layout.bytes_per_token,
              "block_tokens": layout.block_tokens, "request_tokens": args.request_tokens, "repeats": repeats,
              "cpus": os.cpu_count(), "mooncake": missing or "installed", "rows": rows,
              "goals": goals(rows, OursPeer.case_for(streams[0]))}
    if args.json:
        sys.stdout.write(orjson.dumps(result).decode() + "\n")
    else:
        print_report(result, named)
    return 0 if all(r["intact"] is not False for r in rows) else 1


# ---------------------------------------------------------------------------- throughput


def throughput_rows(sizes: list[int], repeats: int, secret: bytes, mooncake: str, streams: list[int]) -> list[dict]:
    capacity = max(sizes)
    source = np.random.default_rng(0).integers(0, 256, capacity, dtype=np.uint8)
    view = memoryview(source).cast("B")
    peers = []
    try:
        peers.extend(OursPeer(capacity, secret, n) for n in streams)
        peers.append(RawSocketPeer(capacity))
        if not mooncake:
            peers.append(MooncakePeer(capacity, source))
        rows = []
        for n in sizes:
            times = {p.case: [] for p in peers}
            slowest = 0.0
            for p in peers:
                started = time.perf_counter()
                p.send(view[:n])  # warm-up: connection, page faults, the kernel's buffers
                slowest = max(slowest, time.perf_counter() - started)
            runs = max(repeats, min(MAX_RUNS, int(MIN_CASE_SECONDS / max(slowest, 1e-6))))
            for _ in range(runs):
                for p in peers:
                    started = time.perf_counter()
                    p.send(view[:n])
                    times[p.case].append(time.perf_counter() - started)
            expected = xxhash.xxh3_64_intdigest(view[:n])
            for p in peers:
                seconds = statistics.median(times[p.case])
                rows.append({"case": p.case, "bytes": n, "seconds": seconds, "gib_s": n / seconds / GIB,
                             "runs": runs, "intact": p.digest(n) == expected})
            if mooncake:
                rows.append({"case": "mooncake_te", "bytes": n, "seconds": None, "gib_s": None, "intact": None,
                             "note": mooncake})
    finally:
        for p in peers:
            p.close()
    return _ratios(rows)


def _ratios(rows: list[dict]) -> list[dict]:
    """vs_raw_socket and vs_mooncake of every row: its GiB/s over theirs at the same size."""
    by = {(r["case"], r["bytes"]): r["gib_s"] for r in rows}
    for r in rows:
        for key, case in (("vs_raw_socket", "raw_socket"), ("vs_mooncake", "mooncake_te")):
            base = by.get((case, r["bytes"]))
            r[key] = r["gib_s"] / base if r["gib_s"] and base else None
    return rows


# ---------------------------------------------------------------------------- handoff tail


def tail_rows(ref: models.ModelRef, layout, tail_tokens: list[int], repeats: int, secret: bytes) -> list[dict]:
    rows = measure_tail(layout, tail_tokens, repeats, secret)
    model = models.load_model(ref)
    for r in rows:
        r["layer_compute_s"] = layer_compute_seconds(model, r["prompt_tokens"], repeats)
        r["vs_layer_compute"] = r["seconds"] / r["layer_compute_s"]
    return rows


def goals(rows: list[dict], case: str) -> dict:
    """The issue's goals, on the rows of `case` (ours as the services run it by default)."""
    ours = [r for r in rows if r["case"] == case]
    tail = [r for r in rows if r["case"] == "handoff_tail"]
    out = {
        "ours_vs_raw_socket_min": min((r["vs_raw_socket"] for r in ours if r["vs_raw_socket"]), default=None),
        "ours_vs_mooncake_min": min((r["vs_mooncake"] for r in ours if r["vs_mooncake"]), default=None),
    }
    out["raw_socket_met"] = None if out["ours_vs_raw_socket_min"] is None else out["ours_vs_raw_socket_min"] >= RAW_GOAL
    out["mooncake_met"] = None if out["ours_vs_mooncake_min"] is None else out["ours_vs_mooncake_min"] >= MOONCAKE_GOAL
    if tail:  # what is left once one slice's bytes are paid at ours' speed: should not grow with the prompt
        speed = max((r["gib_s"] for r in ours), default=0.0) * GIB
        out["tail_minus_slice_s"] = [r["seconds"] - r["bytes"] / speed if speed else None for r in tail]
    return out


def print_report(result: dict, named: dict[str, int]) -> None:
    labels = {v: k for k, v in named.items()}
    print(f"{result['model']}: KV {result['layout']}, {result['bytes_per_token']} bytes/token; "
          f"median of >= {result['repeats']} runs; {result['cpus']} cpus; loopback, one receiving process per case")
    thr = [r for r in result["rows"] if r["case"] != "handoff_tail"]
    if thr:
        print(f"\n{'case':<12} {'size':<9} {'bytes':>11} {'seconds':>9} {'GiB/s':>7} {'vs raw':>7} "
              f"{'vs TE':>6} {'intact':>6}")
        for r in thr:
            if r["seconds"] is None:
                print(f"{r['case']:<12} {labels.get(r['bytes'], ''):<9} {r['bytes']:>11}   {r['note']}")
                continue
            print(f"{r['case']:<12} {labels.get(r['bytes'], ''):<9} {r['bytes']:>11} {r['seconds']:>9.5f} "
                  f"{r['gib_s']:>7.2f} {_x(r['vs_raw_socket']):>7} {_x(r['vs_mooncake']):>6} {str(r['intact']):>6}")
    tail = [r for r in result["rows"] if r["case"] == "handoff_tail"]
    if tail:
        print("\nhandoff tail: last layer's slice written + the completion notice, vs one layer's compute")
        print(f"{'prompt tokens':>13} {'slice bytes':>12} {'tail ms':>9} {'(write ms)':>10} {'layer ms':>9} "
              f"{'tail/layer':>10} {'intact':>6}")
        for r in tail:
            print(f"{r['prompt_tokens']:>13} {r['bytes']:>12} {r['seconds'] * 1e3:>9.2f} {r['write_s'] * 1e3:>10.2f} "
                  f"{r['layer_compute_s'] * 1e3:>9.2f} {r['vs_layer_compute']:>10.3f} {str(r['intact']):>6}")
    g = result["goals"]
    print(f"\ngoals: ours >= {RAW_GOAL}x raw socket: {_met(g['raw_socket_met'], g['ours_vs_raw_socket_min'])}; "
          f"ours >= {MOONCAKE_GOAL}x Mooncake TE: {_met(g['mooncake_met'], g['ours_vs_mooncake_min'])}")


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}"


def _met(met: bool | None, worst: float | None) -> str:
    return "not measured" if met is None else f"{'met' if met else 'NOT met'} (worst size {worst:.2f}x)"
