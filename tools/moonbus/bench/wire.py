"""`moonbus bench wire`: decode and encode time of the hottest wire messages, msgspec against the
hand-written codec it replaced and against the standard json module.

Messages, as a 16P+16D cluster sends them most often:
    WorkerInfo (decode)   a heartbeat with a DecodeReport of a 32-request batch (every 150 ms per
                          instance; every conductor and the cache index decode each one)
    WorkerInfo (prefill)  a heartbeat with a PrefillReport: 8 requests held, 4 coming to decode
    TokenChunk            one token (one per generated token, decoded by the gateway)
    RouteRequest          a 512-token prompt (gateway -> conductor, per request)
    RouteReply            conductor -> gateway
    PrefillTask           a 512-token prompt with a pull (conductor -> prefill)
    WriteFrame            one layer slice striped in 2 parts (6 pieces: 3 KV heads x K, V)

Decode = `Type.from_bytes(bytes)` with every check of the type (subject tokens, file names, sizes,
types); encode = `msg.to_bytes()`. Each time is the median of --rounds rounds of --number calls,
per call, in microseconds, the collector paused during a round (as timeit does).

Columns, each measured on the same messages by this same file:
    hand-written   the codec before msgspec (schemas/codec.py at --before, a git revision: its
                   `schemas` package is taken out of git into a temporary directory and this file
                   runs against it in a child process); left out, saying why, when git cannot
    msgspec        this tree's schemas
    json+checks    the standard json module, with this tree's checks: decode = json.loads, then
                   `Type.from_dict` (msgspec.convert: the same checks); encode = json.dumps of
                   `to_dict()`
Speed-ups: hand-written / msgspec (how many times faster msgspec is). `make bench`'s rows
(`summary`): msgspec's time over the hand-written codec's, per message and direction.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[3]
# NOTE: the last commit whose schemas/codec.py is the hand-written codec (the parent of the
# switch to msgspec): the "before" of every row
HAND_WRITTEN_CODEC = "d15ef6eea9ad03dcde6368825a989d4173c84da4"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--before", default=HAND_WRITTEN_CODEC,
                        help="git revision whose schemas/ is the hand-written codec ('' to leave it out)")
    parser.add_argument("--number", type=int, default=2000, help="calls per round")
    parser.add_argument("--rounds", type=int, default=7, help="rounds; the median is kept")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def messages() -> dict[str, Any]:
    """name -> one message of each kind, built through the constructors both codecs share."""
    from schemas.prefill import PrefillTask, PullSpec
    from schemas.route import RouteReply, RouteRequest, SamplingParams
    from schemas.tokens import TokenChunk
    from schemas.transfer import WriteFrame
    from schemas.workers import Coming, DecodeReport, Joined, Layout, PrefillReport, WorkerInfo

    layout = Layout(model="SmolLM2-135M-Instruct", block_tokens=16, prefill_chunk=2048, kv="30x2x3x64 float32")
    decode = DecodeReport(running=32, context_tokens=32 * 900, kv_used_tokens=40_000, kv_free_tokens=120_000,
                          predicted_tbt_s=0.0251, joined=[Joined(f"cmpl-{i:08x}-a0", 0.5 + i * 0.01, 800 + i) for i in range(32)])
    prefill = PrefillReport(queue_s=0.183, queued_tokens=2300, running_tokens=512,
                            held=[f"cmpl-{i:08x}-a0" for i in range(8)],
                            coming=[Coming(f"cmpl-{i:08x}-a0", f"decode-{i:02d}", 0.02 * i, 600) for i in range(4)])
    info = dict(node="node-07", model="SmolLM2-135M-Instruct", num_queued=3, num_running=32, incarnation="3f9a1c2b",
                layout=layout, sent_at=1_760_000_000.123, transport="tcp")
    prompt = [(i * 7919) % 49152 for i in range(512)]
    sampling = SamplingParams(temperature=0.0, top_p=1.0, max_tokens=128, seed=None, ignore_eos=False)
    pieces = [[i * 1_966_080, 16_384] for i in range(6)]
    return {
        "WorkerInfo (decode)": WorkerInfo(instance_id="decode-07", role="decode", decode=decode, **info),
        "WorkerInfo (prefill)": WorkerInfo(instance_id="prefill-07", role="prefill", prefill=prefill, **info),
        "TokenChunk": TokenChunk(request_id="cmpl-0badcafe-a0", index=17, token_ids=[4153], source="decode-07"),
        "RouteRequest": RouteRequest(request_id="cmpl-0badcafe", prompt_token_ids=prompt, sampling=sampling,
                                      reply_subject="moonbus.tokens.gateway-0", arrival_ts=1_760_000_000.5),
        "RouteReply": RouteReply(admitted=True, prefill_id="prefill-07", decode_id="decode-03"),
        "PrefillTask": PrefillTask(request_id="cmpl-0badcafe", prompt_token_ids=prompt, sampling=sampling,
                                    reply_subject="moonbus.tokens.gateway-0", decode_id="decode-03",
                                    decode_node="node-19", arrival_ts=1_760_000_000.5,
                                    pull=PullSpec(source_node="node-02", first_block=0, num_blocks=20),
                                    predicted_s=0.0412),
        "WriteFrame": WriteFrame(region="in-cmpl-0badcafe-a0", pieces=pieces, meta={"layer": 11, "start": 0, "tokens": 512},
                                  group="w-8c1f", parts=2, whole=pieces),
    }


def _per_call_us(fn: Callable[[], Any], number: int, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        gc.disable()
        try:
            t0 = time.perf_counter()
            for _ in range(number):
                fn()
            times.append(time.perf_counter() - t0)
        finally:
            gc.enable()
    return statistics.median(times) / number * 1e6


def measure(number: int, rounds: int) -> dict[str, dict[str, float]]:
    """name -> bytes and the codec's and json+checks' decode/encode microseconds, for the
    `schemas` package this process imports."""
    out = {}
    for name, msg in messages().items():
        kind, data = type(msg), msg.to_bytes()
        assert kind.from_bytes(data) == msg, f"{name}: does not round-trip"
        out[name] = {
            "bytes": len(data),
            "decode_us": _per_call_us(lambda: kind.from_bytes(data), number, rounds),
            "encode_us": _per_call_us(msg.to_bytes, number, rounds),
            "json_decode_us": _per_call_us(lambda: kind.from_dict(json.loads(data)), number, rounds),
            "json_encode_us": _per_call_us(lambda: json.dumps(msg.to_dict()).encode(), number, rounds),
        }
    return out


def measure_at(revision: str, number: int, rounds: int) -> tuple[dict | None, str]:
    """`measure` against the schemas package of a git revision, in a child process: (rows, why not)."""
    with tempfile.TemporaryDirectory(prefix="moonbus-bench-wire-") as tmp:
        try:
            archive = subprocess.run(["git", "-C", str(ROOT), "archive", revision, "schemas"],
                                     capture_output=True, check=True, timeout=60).stdout
            subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True, timeout=60)
        except (OSError, subprocess.SubprocessError) as exc:
            return None, f"no hand-written codec: git archive {revision} failed ({exc})"
        # NOTE: the child runs this file as a script, so `schemas` resolves to the extracted copy
        env = os.environ | {"PYTHONPATH": tmp}
        child = subprocess.run([sys.executable, __file__, "--measure", str(number), str(rounds)], cwd=tmp, env=env,
                               capture_output=True, text=True, timeout=600)
        if child.returncode != 0:
            return None, f"the hand-written codec's run failed: {child.stderr.strip()[-300:]}"
        return json.loads(child.stdout), ""


def run(args: argparse.Namespace) -> int:
    ours = measure(args.number, args.rounds)
    before, why = measure_at(args.before, args.number, args.rounds) if args.before else (None, "left out (--before '')")
    report = {"before": args.before, "before_note": why, "number": args.number, "rounds": args.rounds,
              "rows": [_row(name, ours[name], (before or {}).get(name)) for name in ours]}
    if args.json:
        print(json.dumps(report))
        return 0
    _print(report)
    return 0


def _row(name: str, ours: dict[str, float], before: dict[str, float] | None) -> dict[str, Any]:
    row = {"message": name, "bytes": ours["bytes"],
           "msgspec_decode_us": ours["decode_us"], "msgspec_encode_us": ours["encode_us"],
           "json_checks_decode_us": ours["json_decode_us"], "json_checks_encode_us": ours["json_encode_us"]}
    if before is not None:
        row |= {"hand_written_decode_us": before["decode_us"], "hand_written_encode_us": before["encode_us"],
                "decode_speedup": before["decode_us"] / ours["decode_us"],
                "encode_speedup": before["encode_us"] / ours["encode_us"]}
    return row


def summary(result: dict) -> list[dict]:
    """`make bench`'s rows of this target (tools/moonbus/bench/suite.py): msgspec over the
    hand-written codec (over json+checks when the hand-written one was left out)."""
    out = []
    for r in result["rows"]:
        for op in ("decode", "encode"):
            ours = r[f"msgspec_{op}_us"]
            baseline, name = ((r[f"hand_written_{op}_us"], "hand-written") if f"hand_written_{op}_us" in r
                              else (r[f"json_checks_{op}_us"], "json+checks"))
            out.append({"row": f"{r['message']} {op}: msgspec vs {name}", "ours": f"{ours:.2f} us",
                        "baseline": f"{baseline:.2f} us", "ratio": ours / baseline, "goal": None, "met": None})
    return out


def _print(report: dict[str, Any]) -> None:
    print(f"moonbus bench wire: per message, microseconds (median of {report['rounds']} rounds of "
          f"{report['number']:,} calls); decode with every check of the type")
    print(f"  hand-written: schemas/codec.py at {report['before']}" if not report["before_note"]
          else f"  {report['before_note']}")
    print()
    print(f"  {'message':<20} {'bytes':>6}   {'hand-written':>14}   {'msgspec':>13}   {'x faster':>11}   {'json+checks':>13}")
    print(f"  {'':<20} {'':>6}   {'decode encode':>14}   {'decode encode':>13}   {'dec    enc':>11}   {'decode encode':>13}")
    print("  " + "-" * 92)
    for r in report["rows"]:
        hand = (f"{r['hand_written_decode_us']:7.2f} {r['hand_written_encode_us']:6.2f}" if "decode_speedup" in r
                else f"{'-':>7} {'-':>6}")
        ratio = f"{r['decode_speedup']:5.1f} {r['encode_speedup']:5.1f}" if "decode_speedup" in r else f"{'-':>5} {'-':>5}"
        print(f"  {r['message']:<20} {r['bytes']:>6}   {hand:>14}   {r['msgspec_decode_us']:6.2f} {r['msgspec_encode_us']:6.2f}"
              f"   {ratio:>11}   {r['json_checks_decode_us']:6.2f} {r['json_checks_encode_us']:6.2f}")
    print("\n  x faster = hand-written / msgspec; json+checks = the standard json module, with msgspec's checks "
          "(msgspec.convert) on decode")


if __name__ == "__main__" and sys.argv[1:2] == ["--measure"]:  # the child of `measure_at`
    print(json.dumps(measure(int(sys.argv[2]), int(sys.argv[3]))))
