"""The prefill service's settings (flags and MOONBUS_* environment variables), loaded in one place."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from common import models
from common.config import (ServiceConfig, add_common_flags, add_model_flags, add_node_flags,
                           add_transport_flag, boolean, build, check_link_secret, check_subject_token,
                           check_transport, flag, shm_dir_for)


@dataclass(frozen=True, kw_only=True)
class PrefillConfig(ServiceConfig):
    insecure: bool  # KV links without the cluster-secret handshake (check_link_secret)
    node: str
    shm_dir: Path
    model: str
    block_tokens: int
    dtype: str  # bfloat16 or float32 (`--dtype auto` resolved to this machine's)
    threads: int
    prefill_chunk: int  # prompts longer than this are computed in chunks of it (0 = never)
    heartbeat_interval_s: float
    drain_grace_s: float  # after SIGTERM: time to finish the work held before handing the rest back
    transfer_timeout_s: float
    transport: str  # auto | tcp | rdma: how KV goes to decode nodes and pipeline stages (common/transport)
    tcp_streams: int  # tcp connections per peer a large write is striped over
    tcp_stripe_min: int  # bytes from which a write is striped
    stream_host: str  # where this instance listens for pipeline stages' KV slices
    advertise_host: str  # how other instances reach that listener ("" = stream_host)
    pipeline_listener: bool  # listen for pipeline stages' KV (only when the conductor pipelines)
    link_cert: str = ""  # TLS on the KV links: this process's key and certificate ('' = plain tcp)
    link_ca: str = ""  # and the cluster's link CA
    link_peers: str = ""  # addresses/networks the KV listeners take connections from ('' = any)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_subject_token("node", self.node)
        if self.threads < 0:
            raise ValueError("threads must be >= 0 (0 = share the machine's cores with the workers computing)")
        if self.drain_grace_s < 0:
            raise ValueError("drain grace must be >= 0")
        if self.heartbeat_interval_s <= 0 or self.transfer_timeout_s <= 0:
            raise ValueError("intervals and timeouts must be > 0")
        check_transport(self.transport, self.tcp_streams, self.tcp_stripe_min, self.link_cert, self.link_ca,
                               self.link_peers)
        check_link_secret(self.cluster_secret_file, self.insecure)


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Every flag but the common ones (services/coupled adds these and the decode ones to one parser)."""
    add_node_flags(parser)
    add_model_flags(parser)
    flag(parser, "--prefill-chunk", "MOONBUS_PREFILL_CHUNK", 2048, int,
                help="compute prompts in chunks of this many tokens (0 = one pass)")
    flag(parser, "--threads", "MOONBUS_THREADS", 0, int,
                help="torch intra-op threads (0 = follow the work: each step takes this worker's share of the "
                     "machine's cores among the workers computing at that moment, common/cores.py)")
    flag(parser, "--heartbeat-interval", "MOONBUS_HEARTBEAT_INTERVAL", 0.15, float, dest="heartbeat_interval_s",
                help="seconds between heartbeats, each with this instance's load report")
    flag(parser, "--drain-grace", "MOONBUS_DRAIN_GRACE", 30.0, float, dest="drain_grace_s",
                help="seconds to finish held work after SIGTERM; what is left is resumed elsewhere")
    flag(parser, "--transfer-timeout", "MOONBUS_TRANSFER_TIMEOUT", 60.0, float, dest="transfer_timeout_s",
                help="seconds for one KV transfer step (a reservation, a connection, a slice, the completion notice)")
    add_transport_flag(parser)
    flag(parser, "--stream-host", "MOONBUS_STREAM_HOST", "127.0.0.1", help="bind address for pipeline KV streams")
    flag(parser, "--advertise-host", "MOONBUS_ADVERTISE_HOST", "", help="host other instances connect to")
    flag(parser, "--pipeline-listener", "MOONBUS_PIPELINE_LISTENER", False, boolean, nargs="?", const=True,
                help="listen for pipeline stages' KV slices (needed when the conductor's --pipeline-group >= 2)")


def from_args(args: argparse.Namespace) -> PrefillConfig:
    return build(PrefillConfig, args, shm_dir=shm_dir_for(args.node, args.shm_dir), home=Path(args.home),
                        dtype=models.resolve_dtype(args.dtype))


def load(argv: list[str] | None = None) -> PrefillConfig:
    parser = argparse.ArgumentParser(prog="python -m services.prefill", description="moonbus prefill instance")
    add_common_flags(parser, "prefill")
    add_flags(parser)
    return from_args(parser.parse_args(argv))
