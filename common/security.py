"""Secrets and the small cryptography around them (stdlib hmac/hashlib/secrets only).

- The cluster secret: 32 random bytes, hex in a 0600 file, shared by every service of a cluster.
  It keys the point-to-point links' handshake (`link_proof`) and the audit chain.
- API keys: handed to users once, stored only as SHA-256 hashes (`hash_key`).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

LINK_NONCE_BYTES = 16


class SecretError(ValueError):
    """Raised when a secret file is missing, unreadable or not what it should be."""


def new_secret_file(path: Path, nbytes: int = 32) -> Path:
    """Write a new random secret (hex) readable by its owner only; returns the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(secrets.token_hex(nbytes) + "\n")
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
