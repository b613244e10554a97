"""`moonbus replay`: send a trace to a live cluster through the OpenAI API and measure it.

Every row becomes a streaming POST /v1/completions at its timestamp / --speed, open loop (a slow
server does not slow the sender). The prompt is token ids built by tools.moonbus.traces.rows.prompt_token_ids:
hash id -> a fixed block of --tokens-per-block ids, so prompts share exactly the prefixes their
hash ids share (set the cluster's KV block size to the same B for the cache to line up).
`ignore_eos` makes the server produce exactly the (scaled) output length.

`--export FILE` writes the trace as it would be sent instead (Mooncake format: timestamps /
--speed, the scaled lengths, the hash ids each prompt uses), for another client to replay the
same load: aiperf reads it with `--custom-dataset-type mooncake_trace
--prompt-input-tokens-block-size B`, building its prompts from the hash ids as this command does
(shared ids, shared prefixes), with its own text.

Per request: status (ok / rejected_arrival = HTTP 429 at arrival / rejected_late = a 429 after
admission: an HTTP 429 whose message begins "rejected: " (its prefill or decode instance turned it
away before its first token) or a 429 event after the stream started / failed), TTFT, every
inter-token interval (a chunk carrying k tokens counts one interval then k-1 of zero), cached
tokens from usage. Writes results.jsonl and summary.json to --out, prints the summary
(tools.moonbus.traces.measures), and with --plot the PNGs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from pathlib import Path

import aiohttp
import orjson

from tools.moonbus.traces.measures import FAILED, OK, REJECTED_ARRIVAL, REJECTED_LATE, RequestResult, format_summary, summarize, tbt_of
from tools.moonbus.traces.rows import (TRACE_BLOCK_TOKENS, TraceRow, add_trace_arguments, load_trace, prompt_length,
                           prompt_token_ids)
from tools.moonbus.observe.cpu import MachineCpu


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_trace_arguments(parser)
    parser.add_argument("--url", help="gateway base URL, e.g. http://127.0.0.1:8000 (required unless --export)")
    parser.add_argument("--export", type=Path, default=None, metavar="FILE",
                        help="write the scaled trace (Mooncake format) instead of replaying it, for another client")
    parser.add_argument("--speed", type=float, default=1.0, help="divide trace timestamps by this")
    parser.add_argument("--tokens-per-block", type=int, default=16, metavar="B",
                        help="tokens per trace hash id (trace: 512); lengths scale by B/512")
    parser.add_argument("--max-output", type=int, default=None, metavar="N", help="cap output lengths at N tokens")
    parser.add_argument("--output-scale", type=float, default=None, metavar="F",
                        help="scale output lengths by F (default: B/512, like inputs)")
    parser.add_argument("--max-input", type=int, default=None, metavar="N", help="cut prompts to N tokens")
    parser.add_argument("--vocab-size", type=int, default=259, help="prompt ids are drawn from [3, vocab size)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the id -> token block map")
    parser.add_argument("--ttft-slo", type=float, default=10.0, metavar="S")
    parser.add_argument("--tbt-slo", type=float, default=1.0, metavar="S")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--out", type=Path, default=Path("replay-out"), metavar="DIR")
    parser.add_argument("--plot", action="store_true")
    parser.add_argument("--no-progress", action="store_true")


def output_tokens(row: TraceRow, args: argparse.Namespace) -> int:
    scale = args.output_scale if args.output_scale is not None else args.tokens_per_block / TRACE_BLOCK_TOKENS
    n = max(1, round(row.output_length * scale))
    return min(n, args.max_output) if args.max_output is not None else n


def scalings(args: argparse.Namespace, rows: int) -> list[str]:
    scale = args.output_scale if args.output_scale is not None else args.tokens_per_block / TRACE_BLOCK_TOKENS
    out = [f"{rows} trace rows" + (f" (--limit {args.limit})" if args.limit is not None else ""),
           f"time / {args.speed:g}",
           f"{args.tokens_per_block} tokens per hash id (trace: {TRACE_BLOCK_TOKENS}): input lengths x {args.tokens_per_block / TRACE_BLOCK_TOKENS:g}",
           f"output lengths x {scale:g}" + (f", capped at {args.max_output}" if args.max_output is not None else "")]
    if args.max_input is not None:
        out.append(f"prompts cut to {args.max_input} tokens")
    return out


async def send_one(session: aiohttp.ClientSession, url: str, model: str, index: int, prompt: list[int],
                   max_tokens: int, arrival_s: float, t0: float) -> RequestResult:
    """One streaming completion; times are relative to t0 (perf_counter at the run's start)."""
    r = RequestResult(index, FAILED, arrival_s, len(prompt))
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0, "return_token_ids": True, "stream_options": {"include_usage": True}}
    last = None
    intervals: list[float] = []
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            r.http_status, r.request_id = resp.status, resp.headers.get("X-Request-Id", "")
            if resp.status != 200:
                text = await resp.text()
                r.status = _rejection_stage(text) if resp.status == 429 else FAILED
                r.error = f"HTTP {resp.status}: {text[:200]}"
                return r
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:].strip()
                if payload == b"[DONE]":
                    if r.status != REJECTED_LATE and not r.error:
                        r.status = OK
                    break
                now = time.perf_counter() - t0
                event = json.loads(payload)
                if "error" in event:
                    err = event["error"]
                    code = err.get("code") if isinstance(err, dict) else None
                    r.status = REJECTED_LATE if code in (429, "429") else FAILED
                    r.error_code = int(code) if str(code).isdigit() else 0
                    r.error = str(err)[:200]
                    continue
                if event.get("usage"):
                    details = event["usage"].get("prompt_tokens_details") or {}
                    r.cached_tokens = int(details.get("cached_tokens") or 0)
                for choice in event.get("choices", []):
                    k = len(choice.get("token_ids") or [])
                    if k == 0:
                        continue
                    if last is None:
                        r.first_token_s = now
                        k -= 1
                    else:
                        intervals.append(now - last)
                        k -= 1
                    intervals.extend([0.0] * k)
                    r.output_tokens += len(choice["token_ids"])
                    last = now
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        r.status, r.error = FAILED, f"{type(exc).__name__}: {exc}"[:200]
    finally:
        r.end_s = time.perf_counter() - t0
    if r.first_token_s is not None:
        r.ttft_s = r.first_token_s - arrival_s
    r.intervals = [[x, 1] for x in intervals]
    r.tbt_s = tbt_of(intervals)
    return r


