"""Flags with environment-variable defaults, shared by every service's config loader.

Each service keeps one frozen dataclass config, validated in __post_init__, built from argparse
here. This is the only place that reads os.environ for configuration.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import sys
from pathlib import Path
from typing import Any, Callable, TypeVar

from common.transport import MODES, STRIPE_MIN, networks
from schemas.transfer import MAX_STRIPES

T = TypeVar("T")

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"


def flag(
    parser: argparse.ArgumentParser,
    name: str,
    env: str,
    default: Any,
    type: Callable[[str], Any] = str,
    help: str = "",
    **kwargs: Any,
) -> None:
    """Add --name whose default comes from $env, then from `default`.

    Give `dest` the name of the config field it fills when the two differ (see `build`).
    """
    raw = os.environ.get(env)
    value = type(raw) if raw not in (None, "") else default
    parser.add_argument(name, type=type, default=value, help=f"{help} (env {env}; default: %(default)s)", **kwargs)


@dataclasses.dataclass(frozen=True)
class NatsAuth:
    """How a service proves who it is to NATS (a per-role user of the cluster, see
    tools/moonbus/cluster/security.py) and whom it trusts for TLS. Empty = no authentication."""

    user: str = ""
    password_file: str = ""  # the password is read from a file (0600), never passed as a flag
    ca_file: str = ""  # for tls:// URLs: the CA that signed the server's certificate

    def password(self) -> str:
        return Path(self.password_file).read_text().strip() if self.password_file else ""


def build(cls: type[T], args: argparse.Namespace, **computed: Any) -> T:
    """A service's config dataclass from parsed flags: each field takes the flag of the same
    name (its dest), except those given in `computed`; a `nats_auth` field is made from the
    common NATS credential flags."""
    values = dict(computed)
    for field in dataclasses.fields(cls):
        if field.name == "nats_auth" and field.name not in values:
            values["nats_auth"] = NatsAuth(args.nats_user, args.nats_password_file, args.nats_ca)
        elif field.name == "home" and field.name not in values:
            values["home"] = Path(args.home)
        elif field.name not in values:
            values[field.name] = getattr(args, field.name)
    try:
        return cls(**values)
    except ValueError as exc:  # a setting the service refuses: say which, without a traceback
        raise SystemExit(f"{_program()}: refusing to start: {exc}") from None


def _program() -> str:
    path = Path(sys.argv[0] or "moonbus")
    return path.parent.name if path.name == "__main__.py" else path.name


def _setting(flag_name: str, env: str, help: str, default: Any = "", type: Callable[[str], Any] = str,
             role_default: Callable[[str], Any] | None = None) -> Any:
    """A ServiceConfig field: its flag, its MOONBUS_* variable, its default (or one per role: then a
    config built in code must name it too)."""
    metadata = {"flag": flag_name, "env": env, "help": help, "default": default, "type": type,
                "role_default": role_default}
    if role_default is not None:
        return dataclasses.field(metadata=metadata)
    return dataclasses.field(default=type(default), metadata=metadata)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServiceConfig:
    """What every moonbus process is configured with, declared once: its bus and credentials, its
    identity, its state and logs, its health file, metrics and signing key. Each service's config
    extends it with its own fields; the flags and MOONBUS_* variables of these come from here
    (`add_common_flags`), a field's flag and variable in its metadata."""

    nats_url: str = _setting("--nats-url", "MOONBUS_NATS_URL", "NATS server URL", DEFAULT_NATS_URL)
    nats_auth: NatsAuth = dataclasses.field(default_factory=NatsAuth)  # --nats-user, --nats-password-file, --nats-ca
    instance_id: str = _setting("--instance-id", "MOONBUS_INSTANCE_ID", "unique instance id",
                                role_default=lambda role: default_instance_id(role))
    log_level: str = _setting("--log-level", "MOONBUS_LOG_LEVEL", "logging level", "INFO")
    home: Path = _setting("--home", "MOONBUS_HOME", "state directory (model cache)",
                          role_default=lambda role: str(default_home()))
    health_file: str = _setting("--health-file", "MOONBUS_HEALTH_FILE",
                                "a file kept fresh while the service is ready, for container health checks ('' = none)")
    cluster_secret_file: str = _setting("--cluster-secret-file", "MOONBUS_CLUSTER_SECRET_FILE",
                                        "the cluster secret (point-to-point links, the audit chain); '' = none")
    signing_key_file: str = _setting("--signing-key-file", "MOONBUS_SIGNING_KEY_FILE",
                                     "this process's own Ed25519 key: it signs the audit events it publishes "
                                     "('' = sealed only)")
    metrics_port: int = _setting("--metrics-port", "MOONBUS_METRICS_PORT", "Prometheus metrics port (0 = off)", 0, int)
    metrics_host: str = _setting("--metrics-host", "MOONBUS_METRICS_HOST", "bind address of the metrics port",
                                 "127.0.0.1")

    def __post_init__(self) -> None:
        check_subject_token("instance id", self.instance_id)
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError("metrics port must be within 0..65535 (0 = off)")


NATS_AUTH_FLAGS = (("--nats-user", "MOONBUS_NATS_USER", "NATS user of this service's role ('' = none)"),
                   ("--nats-password-file", "MOONBUS_NATS_PASSWORD_FILE", "file holding that user's password"),
                   ("--nats-ca", "MOONBUS_NATS_CA", "CA file for a tls:// NATS URL"))


