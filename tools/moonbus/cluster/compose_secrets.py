"""`moonbus compose-secrets`: what compose.yaml hands its containers as compose secrets.

    moonbus compose-secrets [--dir .moonbus/compose] [--tenant default]

writes, once (a second run keeps what exists, so a running deployment's secrets stay valid):

    <dir>/secrets/cluster.key        the cluster secret (KV link handshake, audit chain)
    <dir>/secrets/nats-<role>.pw     one NATS password per role (tools/moonbus/cluster/security.py)
    <dir>/secrets/sign-<service>.key one signing key per compose service (common/signing.py), its
                                     public half in secrets/signers.json: under the service's own
                                     instance id (the messengers') or as `<role>/*` (the others,
                                     whose ids are made when they start)
    <dir>/secrets/link-*.pem         the cluster's link CA and a certificate for each service that
                                     opens KV links (tools/moonbus/cluster/certs.py): TLS on
    <dir>/nats.conf                  the nats-server configuration admitting exactly those users
    <dir>/keys/api-keys.json         API keys, stored hashed; a first key for --tenant is made
                                     and printed once when the file does not exist yet

compose.yaml reads them from $MOONBUS_COMPOSE_SECRETS (default ./.moonbus/compose): each service
gets the cluster key, its own role's password, its own signing key and (messengers, prefill) its
link certificate and the CA's, nothing else; nats gets nats.conf; the gateway mounts
keys/ read-only (add and revoke keys with `moonbus keys --file <dir>/keys/api-keys.json`: the
gateway re-reads the file). The directory is its owner's alone (0700); the files in it are
readable by the containers' user, which differs from the host's.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from common import signing
from common.config import default_home
from common.security import hash_key, new_api_key
from tools.moonbus.cluster import certs, keys as keys_tool
from tools.moonbus.cluster.security import SERVICE_ROLES, ClusterSecrets, nats_config

NATS_PORT, NATS_MONITOR_PORT, NATS_STORE = 4222, 8222, Path("/data")
# compose service -> (its role, the instance id it is given: '' = made when it starts)
SIGNERS = {"gateway": ("gateway", ""), "conductor": ("conductor", ""), "cache_index": ("cache_index", ""),
           "messenger-a": ("messenger", "messenger-a"), "messenger-b": ("messenger", "messenger-b"),
           "prefill": ("prefill", ""), "decode": ("decode", "")}
LINKS = ("messenger-a", "messenger-b", "prefill")  # the compose services that open KV links


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", type=Path, default=None, help="where to write them (default ./.moonbus/compose)")
    parser.add_argument("--tenant", default="default", help="the tenant of the first API key")


def prepare(directory: Path, tenant: str = "default") -> str | None:
    """Write what is missing under `directory`; returns the first API key when one was made."""
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o700)
    secrets = ClusterSecrets.create(directory / "secrets")
    sign_keys(secrets.directory)
    for service in LINKS:
        certs.ensure_cert(secrets.directory, service)
    secrets.directory.chmod(0o755)  # the containers' user reads through it; `directory` guards the host
    for path in secrets.directory.iterdir():
        path.chmod(0o600 if path.name == certs.CA_KEY else 0o644)  # the CA's key is no container's
    conf = directory / "nats.conf"
    conf.write_text(nats_config(secrets, "0.0.0.0", NATS_PORT, NATS_STORE, "moonbus", http_port=NATS_MONITOR_PORT))
    conf.chmod(0o644)
    key_file = directory / "keys" / "api-keys.json"
    first_key = None
    if not key_file.exists():
        first_key = new_api_key()
        keys_tool.save(key_file, [{"hash": hash_key(first_key), "tenant": tenant, "label": "first"}])
        key_file.chmod(0o644)  # `moonbus keys` keeps the mode it finds
    key_file.parent.chmod(0o755)
    return first_key


def sign_keys(directory: Path) -> None:
    """A signing key per compose service, made once; signers.json names each's public half."""
    for service, (role, instance) in SIGNERS.items():
        signing.register(directory, service, [f"{role}/{instance or '*'}"])


def run(args: argparse.Namespace) -> int:
    directory = args.dir or default_home() / "compose"
    first_key = prepare(directory, args.tenant)
    print(f"compose secrets in {directory} (roles: {', '.join(SERVICE_ROLES)}); "
          f"export MOONBUS_COMPOSE_SECRETS={directory.resolve()} if it is not ./.moonbus/compose")
    if first_key:
        print(f"first API key, tenant {args.tenant} (shown once; only its hash is kept):\n{first_key}")
    else:
        print(f"API keys: {directory / 'keys' / 'api-keys.json'} (moonbus keys --file ... add/list/revoke)")
    return 0
