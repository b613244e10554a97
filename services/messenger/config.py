"""Messenger settings: one messenger per node owns the node's KV pool and its transfer link."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from common import config as common, models
from common.decide.eviction import POLICIES


@dataclass(frozen=True)
class MessengerConfig:
    nats_url: str
    nats_auth: common.NatsAuth  # this role's NATS credentials
    cluster_secret_file: str  # '' = no cluster secret (then only with insecure)
    insecure: bool  # KV links without the cluster-secret handshake (common.check_link_secret)
    instance_id: str
    node: str
    shm_dir: Path
    home: Path
    log_level: str
    health_file: str  # kept fresh while ready (common/health.py); '' = none
    metrics_port: int  # Prometheus (common/metrics.py); 0 = off
    metrics_host: str
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
    signing_key_file: str = ""  # this process's own key for signing its audit events ('' = none)
    link_cert: str = ""  # TLS on the KV links: this process's key and certificate ('' = plain tcp)
    link_ca: str = ""  # and the cluster's link CA
    link_peers: str = ""  # addresses/networks the KV listeners take connections from ('' = any)

    def __post_init__(self) -> None:
        common.check_subject_token("instance id", self.instance_id)
        common.check_subject_token("node", self.node)
        if not 0 <= self.transfer_port < 65536:
            raise ValueError(f"transfer port {self.transfer_port} out of range")
        if min(self.heartbeat_interval_s, self.peer_timeout_s, self.connect_timeout_s, self.pin_lease_s, self.stale_kv_s,
               self.reserve_idle_s, self.link_timeout_s) <= 0:
            raise ValueError("intervals and timeouts must be > 0")
        if self.block_tokens < 1 or self.dram_bytes < 0 or self.ssd_bytes < 0:
            raise ValueError("block tokens must be >= 1 and capacities >= 0")
        if self.eviction not in POLICIES:
            raise ValueError(f"eviction must be one of {', '.join(POLICIES)}; got {self.eviction!r}")
        common.check_transport(self.transport, self.tcp_streams, self.tcp_stripe_min, self.link_cert, self.link_ca,
                               self.link_peers)
        common.check_link_secret(self.cluster_secret_file, self.insecure)

    @property
    def transfer_addr_host(self) -> str:
        return self.advertise_host or self.transfer_host


def load(argv: list[str] | None = None) -> MessengerConfig:
    parser = argparse.ArgumentParser(prog="python -m services.messenger", description="moonbus messenger (one per node)")
    common.add_common_flags(parser, "messenger")
    common.add_node_flags(parser)
    common.add_model_flags(parser)
    common.add_transport_flag(parser)
    common.flag(parser, "--transfer-host", "MOONBUS_TRANSFER_HOST", "127.0.0.1", help="bind address of the KV transports")
    common.flag(parser, "--transfer-port", "MOONBUS_TRANSFER_PORT", 0, int, help="tcp port of the KV transports (0 = free port)")
    common.flag(parser, "--advertise-host", "MOONBUS_ADVERTISE_HOST", "", help="host other nodes connect to")
    common.flag(parser, "--dram-bytes", "MOONBUS_DRAM_BYTES", 1 << 30, int, help="DRAM tier capacity in bytes")
    common.flag(parser, "--ssd-bytes", "MOONBUS_SSD_BYTES", 4 << 30, int, help="SSD tier capacity in bytes (0: none)")
    common.flag(parser, "--dram-blocks", "MOONBUS_DRAM_BLOCKS", 0, int, help="DRAM tier capacity in blocks (overrides bytes)")
    common.flag(parser, "--ssd-blocks", "MOONBUS_SSD_BLOCKS", -1, int, help="SSD tier capacity in blocks (overrides bytes)")
    common.flag(parser, "--ssd-dir", "MOONBUS_SSD_DIR", "", help="LMDB directory (default $MOONBUS_HOME/ssd/<node>)")
    common.flag(parser, "--eviction", "MOONBUS_EVICTION", "lru", help="lru, lfu or length-aware")
    common.flag(parser, "--heartbeat-interval", "MOONBUS_HEARTBEAT_INTERVAL", 1.0, float, help="seconds", dest="heartbeat_interval_s")
    common.flag(parser, "--peer-timeout", "MOONBUS_PEER_TIMEOUT", 5.0, float, help="seconds", dest="peer_timeout_s")
    common.flag(parser, "--connect-timeout", "MOONBUS_CONNECT_TIMEOUT", 5.0, float, help="seconds", dest="connect_timeout_s")
    common.flag(parser, "--pin-lease", "MOONBUS_PIN_LEASE", 600.0, float, help="seconds", dest="pin_lease_s")
    common.flag(parser, "--stale-kv", "MOONBUS_STALE_KV", 600.0, float, dest="stale_kv_s",
                help="seconds after which a request KV file nobody picked up is removed")
    common.flag(parser, "--reserve-idle", "MOONBUS_RESERVE_IDLE", 120.0, float, dest="reserve_idle_s",
                help="seconds without a write after which a handoff reservation is dropped")
    common.flag(parser, "--link-timeout", "MOONBUS_LINK_TIMEOUT", 30.0, float, dest="link_timeout_s",
                help="deadline of every read on a KV transport connection (seconds)")
    args = parser.parse_args(argv)
    home = Path(args.home)
    return common.build(MessengerConfig, args, shm_dir=common.shm_dir_for(args.node, args.shm_dir), home=home,
                        ssd_dir=Path(args.ssd_dir) if args.ssd_dir else home / "ssd" / args.node,
                        dtype=models.resolve_dtype(args.dtype))
