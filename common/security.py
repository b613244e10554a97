"""Secrets and the small cryptography around them (stdlib hmac/hashlib/secrets only).

- The cluster secret: 32 random bytes, hex in a 0600 file, shared by every service of a cluster.
  It keys the point-to-point links' handshake (`link_proof`) and the audit chain.
- API keys: handed to users once, stored only as SHA-256 hashes (`hash_key`).
- TLS on the point-to-point links (`link_tls`, with `--link-cert` and `--link-ca`): both ends show
  a certificate issued by the cluster's link CA (`moonbus up --link-tls`, `moonbus compose-secrets`
  issue them: tools/moonbus/cluster/certs.py), and every byte is encrypted and authenticated
  (TLS 1.3's AEAD), so a relay on the path can neither read nor rewrite KV.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import ssl
import stat
from dataclasses import dataclass
from pathlib import Path

LINK_NONCE_BYTES = 16


class SecretError(ValueError):
    """Raised when a secret file is missing, unreadable or not what it should be."""


def new_secret_file(path: Path, nbytes: int = 32) -> Path:
    """Write a new random secret (hex) readable by its owner only; returns the path."""
    return write_private(path, (secrets.token_hex(nbytes) + "\n").encode())


def write_private(path: Path, data: bytes) -> Path:
    """Write `data` to a file readable by its owner only (created so: never readable in between)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    return path


class UnsafeDirectory(PermissionError):
    """A directory the cluster would keep its files in, that another user could read or swap."""


def private_dir(path: Path) -> Path:
    """`path` as a directory only this user can enter: made (with any missing parents) 0700 where
    missing, tightened to 0700 where it is this user's; refused (UnsafeDirectory, saying what is in
    the way) where it is a link or a file, belongs to another user, or sits in a folder another
    user could rename it out of (theirs, or writable by all without the sticky bit)."""
    path = Path(path)
    missing = []
    probe = path
    while not os.path.lexists(probe) and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:  # made meanwhile: checked below like any existing one
            pass
    uid = os.getuid()
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeDirectory(f"{path} is not a directory (a link or a file is there): remove it, or choose another")
    if st.st_uid != uid:
        raise UnsafeDirectory(f"{path} belongs to uid {st.st_uid}, not to this user ({uid}): another user made it "
                              f"first; remove it, or choose another")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, 0o700)
    for parent in path.parents:
        pst = os.stat(parent)
        if pst.st_uid not in (0, uid):
            raise UnsafeDirectory(f"{path} is inside {parent}, which belongs to uid {pst.st_uid}: its owner could "
                                  f"swap it; choose another place")
        if pst.st_mode & stat.S_IWOTH and not pst.st_mode & stat.S_ISVTX:
            raise UnsafeDirectory(f"{path} is inside {parent}, which anyone may write without the sticky bit: "
                                  f"anyone could swap it; choose another place")
    return path


def read_secret(path: str | Path) -> bytes | None:
    """The secret in a file written by `new_secret_file` (None for no file configured)."""
    if not path:
        return None
    try:
        text = Path(path).read_text().strip()
        secret = bytes.fromhex(text)
    except (OSError, ValueError) as exc:
        raise SecretError(f"cannot read the secret in {path}: {exc}") from exc
    if len(secret) < 16:
        raise SecretError(f"the secret in {path} is too short ({len(secret)} bytes)")
    return secret


def link_proof(secret: bytes, nonce: bytes, role: bytes) -> bytes:
    """What a peer answers to a nonce to prove it holds the cluster secret (role: b"client"/b"server",
    so that one side's answer cannot be replayed as the other's)."""
    return hmac.new(secret, role + b"|" + nonce, hashlib.sha256).digest()


def proofs_match(expected: bytes, got: bytes) -> bool:
    return hmac.compare_digest(expected, got)


def hash_key(key: str) -> str:
    """How an API key is stored: its SHA-256, hex (a key is 32 random bytes: no salt needed)."""
    return hashlib.sha256(key.encode()).hexdigest()


def new_api_key() -> str:
    return "mb-" + secrets.token_urlsafe(32)


@dataclass(frozen=True)
class LinkTls:
    """The TLS contexts of a process's KV links: it accepts (server) and connects (client) only with
    a certificate of the cluster's link CA at both ends. Peers are known by that CA, not by host
    name: a locator is an address, and any certificate the cluster issued is a member's."""

    server: ssl.SSLContext
    client: ssl.SSLContext


def link_tls(cert_file: str | Path, ca_file: str | Path) -> LinkTls | None:
    """The contexts for a certificate (its key in the same PEM file) and the link CA; None when no
    certificate is configured. Raises SecretError if either file cannot be loaded."""
    if not cert_file and not ca_file:
        return None
    if not cert_file or not ca_file:
        raise SecretError("TLS on the KV links needs both --link-cert and --link-ca")
    contexts = []
    for purpose in (ssl.PROTOCOL_TLS_SERVER, ssl.PROTOCOL_TLS_CLIENT):
        ctx = ssl.SSLContext(purpose)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.check_hostname = False  # before verify_mode: a client context checks names by default
        ctx.verify_mode = ssl.CERT_REQUIRED  # both ends: a certificate of the cluster's link CA
        try:
            ctx.load_cert_chain(cert_file)
            ctx.load_verify_locations(cafile=str(ca_file))
        except (OSError, ssl.SSLError) as exc:
            raise SecretError(f"cannot load the KV link's TLS files ({cert_file}, {ca_file}): {exc}") from exc
        contexts.append(ctx)
    return LinkTls(*contexts)
