"""`moonbus bench transfer`: our point-to-point transport against a plain socket and Mooncake's, side by side.

patterns    what the system sends (tools/moonbus/bench/transfer_patterns.py), each moved the same way
            by every case, from this process to a receiving process over loopback:
              size:block, size:request, size:64MiB   one write and a completion (--sizes)
              handoff:2048, handoff:8192              the streamed handoff of a request of that many
                                                      tokens: a write per layer slice, back to back,
                                                      then one completion (--handoff-tokens)
              pull:16, pull:64                        a pull of that many blocks in one read (--pull-blocks)
            with the KV geometry of --model (SmolLM2-135M: 30 layers, K and V, 3 kv heads, head_dim
            64; --dtype-bytes 2, bfloat16, by default; 4 for float32).
cases       ours (common/transport over tcp, one row per --streams value), the plain socket
            (transfer_socket.py) and the Mooncake Transfer Engine in TCP mode (a "not installed" row
            without it; --require-mooncake makes that an error), each with its integrity work said
            in its row: ours checks xxh3 at both ends (a pull: on arrival, as the messenger does),
            `socket_verified` and `mooncake_te_verified` do the same work, `socket` and
            `mooncake_te` none (transfer_peers.py). NOTE: ours without TLS also carries the link's
            keyed MAC on every frame (common/transport/tcp.py, the default), in place of a write's
            xxh3; the rows' integrity words are transfer_peers.py's.
link MAC    ours with the keyed MAC off (`ours_tcp_nomac`: Transports(link_mac=False), xxh3 per
            write only), measured in turn with the others, apart from the rows: the MAC's cost as
            ours_tcp's GiB/s over it, per pattern (--no-mac-cost skips it).
handoff     the tail of the streamed handoff per prompt length (--tail-tokens): the last layer's
tail        slice written + the completion notice, through the services' own code
            (transfer_tail.py), next to one decoder layer's compute time.

Every run's bytes are checked (transfer_patterns.py: stamped per run, compared after it); a row
whose bytes did not arrive says so and the command exits 1. Goals (transfer_report.py): ours >=
0.8x the verifying socket on the handoffs and pulls, one block's round trip within 2x of its.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import orjson

from common import models
from common.config import DEFAULT_BLOCK_TOKENS, default_home
from schemas.transfer import MAX_STRIPES
from tools.moonbus.bench import transfer_report
from tools.moonbus.bench.transfer_patterns import (MAX_RUNS, MIN_CASE_SECONDS, Pattern, handoff_pattern, make_buffer,
                                                   measure, pull_pattern, size_pattern)
from tools.moonbus.bench.transfer_peers import MooncakePeer, OursPeer, mooncake_missing
from tools.moonbus.bench.transfer_socket import DEFAULT_BUFFER, SocketPeer
from tools.moonbus.bench.transfer_tail import layer_compute_seconds, measure_tail
from tools.moonbus.cluster import certs

SEED = 0
DTYPES = {2: "bfloat16", 4: "float32"}  # bytes per element -> the KV layout's dtype
_UNITS = {"k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=models.SMOLLM2, help="whose KV geometry shapes the patterns "
                                                                "(default SmolLM2-135M-Instruct; or tiny-random)")
    parser.add_argument("--home", default=str(default_home()), help="model cache directory")
    parser.add_argument("--dtype-bytes", type=int, choices=sorted(DTYPES), default=2,
                        help="bytes per KV element: 2 (bfloat16, the default) or 4 (float32)")
    parser.add_argument("--sizes", default="block,request,64MiB",
                        help="single-write sizes: block, request, or bytes with an optional KiB/MiB/GiB suffix "
                             "(default block,request,64MiB; '' for none)")
    parser.add_argument("--block-tokens", type=int, default=DEFAULT_BLOCK_TOKENS, help="tokens per KV block")
    parser.add_argument("--request-tokens", type=int, default=2048, help="the request whose KV is one size")
    parser.add_argument("--handoff-tokens", default="2048,8192", help="streamed handoffs of these prompt lengths")
    parser.add_argument("--pull-blocks", default="16,64", help="pulls of this many blocks")
    parser.add_argument("--tail-tokens", default="1024,2048,4096,8192",
                        help="prompt lengths of the handoff tail rows ('' skips them)")
    parser.add_argument("--repeats", type=int, default=5, help="runs per measurement at least (short transfers run "
                                                               "more, until each case had --case-seconds), median kept")
    parser.add_argument("--case-seconds", type=float, default=MIN_CASE_SECONDS,
                        help=f"time each case gets per pattern at least, runs permitting (at most {MAX_RUNS})")
    parser.add_argument("--streams", default="1,2",
                        help="connections per peer of our tcp rows: a write of 4 MiB or more is striped over "
                             "them (--tcp-streams of the services; the first is the goals' row; default 1,2)")
    parser.add_argument("--tls", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure ours with TLS on the link (--link-cert; row ours_tcp_tls, its cost as a "
                             "ratio to ours_tcp)")
    parser.add_argument("--mac-cost", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure ours without the links' keyed MAC (ours_tcp_nomac) and print the MAC's "
                             "cost as a ratio to it")
    parser.add_argument("--socket-buffer", type=int, default=DEFAULT_BUFFER,
                        help="SO_SNDBUF/SO_RCVBUF of the plain socket at both ends, bytes (0: kernel autotuning)")
    parser.add_argument("--require-mooncake", action="store_true",
                        help="fail when the Mooncake Transfer Engine cannot be used (make bench)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on the last line")


def parse_size(text: str, named: dict[str, int]) -> tuple[str, int]:
    """(its name in the report, as written, and its bytes)."""
    name = text.strip()
    text = name.lower()
    if text in named:
        return text, named[text]
    digits = text.rstrip("kmgib")
    unit = text[len(digits):]
    if not digits.isdigit() or (unit and unit not in _UNITS) or int(digits) <= 0:
        raise argparse.ArgumentTypeError(f"size {text!r} is not {', '.join(named)} or bytes[KiB|MiB|GiB]")
    return name, int(digits) * _UNITS.get(unit, 1)


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def run(args: argparse.Namespace) -> int:
    missing = mooncake_missing()
    if missing and args.require_mooncake:
        print(f"moonbus bench transfer: the Mooncake Transfer Engine is required here and cannot be used: {missing}. "
              f"Install it with: .venv/bin/python -m pip install mooncake-transfer-engine-non-cuda==0.3.13.post1",
              file=sys.stderr)
        return 2
    ref = models.prepare(args.model, Path(args.home))
    shape = models.read_shape(ref)
    layout = shape.kv_layout(args.block_tokens, DTYPES[args.dtype_bytes])
    tokens = _ints(args.handoff_tokens) + _ints(args.tail_tokens)
    if any(not 0 < t <= shape.max_context for t in tokens):
        raise SystemExit(f"--handoff-tokens and --tail-tokens must be within 1..{shape.max_context} ({ref.name}'s context)")
    streams = _ints(args.streams)
    if not streams or any(not 1 <= n <= MAX_STRIPES for n in streams):
        raise SystemExit(f"--streams: connections per peer, each 1..{MAX_STRIPES}")
    named = {"block": layout.block_nbytes, "request": args.request_tokens * layout.bytes_per_token}
    patterns = [size_pattern(name, n, "round trip" if name == "block" else "")
                for name, n in (parse_size(s, named) for s in args.sizes.split(",") if s.strip())]
    patterns += [handoff_pattern(layout.request_shape(t), layout.itemsize) for t in _ints(args.handoff_tokens)]
    patterns += [pull_pattern(n, layout.block_nbytes, SEED) for n in _ints(args.pull_blocks)]
    repeats = max(1, args.repeats)
    secret = os.urandom(32)  # the cluster-secret handshake runs as in a cluster (once per connection)
    rows, buffers = throughput_rows(patterns, repeats, args.case_seconds, secret, missing, streams, args.socket_buffer,
                                    args.tls, args.mac_cost)
    nomac = [r for r in rows if r["case"] == NO_MAC]  # apart from the rows: their cases are the report's
    rows = [r for r in rows if r["case"] != NO_MAC]
    if _ints(args.tail_tokens):
        rows += tail_rows(ref, layout, _ints(args.tail_tokens), repeats, secret)
    ours = OursPeer.case_for(streams[0])
    result = {"model": ref.name, "layout": layout.signature, "bytes_per_token": layout.bytes_per_token,
              "block_tokens": layout.block_tokens, "request_tokens": args.request_tokens, "repeats": repeats,
              "case_seconds": args.case_seconds,
              "cpus": os.cpu_count(), "mooncake": missing or "installed", "socket_buffers": buffers,
              "patterns": {p.name: p.label for p in patterns}, "rows": rows,
              "goals": transfer_report.goals(rows, {p.name: p.goal for p in patterns}, ours)}
    result["goals"]["tail_minus_slice_s"] = _tail_minus_slice(rows, ours)
    if nomac:
        result["link_mac"] = mac_cost(rows, nomac)
    if args.json:
        sys.stdout.write(orjson.dumps(result).decode() + "\n")
    else:
        transfer_report.print_report(result)
        print_mac_cost(result.get("link_mac", []))
    return 0 if all(r["intact"] is not False for r in rows + nomac) else 1


def summary(result: dict) -> list[dict]:
    """`make bench`'s rows of this target (tools/moonbus/bench/suite.py)."""
    return transfer_report.summary(result)


