"""The decode service's settings (flags and MOONBUS_* environment variables), loaded in one place."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from common import machine, models
from common.config import (ServiceConfig, add_common_flags, add_model_flags, add_node_flags, build,
                           check_subject_token, flag, shm_dir_for)

# A decode instance's KV pool, by default: a quarter of the machine's memory (vLLM's CPU backend
# takes a fixed 4 GiB by default; the rest stays for the weights, the node's pool, prefill)
KV_MEMORY_SHARE = 0.25
# --yield-tbt's and --yield-after's defaults: a decode instance steps at most every 250 ms (at the
# default TBT SLO) once a request waiting in a prefill queue beside it has used a fifth of its TTFT
# budget (6 s of 30). Measured (docs/benchmarks.md, 2026-12-06 evening): prefill-heavy, 95% within
# the SLOs at 2.01 req/s on 240 rows where no yield kept 89%; chat at half speed 255 output tok/s
# against 259 without. The first rule (any queue) cost the chat load 14% of its tokens/s.
YIELD_TBT = 0.25
YIELD_AFTER = 0.2


@dataclass(frozen=True, kw_only=True)
class DecodeConfig(ServiceConfig):
    node: str
    shm_dir: Path
    model: str
    block_tokens: int
    dtype: str  # bfloat16 or float32 (`--dtype auto` resolved to this machine's)
    threads: int
    heartbeat_interval_s: float
    drain_grace_s: float  # after SIGTERM: time to finish the work held before handing the rest back
    orphan_kv_s: float  # a KV file landed for us this long ago whose task never came is removed
    store_every_blocks: int  # a running request's new full blocks go to the node's pool this many at a time (0: at its end only)
    max_batch: int
    kv_cache_bytes: int  # the batch's KV pool, K and V of every layer in the KV dtype (`--kv-cache-bytes` resolved)
    tbt_slo_s: float  # a request whose KV arrives when the batch could not meet this is rejected (late)
    yield_tbt: float  # while a prefill queue on this machine calls for it, a step at most once per this share of tbt_slo_s
    yield_after: float  # ... which it does once a request in it has waited this share of its TTFT budget
    late_check: bool  # False with admission "none"
    profile: str

    def __post_init__(self) -> None:
        super().__post_init__()
        check_subject_token("node", self.node)
        if self.threads < 0:
            raise ValueError("threads must be >= 0 (0 = share the machine's cores with the workers computing)")
        if self.orphan_kv_s <= 0:
            raise ValueError("orphan KV age must be > 0")
        if self.store_every_blocks < 0:
            raise ValueError("store every blocks must be >= 0 (0 = store a request's KV at its end only)")
        if self.drain_grace_s < 0:
            raise ValueError("drain grace must be >= 0")
        if self.heartbeat_interval_s <= 0:
            raise ValueError("heartbeat interval must be > 0")
        if self.tbt_slo_s <= 0:
            raise ValueError("tbt slo must be > 0")
        if not 0 <= self.yield_tbt < 1:
            raise ValueError("yield tbt must be >= 0 and < 1 (a share of the TBT SLO; 0 = never yield)")
        if not 0 <= self.yield_after <= 1:
            raise ValueError("yield after must be within [0, 1] (a share of a waiting request's TTFT budget)")
        if self.kv_cache_bytes < 1:
            raise ValueError("kv cache bytes must be >= 1")
        if self.max_batch < 1:
            raise ValueError("max batch must be >= 1")


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Every flag but the common ones (services/coupled adds these and the prefill ones to one parser)."""
    add_node_flags(parser)
    add_model_flags(parser)
    flag(parser, "--threads", "MOONBUS_THREADS", 0, int,
                help="torch intra-op threads (0 = follow the work: each step takes this worker's share of the "
                     "machine's cores among the workers computing at that moment, common/cores.py)")
    flag(parser, "--heartbeat-interval", "MOONBUS_HEARTBEAT_INTERVAL", 0.15, float, dest="heartbeat_interval_s",
                help="seconds between heartbeats, each with this instance's load report")
    flag(parser, "--orphan-kv", "MOONBUS_ORPHAN_KV", 30.0, float, dest="orphan_kv_s",
                help="seconds after which a KV file landed for this instance, whose task never came, is removed")
    flag(parser, "--store-every-blocks", "MOONBUS_STORE_EVERY_BLOCKS", 4, int, dest="store_every_blocks",
                help="store a running request's KV in the node's pool each time this many new blocks are full, so "
                     "a request resumed after this instance is lost reloads them (0 = at its end only)")
    flag(parser, "--drain-grace", "MOONBUS_DRAIN_GRACE", 30.0, float, dest="drain_grace_s",
                help="seconds to finish held work after SIGTERM; what is left is resumed elsewhere")
    flag(parser, "--max-batch", "MOONBUS_MAX_BATCH", 64, int, help="most requests decoding at once")
    flag(parser, "--kv-cache-bytes", "MOONBUS_KV_CACHE_BYTES", 0, int, dest="kv_cache_bytes",
                help="bytes of KV the batch may hold, counting what each request may still generate (K and V of "
                     f"every layer, in the KV dtype; 0 = {KV_MEMORY_SHARE:.0%} of this machine's memory, or of its "
                     "cgroup's limit where lower, split over --kv-instances); allocated once, pages touched as "
                     "tokens are held")
    flag(parser, "--kv-instances", "MOONBUS_KV_INSTANCES", 1, int, dest="kv_instances",
                help="decode instances on this machine that share the default KV room (moonbus up passes the most "
                     "it may run); an explicit --kv-cache-bytes is this instance's own")
    flag(parser, "--tbt-slo", "MOONBUS_TBT_SLO", 1.0, float, help="seconds; checked when a request's KV arrives", dest="tbt_slo_s")
    flag(parser, "--yield-tbt", "MOONBUS_YIELD_TBT", YIELD_TBT, float, dest="yield_tbt",
                help="once a request waiting in a prefill queue on this machine has used --yield-after of its TTFT "
                     "budget there (cores shared: --threads 0), step at most once per this share of --tbt-slo, "
                     "leaving the cores to the prefill between steps (0: never yield; common/decide/yielding.py)")
    flag(parser, "--yield-after", "MOONBUS_YIELD_AFTER", YIELD_AFTER, float, dest="yield_after",
                help="the share of its TTFT budget a request waits in a prefill queue on this machine before the "
                     "decode instances beside it yield to it (with --yield-tbt above 0; 0: as soon as one waits)")
    flag(parser, "--admission", "MOONBUS_ADMISSION", "predictive", help="none turns the arrival check off")
    flag(parser, "--profile", "MOONBUS_PROFILE", "", help="performance profile file")


def from_args(args: argparse.Namespace) -> DecodeConfig:
    if args.kv_cache_bytes < 0:
        raise ValueError("--kv-cache-bytes must be >= 0 (0 = a share of the machine's memory)")
    if args.kv_instances < 1:
        raise ValueError("--kv-instances must be >= 1")
    return build(DecodeConfig, args, shm_dir=shm_dir_for(args.node, args.shm_dir), home=Path(args.home),
                        late_check=args.admission != "none", dtype=models.resolve_dtype(args.dtype),
                        kv_cache_bytes=args.kv_cache_bytes or default_kv_cache_bytes(args.kv_instances))


def default_kv_cache_bytes(instances: int = 1) -> int:
    """KV_MEMORY_SHARE of the memory this process may use, shared by `instances` decode instances
    on the machine (`moonbus up` passes --kv-instances: the most decode instances it may run)."""
    return int(machine.memory_bytes() * KV_MEMORY_SHARE) // max(1, instances)


def load(argv: list[str] | None = None) -> DecodeConfig:
    parser = argparse.ArgumentParser(prog="python -m services.decode", description="moonbus decode instance")
    add_common_flags(parser, "decode")
    add_flags(parser)
    return from_args(parser.parse_args(argv))
