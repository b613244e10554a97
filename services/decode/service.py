"""The decode service: one process running the continuous batch (batch_loop.py) on a loaded model, wired to NATS."""

from __future__ import annotations

from functools import partial

from common import bus, health, metrics, models, profiles, runner
from common.cores import ComputeThread
from common.engine.batch import BatchEngine
from services.decode.batch_loop import DecodeService
from services.decode.config import DecodeConfig


async def serve(cfg: DecodeConfig, stop: runner.Stop) -> bool:
    if await models.prepare_for_service(cfg.model, cfg.home, stop) is None:  # may wait for model-init
        return True  # stopped while it waited
    compute = ComputeThread.start(cfg.threads)  # the model loads, the pool is made and the batch steps there
    worker_model = await compute.run(models.load_for_worker, cfg.model, cfg.home, cfg.threads, cfg.dtype, "decode")
    perf, source = profiles.load(cfg.home, cfg.model, cfg.profile, cfg.dtype)
    engine = await compute.run(partial(BatchEngine.for_memory, worker_model.model, cfg.max_batch, cfg.kv_cache_bytes,
                                       cores=worker_model.cores))
    nc = await bus.connect(cfg.nats_url, cfg.instance_id, cfg.nats_auth)
    tasks = runner.TaskGroup(stop)
    service = DecodeService(cfg, nc, engine, worker_model.eos_token_id,
                            worker_model.kv_layout(cfg.block_tokens), tasks, perf, compute=compute)
    await service.start(stop, worker_model.ref.name, source)
    tasks.spawn(bus.watchdog(nc), "broker-watchdog")
    tasks.spawn(health.beacon(cfg.health_file, nc, stop), "health", essential=False)
    metrics.serve(cfg.metrics_port, service.metrics.registry, cfg.metrics_host)
    await runner.serving(stop)
    if not tasks.failed:
        await service.drain(stop, cfg.drain_grace_s)
    else:
        await service.hand_back(f"decode instance {cfg.instance_id} failed")
    await service.leave()
    await tasks.cancel_all()
    compute.close()
    await bus.shutdown(nc)
    return not tasks.failed
