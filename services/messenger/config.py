"""Messenger settings: one messenger per node owns the node's KV pool and its transfer link."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from common import models
from common.config import (ServiceConfig, add_common_flags, add_model_flags, add_node_flags,
                           add_transport_flag, build, check_link_secret, check_subject_token, check_transport,
                           flag, shm_dir_for)
from common.decide.eviction import POLICIES


@dataclass(frozen=True, kw_only=True)
class MessengerConfig(ServiceConfig):
    insecure: bool  # KV links without the cluster-secret handshake (check_link_secret)
    node: str
    shm_dir: Path
    model: str
    block_tokens: int
    dtype: str  # bfloat16 or float32 (`--dtype auto` resolved to this machine's)
    transport: str  # auto | tcp | rdma (common/transport)
    tcp_streams: int  # tcp connections per peer a large write is striped over
    tcp_stripe_min: int  # bytes from which a write is striped
    transfer_host: str  # where the point-to-point transports listen
    transfer_port: int  # tcp's port; 0 = any free port
    advertise_host: str  # how other nodes reach this one
    dram_bytes: int  # DRAM tier (shared-memory slab) capacity
    ssd_bytes: int  # SSD tier (LMDB) capacity; 0 = no SSD tier
    dram_blocks: int  # > 0: the DRAM capacity in blocks instead of bytes
    ssd_blocks: int  # >= 0: the SSD capacity in blocks instead of bytes
    ssd_dir: Path
    eviction: str  # lru | lfu | length-aware
    heartbeat_interval_s: float
    peer_timeout_s: float  # forget a peer messenger after this long without heartbeats
    connect_timeout_s: float
    pin_lease_s: float  # pins of a request that never released them are dropped after this long
    stale_kv_s: float  # a request KV file in the shm directory older than this is nobody's: removed
    reserve_idle_s: float  # a handoff reservation with no write for this long is dropped (its prefill stalled)
    link_timeout_s: float  # deadline of every read on a transport connection
    link_cert: str = ""  # TLS on the KV links: this process's key and certificate ('' = plain tcp)
    link_ca: str = ""  # and the cluster's link CA
    link_peers: str = ""  # addresses/networks the KV listeners take connections from ('' = any)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_subject_token("node", self.node)
        if not 0 <= self.transfer_port < 65536:
            raise ValueError(f"transfer port {self.transfer_port} out of range")
        if min(self.heartbeat_interval_s, self.peer_timeout_s, self.connect_timeout_s, self.pin_lease_s, self.stale_kv_s,
               self.reserve_idle_s, self.link_timeout_s) <= 0:
            raise ValueError("intervals and timeouts must be > 0")
        if self.block_tokens < 1 or self.dram_bytes < 0 or self.ssd_bytes < 0:
            raise ValueError("block tokens must be >= 1 and capacities >= 0")
        if self.eviction not in POLICIES:
            raise ValueError(f"eviction must be one of {', '.join(POLICIES)}; got {self.eviction!r}")
        check_transport(self.transport, self.tcp_streams, self.tcp_stripe_min, self.link_cert, self.link_ca,
                               self.link_peers)
        check_link_secret(self.cluster_secret_file, self.insecure)

    @property
    def transfer_addr_host(self) -> str:
        return self.advertise_host or self.transfer_host


def load(argv: list[str] | None = None) -> MessengerConfig:
    parser = argparse.ArgumentParser(prog="python -m services.messenger", description="moonbus messenger (one per node)")
    add_common_flags(parser, "messenger")
    add_node_flags(parser)
    add_model_flags(parser)
    add_transport_flag(parser)
    flag(parser, "--transfer-host", "MOONBUS_TRANSFER_HOST", "127.0.0.1", help="bind address of the KV transports")
    flag(parser, "--transfer-port", "MOONBUS_TRANSFER_PORT", 0, int, help="tcp port of the KV transports (0 = free port)")
    flag(parser, "--advertise-host", "MOONBUS_ADVERTISE_HOST", "", help="host other nodes connect to")
    flag(parser, "--dram-bytes", "MOONBUS_DRAM_BYTES", 1 << 30, int, help="DRAM tier capacity in bytes")
    flag(parser, "--ssd-bytes", "MOONBUS_SSD_BYTES", 4 << 30, int, help="SSD tier capacity in bytes (0: none)")
    flag(parser, "--dram-blocks", "MOONBUS_DRAM_BLOCKS", 0, int, help="DRAM tier capacity in blocks (overrides bytes)")
    flag(parser, "--ssd-blocks", "MOONBUS_SSD_BLOCKS", -1, int, help="SSD tier capacity in blocks (overrides bytes)")
    flag(parser, "--ssd-dir", "MOONBUS_SSD_DIR", "", help="LMDB directory (default $MOONBUS_HOME/ssd/<node>)")
    flag(parser, "--eviction", "MOONBUS_EVICTION", "lru", help="lru, lfu or length-aware")
    flag(parser, "--heartbeat-interval", "MOONBUS_HEARTBEAT_INTERVAL", 1.0, float, help="seconds", dest="heartbeat_interval_s")
    flag(parser, "--peer-timeout", "MOONBUS_PEER_TIMEOUT", 5.0, float, help="seconds", dest="peer_timeout_s")
    flag(parser, "--connect-timeout", "MOONBUS_CONNECT_TIMEOUT", 5.0, float, help="seconds", dest="connect_timeout_s")
    flag(parser, "--pin-lease", "MOONBUS_PIN_LEASE", 600.0, float, help="seconds", dest="pin_lease_s")
    flag(parser, "--stale-kv", "MOONBUS_STALE_KV", 600.0, float, dest="stale_kv_s",
                help="seconds after which a request KV file nobody picked up is removed")
    flag(parser, "--reserve-idle", "MOONBUS_RESERVE_IDLE", 120.0, float, dest="reserve_idle_s",
                help="seconds without a write after which a handoff reservation is dropped")
    flag(parser, "--link-timeout", "MOONBUS_LINK_TIMEOUT", 30.0, float, dest="link_timeout_s",
                help="deadline of every read on a KV transport connection (seconds)")
    args = parser.parse_args(argv)
    home = Path(args.home)
    return build(MessengerConfig, args, shm_dir=shm_dir_for(args.node, args.shm_dir), home=home,
                        ssd_dir=Path(args.ssd_dir) if args.ssd_dir else home / "ssd" / args.node,
                        dtype=models.resolve_dtype(args.dtype))