# ---------------------------------------------------------------------------- throughput


def throughput_rows(patterns: list[Pattern], repeats: int, case_seconds: float, secret: bytes, mooncake: str,
                    streams: list[int], socket_buffer: int, tls: bool = False,
                    mac_cost: bool = False) -> tuple[list[dict], dict]:
    """Every pattern, every case; returns the rows and the socket buffers the kernel granted."""
    if not patterns:
        return [], {}
    capacity = _round8(max(p.peer_extent for p in patterns))
    source = make_buffer(capacity, SEED)
    local = np.zeros(_round8(max(p.local_extent for p in patterns)), np.uint8)
    runs_so_far = itertools.count(1)
    peers = []
    tls_dir = tempfile.TemporaryDirectory(prefix="moonbus-bench-link-ca-") if tls else None
    try:
        peers.extend(OursPeer(capacity, SEED, secret, n) for n in streams)
        if mac_cost:
            peers.append(NoMacPeer(capacity, SEED, secret))
        if tls_dir is not None:  # both ends' certificates issued here, before either process starts
            for name in ("sender", "receiver"):
                certs.ensure_cert(Path(tls_dir.name), name)
            peers.append(OursPeer(capacity, SEED, secret, 1, tls_dir.name))
        peers.append(SocketPeer(capacity, SEED, socket_buffer))
        if not mooncake:
            peers.append(MooncakePeer(capacity, SEED, source, local))
        rows = []
        for p in patterns:
            cases = [c for peer in peers for c in peer.cases(p, source, local)]
            rows += measure(p, cases, source, local, repeats, runs_so_far, case_seconds)
            if mooncake:  # both of its cases, each saying why it was not measured
                rows += [{"pattern": p.name, "kind": p.kind, "case": case, "integrity": None,
                          "bytes": p.nbytes, "messages": p.messages, "seconds": None, "gib_s": None,
                          "intact": None, "note": mooncake} for case in ("mooncake_te_verified", "mooncake_te")]
        buffers = next(peer.buffers for peer in peers if isinstance(peer, SocketPeer))
    finally:
        for peer in peers:
            peer.close()
        if tls_dir is not None:
            tls_dir.cleanup()
    return transfer_report.add_ratios(rows), buffers


