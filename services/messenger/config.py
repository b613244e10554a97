"""Messenger settings: one messenger per node owns the node's KV pool and its transfer link."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from common import config as common


@dataclass(frozen=True)
class MessengerConfig:
    nats_url: str
    instance_id: str
    node: str
    shm_dir: Path
    home: Path
    log_level: str
    transfer_host: str  # where the point-to-point link listens
    transfer_port: int  # 0 = any free port
    advertise_host: str  # how other nodes reach this one
    heartbeat_interval_s: float
    peer_timeout_s: float  # forget a peer messenger after this long without heartbeats
    connect_timeout_s: float

    def __post_init__(self) -> None:
        common.check_subject_token("instance id", self.instance_id)
        common.check_subject_token("node", self.node)
        if not 0 <= self.transfer_port < 65536:
            raise ValueError(f"transfer port {self.transfer_port} out of range")
        if min(self.heartbeat_interval_s, self.peer_timeout_s, self.connect_timeout_s) <= 0:
            raise ValueError("intervals and timeouts must be > 0")

    @property
    def transfer_addr_host(self) -> str:
        return self.advertise_host or self.transfer_host


def load(argv: list[str] | None = None) -> MessengerConfig:
    parser = argparse.ArgumentParser(prog="python -m services.messenger", description="moonbus messenger (one per node)")
    common.add_common_flags(parser, "messenger")
    common.add_node_flags(parser)
    common.flag(parser, "--transfer-host", "MOONBUS_TRANSFER_HOST", "127.0.0.1", help="bind address of the KV link")
    common.flag(parser, "--transfer-port", "MOONBUS_TRANSFER_PORT", 0, int, help="port of the KV link (0 = free port)")
    common.flag(parser, "--advertise-host", "MOONBUS_ADVERTISE_HOST", "", help="host other nodes connect to")
    common.flag(parser, "--heartbeat-interval", "MOONBUS_HEARTBEAT_INTERVAL", 1.0, float, help="seconds")
    common.flag(parser, "--peer-timeout", "MOONBUS_PEER_TIMEOUT", 5.0, float, help="seconds")
    common.flag(parser, "--connect-timeout", "MOONBUS_CONNECT_TIMEOUT", 5.0, float, help="seconds")
    args = parser.parse_args(argv)
    return MessengerConfig(
        nats_url=args.nats_url,
        instance_id=args.instance_id,
        node=args.node,
        shm_dir=common.shm_dir_for(args.node, args.shm_dir),
        home=Path(args.home),
        log_level=args.log_level,
        transfer_host=args.transfer_host,
        transfer_port=args.transfer_port,
        advertise_host=args.advertise_host,
        heartbeat_interval_s=args.heartbeat_interval,
        peer_timeout_s=args.peer_timeout,
        connect_timeout_s=args.connect_timeout,
    )
