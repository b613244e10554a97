"""A discrete-event simulator of a moonbus cluster, driven by the live decision code.

The conductor's `decide` and `admit`, the decode instance's `decode_admits`, the KV pool
(`TieredPool` and its eviction policies) and the cache index (`PrefixIndex`) are imported, not
copied: the simulation schedules, admits and evicts exactly as the live cluster would, and only
time (prefill, decode steps, transfers) comes from a performance model.

    from tools.sim import SimConfig, simulate
    outcome = simulate(rows, SimConfig(prefill=8, decode=8, policy="kvcache-centric"))
"""

from tools.sim.config import SimConfig, build_profile
from tools.sim.engine import SimOutcome, simulate

__all__ = ["SimConfig", "SimOutcome", "build_profile", "simulate"]
