"""Simulation settings: cluster shape, policy, admission, model and hardware."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.decide.perf import HARDWARE_PRESETS, MODEL_PRESETS, Profile, analytic_profile
from common.decide.planner import PlannerSettings
from common.decide.admission import MODES
from common.decide.policy import POLICIES

# lower-cased alias -> preset name
MODEL_ALIASES = {name.lower(): name for name in MODEL_PRESETS}
GPU_ALIASES = {name.lower(): name for name in HARDWARE_PRESETS}
GPU_MEMORY_BYTES = {"8xA800": 8 * 80e9}  # HBM per node, for the decode KV capacity


@dataclass(frozen=True)
class SimConfig:
    """One simulated cluster. Capacities are in tokens, bandwidths in bytes per second.

    prefill/decode: disaggregated instances, one per node. coupled > 0 replaces both with that
    many instances that each prefill and decode (a prefill pauses the batch, as in vLLM).
    """

    prefill: int = 8
    decode: int = 8
    coupled: int = 0
    policy: str = "kvcache-centric"
    admission: str = "baseline"
    speed: float = 1.0
    seed: int = 0
    ttft_slo_s: float = 30.0
    tbt_slo_s: float = 0.1
    sim_max_tokens: int = 4096  # every request's max_tokens (its real length is the trace's, capped by max_output)
    dram_tokens: int = 3_000_000  # KV cache per prefill node (DRAM tier)
    eviction: str = "lru"
    block_tokens: int = 512  # one trace hash id
    kvcache_balancing_threshold: float = 1.25
    nic_bytes_s: float = 100e9
    h2d_bytes_s: float = 128e9
    layers: int = 80  # layer-wise streaming: only the last layer's KV trails the prefill
    decode_kv_tokens: int | None = None  # KV room per decode instance; None = unlimited
    max_output: int | None = None  # cap (or force, with force_output) every output length
    force_output: bool = False
    segment_steps: int = 64  # a decode batch re-evaluates its step time at least this often
    # how the simulated machine really runs against the profile the conductor predicts with:
    # every prefill and decode step takes profile * speed_factor * (1 + drift * simulated hours);
    # the conductor learns it (common/decide/learn.py) as the live one does
    speed_factor: float = 1.0
    drift: float = 0.0
    # autoscaling (tools/sim/autoscale.py): the planner (common/decide/planner.py) sets how many
    # instances of each role run, starting from prefill/decode; a new one serves startup_s after
    # it is asked for (and counts from then), a removed one drains
    autoscale: PlannerSettings | None = None
    startup_s: float = 60.0
    # stop once attainment (within both SLOs, rejections as misses) can no longer reach stop_goal
    # over the whole run, or with stop_window_s in every window of that many seconds of arrivals:
    # a search that only asks whether a goal is reached need not simulate the rest of a failing run
    stop_goal: float | None = None
    stop_window_s: float | None = None
    profile: Profile | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy {self.policy!r} is not one of {POLICIES}")
        if self.admission not in MODES:
            raise ValueError(f"admission {self.admission!r} is not one of {MODES}")
        if self.coupled < 0 or self.prefill < 0 or self.decode < 0:
            raise ValueError("instance counts must be >= 0")
        if self.coupled == 0 and (self.prefill == 0 or self.decode == 0):
            raise ValueError("need at least one prefill and one decode instance (or --coupled K)")
        if not self.speed > 0:
            raise ValueError("speed must be > 0")
        if self.dram_tokens < 0 or self.block_tokens <= 0 or self.segment_steps <= 0:
            raise ValueError("dram_tokens must be >= 0, block_tokens and segment_steps > 0")
        if not self.speed_factor > 0 or self.drift <= -1.0:
            raise ValueError("speed_factor must be > 0 and drift > -1")
        if self.max_output is not None and self.max_output < 1:
            raise ValueError("max_output must be >= 1")
        if self.autoscale is not None and self.coupled:
            raise ValueError("autoscaling drives disaggregated instances, not coupled ones")
        if self.startup_s < 0:
            raise ValueError("startup_s must be >= 0")


def build_profile(model: str = "llama3-70b", gpu: str = "8xa800", path: str | None = None) -> tuple[Profile, dict]:
    """The performance profile and the hardware facts the simulator needs beyond it.

    Returns (profile, extras) where extras may set layers, nic_bytes_s, h2d_bytes_s and
    decode_kv_tokens (presets only; a measured profile keeps the SimConfig defaults).
    """
    if path is not None:
        profile = Profile.load(path)
        extras = {"layers": int(profile.meta.get("layers", 1))}
        return profile, extras
    try:
        spec = MODEL_PRESETS[MODEL_ALIASES[model.lower()]]
        hw = HARDWARE_PRESETS[GPU_ALIASES[gpu.lower()]]
    except KeyError:
        raise ValueError(f"unknown preset {model!r} on {gpu!r}; models {sorted(MODEL_ALIASES)}, gpus {sorted(GPU_ALIASES)}") from None
    profile = analytic_profile(spec, hw)
    extras = {"layers": spec.layers, "nic_bytes_s": hw.nic_bytes_s, "h2d_bytes_s": hw.h2d_bytes_s}
    memory = GPU_MEMORY_BYTES.get(hw.name)
    if memory is not None:
        extras["decode_kv_tokens"] = int((memory - spec.weight_bytes) // spec.kv_bytes_per_token)
    return profile, extras