def _round8(n: int) -> int:
    return max(8, -(-n // 8) * 8)


# ---------------------------------------------------------------------------- the link's MAC

NO_MAC = "ours_tcp_nomac"


class NoMacPeer(OursPeer):
    """ours_tcp with the links' keyed MAC off (Transports(link_mac=False): a write carries its xxh3
    only, nothing else is checked): the baseline of the MAC's cost. The receiver is ours_tcp's: a
    listener serves whichever the connecting side asks for."""

    def __init__(self, capacity: int, seed: int, secret: bytes) -> None:
        from common.transport import Transports

        super().__init__(capacity, seed, secret)
        self.channel.close()
        self.transports.close()
        self.name = NO_MAC
        self.transports = Transports("tcp", secret, link_mac=False)
        self.channel = self.transports.connect(self.ref.endpoints)

    def cases(self, pattern: Pattern, source: np.ndarray, local: np.ndarray) -> list:
        cases = super().cases(pattern, source, local)[:1]  # a pull's verified case only: as ours_tcp's
        for c in cases:
            c.integrity = "xxh3 both ends" if pattern.kind == "push" else "xxh3 on arrival"
        return cases


def mac_cost(rows: list[dict], nomac: list[dict]) -> list[dict]:
    """Per pattern: ours_tcp (the MAC on every frame) against ours_tcp_nomac, GiB/s and their ratio."""
    ours = {r["pattern"]: r for r in rows if r["case"] == OursPeer.case_for(1)}
    out = []
    for r in nomac:
        mine = ours.get(r["pattern"])
        if mine is None:
            continue
        ratio = mine["gib_s"] / r["gib_s"] if mine["gib_s"] and r["gib_s"] else None
        out.append({"pattern": r["pattern"], "bytes": r["bytes"], "messages": r["messages"],
                    "mac_gib_s": mine["gib_s"], "nomac_gib_s": r["gib_s"], "ratio": ratio,
                    "nomac_intact": r["intact"], "nomac_errors": r.get("errors", [])})
    return out


def print_mac_cost(cost: list[dict]) -> None:
    if not cost:
        return
    print(f"\nthe link's keyed MAC (the default without TLS): ours_tcp GiB/s over {NO_MAC}'s (xxh3 per write only), "
          f"the same pattern, measured in turn")
    print(f"  {'pattern':<13} {'bytes':>11} {'msgs':>4} {'MAC GiB/s':>10} {'none GiB/s':>10} {'ratio':>6}")
    for c in cost:
        if c["ratio"] is None:
            print(f"  {c['pattern']:<13} {c['bytes']:>11} {c['messages']:>4} not measured: "
                  f"{'; '.join(c['nomac_errors']) or 'no time'}")
            continue
        print(f"  {c['pattern']:<13} {c['bytes']:>11} {c['messages']:>4} {c['mac_gib_s']:>10.2f} "
              f"{c['nomac_gib_s']:>10.2f} {c['ratio']:>5.2f}x")


# ---------------------------------------------------------------------------- handoff tail


def _tail_minus_slice(rows: list[dict], ours: str) -> list[float | None]:
    """Each tail less one slice's bytes at ours' best speed: should not grow with the prompt (issue 10)."""
    speed = max((r["gib_s"] or 0.0 for r in rows if r["case"] == ours), default=0.0) * (1 << 30)
    return [r["seconds"] - r["bytes"] / speed if speed else None for r in rows if r["case"] == "handoff_tail"]


def tail_rows(ref: models.ModelRef, layout, tail_tokens: list[int], repeats: int, secret: bytes) -> list[dict]:
    rows = measure_tail(layout, tail_tokens, repeats, secret)
    model = models.load_model(ref, layout.dtype)  # the KV keeps the model's dtype: it computes in the KV's
    for r in rows:
        r["layer_compute_s"] = layer_compute_seconds(model, r["prompt_tokens"], repeats)
        r["vs_layer_compute"] = r["seconds"] / r["layer_compute_s"]
    return rows
