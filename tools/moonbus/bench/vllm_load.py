"""The load `moonbus bench vllm` puts on a server: every request through the replay client's own
`send_one` (tools/moonbus/traces/replay.py: a streaming /v1/completions, the prompt as token ids,
ignore_eos, greedy), so both servers see the same bytes.

warm-up   one short request, not counted (a first request may load what later ones reuse)
engine    prefill: --engine-repeats prompts of --prefill-tokens tokens, one at a time, max_tokens 1;
          decode: per batch size B, B short prompts sent at once, max_tokens --decode-tokens each
          (once per server: `run_plan(..., probes=False)` drives the trace alone)
trace     the trace's rows open loop at their timestamps / --speed, as `moonbus replay` sends them
          (a slow server does not slow the sender), each with its own max_tokens (the workload's:
          32 for the prefill-heavy one, the row's own output length for the chat one), with the
          servers' process trees' CPU metered

Every engine prompt is its own (seeded) and outside the trace prompts' ids, so no prefix cache
serves one from another.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import aiohttp

from tools.moonbus.traces.measures import RequestResult
from tools.moonbus.bench.vllm_servers import CpuMeter
from tools.moonbus.traces.replay import send_one

PROBE_IDS = (300, 30_000)  # engine prompts' token ids; the trace prompts' are below 259
METER_EVERY_S = 1.0


@dataclass(frozen=True)
class Plan:
    """What every server gets, the same for all."""

    trace_prompts: list[list[int]]
    arrivals_s: list[float]  # when each trace request is sent, from the run's start
    output_tokens: list[int]  # each trace request's max_tokens (ignore_eos: it gets that many)
    prefill_prompts: list[list[int]]
    decode_prompts: dict[int, list[list[int]]]  # batch size -> its prompts
    decode_tokens: int
    timeout_s: float

    def __post_init__(self) -> None:
        if not len(self.trace_prompts) == len(self.arrivals_s) == len(self.output_tokens):
            raise ValueError("one arrival and one output length per trace prompt")
        if min(self.output_tokens, default=1) < 1 or self.decode_tokens < 2:
            raise ValueError("output lengths must be >= 1 and decode_tokens >= 2 (a decode rate needs two tokens)")


def probe_prompt(tokens: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(*PROBE_IDS) for _ in range(tokens)]


def engine_prompts(prefill_tokens: int, repeats: int, batches: list[int], decode_prompt_tokens: int
                   ) -> tuple[list[list[int]], dict[int, list[list[int]]]]:
    prefill = [probe_prompt(prefill_tokens, 1_000 + i) for i in range(repeats)]
    decode = {b: [probe_prompt(decode_prompt_tokens, 10_000 * b + i) for i in range(b)] for b in batches}
    return prefill, decode


async def _model(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url + "/v1/models") as resp:
        return (await resp.json())["data"][0]["id"]


async def _one(session, url, model, prompt, max_tokens) -> RequestResult:
    t0 = time.perf_counter()
    return await send_one(session, url, model, 0, prompt, max_tokens, 0.0, t0)


async def _batch(session, url, model, prompts, max_tokens) -> list[RequestResult]:
    t0 = time.perf_counter()
    return list(await asyncio.gather(*(send_one(session, url, model, i, p, max_tokens, 0.0, t0)
                                       for i, p in enumerate(prompts))))


async def _trace(session, url, model, plan: Plan, meter: CpuMeter) -> tuple[list[RequestResult], float, float]:
    """(results, wall seconds, CPU seconds) of the trace, open loop."""
    async def poll():
        while True:
            await asyncio.sleep(METER_EVERY_S)
            meter.poll()

    poller = asyncio.create_task(poll())
    meter.start()
    t0 = time.perf_counter()
    tasks = []
    try:
        for i, (prompt, at, out) in enumerate(zip(plan.trace_prompts, plan.arrivals_s, plan.output_tokens)):
            delay = at - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send_one(session, url, model, i, prompt, out, at, t0)))
        results = list(await asyncio.gather(*tasks))
    finally:
        poller.cancel()
    wall = time.perf_counter() - t0
    return results, wall, meter.stop()


async def drive(url: str, plan: Plan, meter: CpuMeter, probes: bool = True) -> dict:
    """Warm-up, engine probes (unless `probes` is False), then the trace; the raw results of each."""
    timeout = aiohttp.ClientTimeout(total=plan.timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        model = await _model(session, url)
        warm = await _one(session, url, model, probe_prompt(16, 7), 4)
        prefill = [await _one(session, url, model, p, 1) for p in plan.prefill_prompts] if probes else []
        decode = {b: await _batch(session, url, model, prompts, plan.decode_tokens)
                  for b, prompts in plan.decode_prompts.items()} if probes else {}
        trace, wall, cpu = await _trace(session, url, model, plan, meter)
    return {"model": model, "warm_up": warm, "prefill": prefill, "decode": decode, "trace": trace,
            "wall_s": wall, "cpu_s": cpu}


def run_plan(url: str, plan: Plan, meter: CpuMeter, probes: bool = True) -> dict:
    return asyncio.run(drive(url, plan, meter, probes))
