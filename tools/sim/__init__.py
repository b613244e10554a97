"""A discrete-event simulator of a moonbus cluster, driven by the live decision code.

The conductor's `decide` and `admit` and its load bookkeeping (`ClusterState`), the decode
instance's late check and KV reservations (`late_verdict`, `kv_reservation`, `has_room`), the
prefill instance's queue order and report (`FairOrder`, `queue_ends`) and its deadline check
(`ttft_deadline`, `late_start`), the KV pool (`TieredPool` and its eviction
policies, and `change_of`/`runs` for its events) and the cache index (`PrefixIndex`) are
imported, not copied: the simulation schedules, admits and evicts exactly as the live cluster would, and only
time (prefill, decode steps, transfers) comes from a performance model.

    from tools.sim import SimConfig, simulate
    outcome = simulate(rows, SimConfig(prefill=8, decode=8, policy="kvcache-centric"))
"""

from tools.sim.config import SimConfig, build_profile
from tools.sim.engine import SimOutcome, simulate

__all__ = ["SimConfig", "SimOutcome", "build_profile", "simulate"]
