"""Coupled instance: one process that prefills and decodes on ONE loaded model, like a vLLM instance.

It runs the unchanged PrefillService and DecodeService side by side on one node (its own
messenger), sharing the model and one asyncio.Lock held around every prefill forward and every
decode iteration. asyncio.Lock is FIFO, so a prefill that arrives waits for at most the current
decode step, then runs whole while the batch waits: a prefill pauses decode. Prefills queued at
once alternate with single decode steps (vLLM would prefill them back to back); there is no
chunked prefill unless --prefill-chunk splits the forward, and the lock is held for all chunks.

The request still takes the disaggregated path: prefill writes the KV into the node's shared
memory, the messenger's send to its own node returns the same file (no bytes move), and the
decode side reads it from there. The conductor keeps both halves on this node (--colocate).
"""

from __future__ import annotations

import asyncio
import logging
from functools import partial

from common import bus, health, metrics, models, profiles, runner
from common.cores import ComputeThread
from services.coupled.config import CoupledConfig
from common.engine.batch import BatchEngine
from services.decode.batch_loop import DecodeService
from services.prefill.compute import PrefillService

log = logging.getLogger(__name__)


async def serve(cfg: CoupledConfig, stop: runner.Stop) -> bool:
    pcfg, dcfg = cfg.prefill, cfg.decode
    if await models.prepare_for_service(pcfg.model, pcfg.home, stop) is None:  # may wait for model-init
        return True  # stopped while it waited
    compute = ComputeThread.start(pcfg.threads)  # one thread computes both halves' work, one at a time
    worker = await compute.run(models.load_for_worker, pcfg.model, pcfg.home, pcfg.threads, pcfg.dtype, "coupled")
    model, eos, ref = worker.model, worker.eos_token_id, worker.ref
    layout = worker.kv_layout(pcfg.block_tokens)
    perf, source = profiles.load(dcfg.home, dcfg.model, dcfg.profile, dcfg.dtype)
    nc = await bus.connect(pcfg.nats_url, cfg.instance_id, pcfg.nats_auth)
    tasks = runner.TaskGroup(stop)
    compute_lock = asyncio.Lock()  # a prefill forward and a decode iteration never overlap
    registry = metrics.registry()  # one process, one metrics port: both halves report into it
    prefill = PrefillService(pcfg, nc, model, eos, layout, compute_lock, registry, cores=worker.cores, compute=compute)
    engine = await compute.run(partial(BatchEngine.for_memory, model, dcfg.max_batch, dcfg.kv_cache_bytes,
                                       cores=worker.cores))
    decode = DecodeService(dcfg, nc, engine, eos, layout, tasks, perf, compute_lock, registry, compute=compute)
    await prefill.start(tasks, stop, ref.name)
    await decode.start(stop, ref.name, source)
    tasks.spawn(bus.watchdog(nc), "broker-watchdog")
    tasks.spawn(health.beacon(pcfg.health_file, nc, stop), "health", essential=False)
    metrics.serve(pcfg.metrics_port, registry, pcfg.metrics_host)
    log.info("coupled %s ready on node %s: %s and %s share the model", cfg.instance_id, pcfg.node,
             pcfg.instance_id, dcfg.instance_id)
    await runner.serving(stop)
    if not tasks.failed:  # the prefill side first: what it still finishes goes to decode sides
        await prefill.drain(stop, pcfg.drain_grace_s)
        await decode.drain(stop, dcfg.drain_grace_s)
    else:
        await prefill.hand_back(f"coupled instance {cfg.instance_id} failed")
        await decode.hand_back(f"coupled instance {cfg.instance_id} failed")
    await prefill.leave()
    await decode.leave()
    await tasks.cancel_all()
    compute.close()
    await bus.shutdown(nc)
    return not tasks.failed
