"""Cache index settings."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from common import config as common


@dataclass(frozen=True)
class CacheIndexConfig:
    nats_url: str
    nats_auth: common.NatsAuth  # this role's NATS credentials
    cluster_secret_file: str  # '' = no cluster secret
    instance_id: str
    home: Path
    log_level: str
    health_file: str  # kept fresh while ready (common/health.py); '' = none
    metrics_port: int  # Prometheus (common/metrics.py); 0 = off
    metrics_host: str
    heartbeat_interval_s: float
    node_timeout_s: float  # a node whose messenger stops sending heartbeats is dropped after this
    resync_timeout_s: float
    signing_key_file: str = ""  # this process's own key for signing its audit events ('' = none)

    def __post_init__(self) -> None:
        common.check_subject_token("instance id", self.instance_id)
        if min(self.heartbeat_interval_s, self.node_timeout_s, self.resync_timeout_s) <= 0:
            raise ValueError("intervals and timeouts must be > 0")


def load(argv: list[str] | None = None) -> CacheIndexConfig:
    parser = argparse.ArgumentParser(prog="python -m services.cache_index", description="moonbus cache index")
    common.add_common_flags(parser, "cache_index")
    common.flag(parser, "--heartbeat-interval", "MOONBUS_HEARTBEAT_INTERVAL", 1.0, float, help="seconds", dest="heartbeat_interval_s")
    common.flag(parser, "--node-timeout", "MOONBUS_NODE_TIMEOUT", 5.0, float, help="seconds", dest="node_timeout_s")
    common.flag(parser, "--resync-timeout", "MOONBUS_RESYNC_TIMEOUT", 10.0, float, help="seconds", dest="resync_timeout_s")
    args = parser.parse_args(argv)
    return common.build(CacheIndexConfig, args, instance_id=common.cache_index_id(args.instance_id), home=Path(args.home))
