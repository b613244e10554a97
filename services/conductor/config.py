"""Conductor settings: routing policy, admission, predictions."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path

from common import models
from common.config import ServiceConfig, add_common_flags, add_model_flags, boolean, build, flag
from common.decide.admission import MODES, AdmissionSettings
from common.decide.planner import PlannerSettings
from common.decide.policy import POLICIES

PREFIX_INDEXES = ("local", "remote")  # where a route finds who holds its prefix


@dataclass(frozen=True, kw_only=True)
class ConductorConfig(ServiceConfig):
    model: str
    block_tokens: int
    dtype: str  # bfloat16 or float32 (`--dtype auto` resolved to this machine's)
    policy: str  # random | load-balancing | cache-aware | kvcache-centric
    kvcache_balancing_threshold: float
    link_bytes_s: float  # node-to-node KV bandwidth assumed by the transfer estimate
    colocate: bool  # coupled instances: decode on the prefill instance's node (PolicySettings.colocate)
    admission: AdmissionSettings
    profile: str  # explicit profile file ("" = $MOONBUS_HOME/profiles/<model>.json, else a guess)
    heartbeat_timeout_s: float  # forget an instance after this long without heartbeats
    lease_s: float  # forget a dispatched request after this long without an end
    sweep_interval_s: float
    # local: this conductor follows the KV events into its own copy of the prefix index (no bus
    # round trip per route; memory ~ the cache index's). remote: it asks the cache index per route
    # (one copy for many conductors)
    prefix_index: str
    index_timeout_s: float  # remote: no answer from the cache index in time: route as if nothing is cached
    index_node_timeout_s: float  # local: a node whose messenger stops sending heartbeats is dropped after this
    index_resync_timeout_s: float  # local: how long a messenger's snapshot may take
    pipeline_group: int  # >= 2: long prompts with no reuse are prefilled by this many instances in a pipeline
    prefill_chunk: int  # the prefill instances' chunk size (a pipeline stage computes whole chunks)
    events_replicas: int  # copies of the events stream on a NATS cluster (1 = a single server)
    # the planner loop (services/conductor/planner_loop.py): targets per role, published as
    # `planned` events for a driver; None = off
    planner: PlannerSettings | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if min(self.heartbeat_timeout_s, self.lease_s, self.sweep_interval_s, self.index_timeout_s,
               self.index_node_timeout_s, self.index_resync_timeout_s) <= 0:
            raise ValueError("timeouts and intervals must be > 0")
        if self.prefix_index not in PREFIX_INDEXES:
            raise ValueError(f"prefix index must be one of {', '.join(PREFIX_INDEXES)}; got {self.prefix_index!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {self.policy!r}")
        if not 1 <= self.events_replicas <= 5:
            raise ValueError(f"events replicas must be 1..5 (JetStream's limit); got {self.events_replicas}")


def load(argv: list[str] | None = None) -> ConductorConfig:
    parser = argparse.ArgumentParser(prog="python -m services.conductor", description="moonbus conductor (global scheduler)")
    add_common_flags(parser, "conductor")
    add_model_flags(parser)
    flag(parser, "--policy", "MOONBUS_POLICY", "kvcache-centric", help=", ".join(POLICIES))
    flag(parser, "--kvcache-balancing-threshold", "MOONBUS_KVCACHE_BALANCING_THRESHOLD", 1.25, float,
                help="pull a remote prefix only if it is this many times longer than the local one")
    flag(parser, "--link-bandwidth", "MOONBUS_LINK_BANDWIDTH", 1.0e9, float, help="bytes/s between nodes", dest="link_bytes_s")
    flag(parser, "--colocate", "MOONBUS_COLOCATE", False, boolean,
                help="decode each request on its prefill instance's node (coupled instances)", nargs="?", const=True)
    flag(parser, "--admission", "MOONBUS_ADMISSION", "predictive", help=", ".join(MODES))
    flag(parser, "--ttft-slo", "MOONBUS_TTFT_SLO", 30.0, float, help="seconds")
    flag(parser, "--tbt-slo", "MOONBUS_TBT_SLO", 1.0, float, help="seconds")
    flag(parser, "--profile", "MOONBUS_PROFILE", "", help="performance profile file")
    flag(parser, "--pipeline-group", "MOONBUS_PIPELINE_GROUP", 1, int,
                help="prefill instances sharing one long prompt (chunked pipeline parallelism; 1 = off)")
    flag(parser, "--prefill-chunk", "MOONBUS_PREFILL_CHUNK", 2048, int, help="must equal the prefill instances'")
    flag(parser, "--heartbeat-timeout", "MOONBUS_HEARTBEAT_TIMEOUT", 3.0, float, help="seconds", dest="heartbeat_timeout_s")
    flag(parser, "--lease", "MOONBUS_LEASE", 900.0, float, help="seconds a dispatched request may stay without an end", dest="lease_s")
    flag(parser, "--sweep-interval", "MOONBUS_SWEEP_INTERVAL", 0.5, float, help="seconds", dest="sweep_interval_s")
    flag(parser, "--prefix-index", "MOONBUS_PREFIX_INDEX", "local",
                help="local: keep an own copy of the prefix index, fed by the KV events (no round trip per "
                     "route); remote: ask the cache index per route (one copy, for many conductors)")
    flag(parser, "--index-timeout", "MOONBUS_INDEX_TIMEOUT", 0.5, float,
                help="seconds to wait for the cache index (remote)", dest="index_timeout_s")
    flag(parser, "--index-node-timeout", "MOONBUS_INDEX_NODE_TIMEOUT", 5.0, float,
                help="seconds without a messenger's heartbeat before its node leaves the local index",
                dest="index_node_timeout_s")
    flag(parser, "--index-resync-timeout", "MOONBUS_INDEX_RESYNC_TIMEOUT", 10.0, float,
                help="seconds a messenger's snapshot may take (local)", dest="index_resync_timeout_s")
    flag(parser, "--ttft-quantile", "MOONBUS_TTFT_QUANTILE", 0.9, float,
                help="predictive admission: the share of admitted requests whose first token should come within the "
                     "TTFT SLO; predicted TTFTs are judged times that quantile of actual / predicted, learned (0 = off)")
    flag(parser, "--events-replicas", "MOONBUS_EVENTS_REPLICAS", 1, int,
                help="replicas of the events stream when it is created (<= the NATS cluster's servers)")
    flag(parser, "--planner", "MOONBUS_PLANNER", False, boolean, nargs="?", const=True,
                help="decide how many prefill and decode instances the load needs and publish it as `planned` "
                     "events (moonbus.events.instance.planned.<id>) for a driver; on one conductor only")
    flag(parser, "--planner-interval", "MOONBUS_PLANNER_INTERVAL", 30.0, float, help="seconds between decisions")
    flag(parser, "--planner-prefill", "MOONBUS_PLANNER_PREFILL", "1:32", help="MIN:MAX prefill instances")
    flag(parser, "--planner-decode", "MOONBUS_PLANNER_DECODE", "1:32", help="MIN:MAX decode instances")
    flag(parser, "--planner-max-total", "MOONBUS_PLANNER_MAX_TOTAL", 0, int,
                help="cap on prefill + decode instances (0: the roles' maximums only)")
    flag(parser, "--planner-settings", "MOONBUS_PLANNER_SETTINGS", "",
                help="more of the planner's settings (common.decide.planner.PlannerSettings), as NAME=VALUE,... "
                     "(e.g. up_after=1,up_cooldown_s=10: a short test's, not a day's)")
    args = parser.parse_args(argv)
    admission = AdmissionSettings(mode=args.admission, ttft_slo_s=args.ttft_slo, tbt_slo_s=args.tbt_slo,
                                  ttft_quantile=args.ttft_quantile)
    return build(ConductorConfig, args, home=Path(args.home), admission=admission,
                        dtype=models.resolve_dtype(args.dtype), planner=planner_settings(args))


def planner_settings(args: argparse.Namespace) -> PlannerSettings | None:
    """--planner's settings, or None when it is off; bounds as MIN:MAX."""
    if not args.planner:
        return None
    try:
        (pmin, pmax), (dmin, dmax) = (tuple(int(n) for n in text.split(":")) for text in
                                      (args.planner_prefill, args.planner_decode))
        return PlannerSettings(min_prefill=pmin, max_prefill=pmax, min_decode=dmin, max_decode=dmax,
                               max_total=args.planner_max_total or None, interval_s=args.planner_interval,
                               **named_settings(args.planner_settings))
    except ValueError as exc:
        raise SystemExit(f"conductor: refusing to start: planner settings: {exc}") from None


def named_settings(text: str) -> dict[str, float | int]:
    """--planner-settings' NAME=VALUE,... as PlannerSettings fields, each of its field's type; the
    bounds, the total cap and the interval have flags of their own. Raises ValueError naming what is wrong."""
    fields = {f.name: f for f in dataclasses.fields(PlannerSettings)}
    own_flags = ("min_prefill", "max_prefill", "min_decode", "max_decode", "max_total", "interval_s")
    settings: dict[str, float | int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or name not in fields or name in own_flags:
            raise ValueError(f"--planner-settings: {item!r} is not NAME=VALUE of a setting of its own "
                             f"({', '.join(n for n in fields if n not in own_flags)})")
        settings[name] = int(value) if fields[name].type == "int" else float(value)
    return settings
