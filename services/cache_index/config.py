"""Cache index settings."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from common.config import ServiceConfig, add_common_flags, build, cache_index_id, flag


@dataclass(frozen=True, kw_only=True)
class CacheIndexConfig(ServiceConfig):
    heartbeat_interval_s: float
    node_timeout_s: float  # a node whose messenger stops sending heartbeats is dropped after this
    resync_timeout_s: float

    def __post_init__(self) -> None:
        super().__post_init__()
        if min(self.heartbeat_interval_s, self.node_timeout_s, self.resync_timeout_s) <= 0:
            raise ValueError("intervals and timeouts must be > 0")


def load(argv: list[str] | None = None) -> CacheIndexConfig:
    parser = argparse.ArgumentParser(prog="python -m services.cache_index", description="moonbus cache index")
    add_common_flags(parser, "cache_index")
    flag(parser, "--heartbeat-interval", "MOONBUS_HEARTBEAT_INTERVAL", 1.0, float, help="seconds", dest="heartbeat_interval_s")
    flag(parser, "--node-timeout", "MOONBUS_NODE_TIMEOUT", 5.0, float, help="seconds", dest="node_timeout_s")
    flag(parser, "--resync-timeout", "MOONBUS_RESYNC_TIMEOUT", 10.0, float, help="seconds", dest="resync_timeout_s")
    args = parser.parse_args(argv)
    return build(CacheIndexConfig, args, instance_id=cache_index_id(args.instance_id), home=Path(args.home))
