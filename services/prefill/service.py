"""The prefill service: one process computing prompts (compute.py) on a loaded model, wired to NATS."""

from __future__ import annotations

from common import bus, health, metrics, models, runner
from common.cores import ComputeThread
from services.prefill.compute import PrefillService
from services.prefill.config import PrefillConfig


async def serve(cfg: PrefillConfig, stop: runner.Stop) -> bool:
    if await models.prepare_for_service(cfg.model, cfg.home, stop) is None:  # may wait for model-init
        return True  # stopped while it waited
    compute = ComputeThread.start(cfg.threads)  # the model loads and prompts are computed there
    loaded = await compute.run(models.load_for_worker, cfg.model, cfg.home, cfg.threads, cfg.dtype, "prefill")
    nc = await bus.connect(cfg.nats_url, cfg.instance_id, cfg.nats_auth)
    service = PrefillService(cfg, nc, loaded.model, loaded.eos_token_id, loaded.kv_layout(cfg.block_tokens),
                             cores=loaded.cores, compute=compute)
    tasks = runner.TaskGroup(stop)
    await service.start(tasks, stop, loaded.ref.name)
    tasks.spawn(bus.watchdog(nc), "broker-watchdog")
    tasks.spawn(health.beacon(cfg.health_file, nc, stop), "health", essential=False)
    metrics.serve(cfg.metrics_port, service.metrics.registry, cfg.metrics_host)
    await runner.serving(stop)
    if not tasks.failed:
        await service.drain(stop, cfg.drain_grace_s)
    else:
        await service.hand_back(f"prefill instance {cfg.instance_id} failed")
    await service.leave()
    await tasks.cancel_all()
    service.transports.close()
    compute.close()
    await bus.shutdown(nc)
    return not tasks.failed