def add_common_flags(parser: argparse.ArgumentParser, role: str) -> None:
    """The flags of every ServiceConfig field (and of its NATS credentials), from the fields' metadata."""
    for field in dataclasses.fields(ServiceConfig):
        meta = field.metadata
        if not meta:
            continue
        default = meta["role_default"](role) if meta["role_default"] is not None else meta["default"]
        flag(parser, meta["flag"], meta["env"], default, meta["type"], help=meta["help"], dest=field.name)
    for name, env, help in NATS_AUTH_FLAGS:
        flag(parser, name, env, "", help=help)


def add_node_flags(parser: argparse.ArgumentParser) -> None:
    flag(parser, "--node", "MOONBUS_NODE", socket.gethostname(), help="node this instance runs on")
    flag(parser, "--shm-dir", "MOONBUS_SHM_DIR", "", help="node's shared-memory directory (default /dev/shm/moonbus-<node>)")


def add_transport_flag(parser: argparse.ArgumentParser) -> None:
    flag(parser, "--transport", "MOONBUS_TRANSPORT", "auto",
         help="point-to-point KV transport: auto (rdma where both ends have an RDMA device, else tcp), tcp or rdma")
    flag(parser, "--tcp-streams", "MOONBUS_TCP_STREAMS", 1, int,
         help="tcp connections per peer: a write of --tcp-stripe-min bytes or more is striped over them (more than 1 helps where one "
              "connection's core or window cannot fill the link; `moonbus bench transfer --streams` measures it)")
    flag(parser, "--insecure", "MOONBUS_INSECURE", False, boolean, nargs="?", const=True,
         help="run the KV links without the cluster-secret handshake when no --cluster-secret-file is given "
              "(a trusted fabric only; without either the service refuses to start)")
    flag(parser, "--tcp-stripe-min", "MOONBUS_TCP_STRIPE_MIN", STRIPE_MIN, int,
         help="bytes from which a write is striped over the --tcp-streams connections (parts of at least half)")
    flag(parser, "--link-cert", "MOONBUS_LINK_CERT", "",
         help="TLS on the KV links: this process's key and certificate (one PEM file) from the cluster's link CA; "
              "'' = plain TCP (moonbus up --link-tls and compose-secrets issue them)")
    flag(parser, "--link-ca", "MOONBUS_LINK_CA", "", help="TLS on the KV links: the cluster's link CA certificate")
    flag(parser, "--link-peers", "MOONBUS_LINK_PEERS", "",
         help="the addresses or networks (CIDR, comma-separated) of the cluster's nodes: the KV listeners close a "
              "connection from any other at once; 'auto' = the networks this host is on (moonbus up's and compose's "
              "default); '' = any address (the secret and TLS still decide)")


def check_link_secret(cluster_secret_file: str, insecure: bool) -> None:
    """A service that opens KV links fails closed: without the cluster secret its links would take
    any peer, so it refuses to start unless told --insecure."""
    if not cluster_secret_file and not insecure:
        raise ValueError("this service opens KV links, and without --cluster-secret-file (MOONBUS_CLUSTER_SECRET_FILE) "
                         "they would accept any peer; give the cluster secret (moonbus up and compose-secrets write "
                         "one), or --insecure to run the links without the handshake on a fabric you trust")


def check_transport(transport: str, tcp_streams: int, tcp_stripe_min: int, link_cert: str = "",
                    link_ca: str = "", link_peers: str = "") -> None:
    """What add_transport_flag's flags may be (one check for every service that has them)."""
    if transport not in MODES:
        raise ValueError(f"transport must be one of {', '.join(MODES)}; got {transport!r}")
    if bool(link_cert) != bool(link_ca):
        raise ValueError("TLS on the KV links needs both --link-cert and --link-ca")
    if link_cert and transport == "rdma":
        raise ValueError("--link-cert: TLS runs over the tcp transport; --transport rdma has none")
    networks(link_peers)
    if not 1 <= tcp_streams <= MAX_STRIPES or tcp_stripe_min < 2:
        raise ValueError(f"tcp streams must be within 1..{MAX_STRIPES} and the stripe minimum >= 2 bytes")


DEFAULT_BLOCK_TOKENS = 16


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    flag(parser, "--model", "MOONBUS_MODEL", "SmolLM2-135M-Instruct", help="model name, tiny-random, or a local checkpoint dir")
    flag(parser, "--block-tokens", "MOONBUS_BLOCK_TOKENS", DEFAULT_BLOCK_TOKENS, int,
         help="tokens per KV block (must be equal on every service)")
    flag(parser, "--dtype", "MOONBUS_DTYPE", "auto", choices=("auto", "bfloat16", "float32"),
         help="compute and KV dtype of the model (must be equal on every service); auto: bfloat16 where "
              "the CPU has AVX-512 BF16 or AMX, else float32")


def cache_index_id(name: str) -> str:
    """The instance id a cache index started as `--instance-id name` announces (no underscore)."""
    return name.replace("_", "-")


def default_instance_id(role: str) -> str:
    return f"{role}-{socket.gethostname()}-{os.getpid()}".replace(".", "-")


def default_home() -> Path:
    return Path.cwd() / ".moonbus"


def shm_dir_for(node: str, configured: str) -> Path:
    """The node's shared-memory directory: every process on the node must resolve the same one."""
    return Path(configured) if configured else Path("/dev/shm") / f"moonbus-{node}"


def check_subject_token(name: str, value: str) -> None:
    """Ids end up inside NATS subjects: no dots, spaces or wildcards."""
    if not value or any(c in value for c in ". *>\t\n"):
        raise ValueError(f"{name} {value!r} must be non-empty with no '.', '*', '>' or spaces")


def boolean(text: str) -> bool:
    """1/true/yes/on or 0/false/no/off (a boolean flag's value or its environment variable)."""
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {text!r}")