def _rejection_stage(body: str) -> str:
    """An HTTP 429's stage: late when an instance turned the admitted request away before its first
    token (the gateway's message then begins "rejected: "; the conductor's, "rejected at arrival: ";
    the gateway's own limits name neither), else at arrival."""
    try:
        message = orjson.loads(body)["error"]["message"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return REJECTED_ARRIVAL
    return REJECTED_LATE if isinstance(message, str) and message.startswith("rejected: ") else REJECTED_ARRIVAL


async def replay(rows: list[TraceRow], args: argparse.Namespace) -> list[RequestResult]:
    url = args.url.rstrip("/")
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        async with session.get(url + "/v1/models") as resp:
            model = (await resp.json())["data"][0]["id"]
        prompts = [prompt_token_ids(row, args.tokens_per_block, args.vocab_size, seed=args.seed, max_tokens=args.max_input)
                   for row in rows]
        base = rows[0].timestamp_ms if rows else 0
        bar = None
        if not args.no_progress:
            from tqdm import tqdm

            bar = tqdm(total=len(rows), unit="req", desc="replay")
        t0 = time.perf_counter()
        tasks = []
        for i, (row, prompt) in enumerate(zip(rows, prompts)):
            at = (row.timestamp_ms - base) / 1000.0 / args.speed
            delay = at - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(send_one(session, url, model, i, prompt, output_tokens(row, args), at, t0))
            if bar is not None:
                task.add_done_callback(lambda _t: bar.update(1))
            tasks.append(task)
        results = list(await asyncio.gather(*tasks))
        if bar is not None:
            bar.close()
    return results


def exported(rows: list[TraceRow], args: argparse.Namespace) -> list[dict]:
    """The rows as this command sends them, in the trace's own format: timestamps from the first
    row's, divided by --speed; the prompt's length and the hash ids it is built from; the output
    length asked for."""
    base = rows[0].timestamp_ms if rows else 0
    out = []
    for row in rows:
        length = prompt_length(row, args.tokens_per_block, args.max_input)
        out.append({"timestamp": round((row.timestamp_ms - base) / args.speed), "input_length": length,
                    "output_length": output_tokens(row, args),
                    "hash_ids": row.hash_ids[: -(-length // args.tokens_per_block)]})
    return out


def run(args: argparse.Namespace) -> int:
    rows = load_trace(args.trace, args.limit)
    if args.export is not None:
        with open(args.export, "wb") as f:
            for row in exported(rows, args):
                f.write(orjson.dumps(row) + b"\n")
        print(f"wrote {len(rows)} rows to {args.export} ({'; '.join(scalings(args, len(rows)))})")
        print(f"aiperf replays it with: --custom-dataset-type mooncake_trace --input-file {args.export} "
              f"--prompt-input-tokens-block-size {args.tokens_per_block} --fixed-schedule --streaming "
              f"--extra-inputs ignore_eos:true")
        return 0
    if not args.url:
        print("moonbus replay: give --url (the gateway to replay against) or --export FILE", file=sys.stderr)
        return 2
    cpu = MachineCpu()
    results = asyncio.run(replay(rows, args))
    summary = summarize(results, args.ttft_slo, args.tbt_slo)
    summary["machine_cpu"] = cpu.result()
    report = {"trace": str(args.trace), "url": args.url, "scalings": scalings(args, len(rows)), "summary": summary}
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "results.jsonl", "wb") as f:
        for r in results:
            f.write(orjson.dumps(r.to_json()) + b"\n")
    (args.out / "summary.json").write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    if args.plot:
        from tools.moonbus.traces.plots import plot_all

        plot_all(results, args.out, "replay", (args.ttft_slo, args.tbt_slo))
    print(f"replay {args.trace} -> {args.url}")
    print("scalings: " + "; ".join(report["scalings"]))
    print(format_summary(summary))
    m = summary["machine_cpu"]
    print(f"machine CPU during the run: {m['share']:.1%} of {m['cores']} cores ({m['busy_core_s']} core-seconds busy "
          f"over {m['wall_s']} s; every process on the machine counts)")
    print(f"results in {args.out}")
    return 0 if not math.isnan(summary["effective_capacity"]) else 1
