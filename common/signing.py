"""Who wrote what: Ed25519 keys, one per process that publishes audit events.

The cluster secret seals every event into its publisher's chain (common/audit.py), but every
service holds that secret, so it proves only that a service wrote an event, not which one. With
a signing key of its own, a process also signs each event's digest; the auditor checks the
signature against the public key registered for the event's publisher (`<service>/<instance>`), so
a holder of one service's credentials and the cluster secret cannot write another's events.

Files (made by `moonbus up`, 0600 like every secret; compose does not issue keys yet):
    sign-<name>.key   the private key (its 32-byte seed, hex), read by that process alone
    signers.json      {"<service>/<instance>": {"key": "<public key, hex>", "since": <time>}, ...}:
                      whom the auditor trusts, and since when (the stream may hold older events of
                      that publisher, written before it had a key: sealed only, and accepted so)
"""

from __future__ import annotations

import json
from pathlib import Path

from common.security import SecretError, new_secret_file, read_secret

SIGNERS_FILE = "signers.json"

# NOTE: cryptography is imported where a key is used: a process given no key (the RDMA test VM's
# messengers, whose guest image does not carry it) never loads it.


class Signer:
    """A process's private key: signs what it publishes."""

    def __init__(self, seed: bytes) -> None:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        self._key = Ed25519PrivateKey.from_private_bytes(seed)

    def sign(self, data: bytes) -> str:
        return self._key.sign(data).hex()

    def signed(self, data: bytes, signature: str) -> bool:
        """Whether `signature` over `data` is this key's."""
        return _verified(self._key.public_key(), data, signature)

    @property
    def public_hex(self) -> str:
        from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

        return self._key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()


def key_file(directory: Path, name: str) -> Path:
    return directory / f"sign-{name}.key"


def new_key(path: Path) -> Signer:
    """The key at `path`, made (0600) if it does not exist yet."""
    if not path.exists():
        new_secret_file(path, 32)
    return load(path)


def load(path: str | Path) -> Signer | None:
    """The key in `path` ('' = none); raises SecretError if it is unreadable or not a key."""
    seed = read_secret(path) if path else None
    if seed is None:
        return None
    if len(seed) != 32:
        raise SecretError(f"{path}: a signing key is 32 bytes (64 hex digits), not {len(seed)}")
    return Signer(seed)


class Signers:
    """The public keys the auditor trusts, by publisher (`<service>/<instance>`)."""

    def __init__(self, keys: dict[str, str | dict]) -> None:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

        entries = {who: k if isinstance(k, dict) else {"key": k, "since": 0.0} for who, k in keys.items()}
        self._keys = {who: Ed25519PublicKey.from_public_bytes(bytes.fromhex(e["key"])) for who, e in entries.items()}
        self._since = {who: float(e.get("since", 0.0)) for who, e in entries.items()}

    def required(self, publisher: str, stored_at: float) -> bool:
        """Must an event of this publisher, stored at `stored_at` (the stream's clock), be signed?
        Not one stored before its publisher had a key (`since`); any other, also of a publisher
        nobody registered."""
        since = self._since.get(publisher.rsplit("/", 1)[0])
        return since is None or stored_at >= since

    @classmethod
    def read(cls, path: str | Path) -> "Signers":
        return cls(json.loads(Path(path).read_text()))

    def __bool__(self) -> bool:
        return bool(self._keys)

    def verify(self, publisher: str, data: bytes, signature: str) -> bool:
        """Whether `signature` over `data` is by the key registered for the publisher named
        `<service>/<instance>/<incarnation>` (its incarnation changes with every start)."""
        key = self._keys.get(publisher.rsplit("/", 1)[0])
        return key is not None and _verified(key, data, signature)


def _verified(public_key, data: bytes, signature: str) -> bool:
    from cryptography.exceptions import InvalidSignature

    try:
        public_key.verify(bytes.fromhex(signature), data)
        return True
    except (InvalidSignature, ValueError):  # a wrong signature, or not hex at all
        return False


def write_signers(path: Path, keys: dict[str, dict]) -> None:
    path.write_text(json.dumps(keys, indent=1, sort_keys=True))
    path.chmod(0o600)
