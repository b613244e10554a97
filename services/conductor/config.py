"""Conductor settings."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from common import config as common


@dataclass(frozen=True)
class ConductorConfig:
    nats_url: str
    instance_id: str
    home: Path
    log_level: str
    heartbeat_timeout_s: float  # forget an instance after this long without heartbeats
    lease_s: float  # forget a dispatched request after this long without an end
    sweep_interval_s: float

    def __post_init__(self) -> None:
        common.check_subject_token("instance id", self.instance_id)
        if min(self.heartbeat_timeout_s, self.lease_s, self.sweep_interval_s) <= 0:
            raise ValueError("timeouts and intervals must be > 0")


def load(argv: list[str] | None = None) -> ConductorConfig:
    parser = argparse.ArgumentParser(prog="python -m services.conductor", description="moonbus conductor (global scheduler)")
    common.add_common_flags(parser, "conductor")
    common.flag(parser, "--heartbeat-timeout", "MOONBUS_HEARTBEAT_TIMEOUT", 3.0, float, help="seconds")
    common.flag(parser, "--lease", "MOONBUS_LEASE", 900.0, float, help="seconds a dispatched request may stay without an end")
    common.flag(parser, "--sweep-interval", "MOONBUS_SWEEP_INTERVAL", 0.5, float, help="seconds")
    args = parser.parse_args(argv)
    return ConductorConfig(
        nats_url=args.nats_url,
        instance_id=args.instance_id,
        home=Path(args.home),
        log_level=args.log_level,
        heartbeat_timeout_s=args.heartbeat_timeout,
        lease_s=args.lease,
        sweep_interval_s=args.sweep_interval,
    )
