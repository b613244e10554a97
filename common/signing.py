"""Who wrote what: Ed25519 keys, one per process that publishes audit events.

The cluster secret seals every event into its publisher's chain (common/audit.py), but every
service holds that secret, so it proves only that a service wrote an event, not which one. With
a signing key of its own, a process also signs each event's digest; the auditor checks the
signature against the public key registered for the event's publisher (`<service>/<instance>`), so
a holder of one service's credentials and the cluster secret cannot write another's events.

Files (made by `moonbus up` per process and `moonbus compose-secrets` per compose service, 0600
like every secret on the host):
    sign-<name>.key   the private key (its 32-byte seed, hex), read by that process alone
    signers.json      {"<service>/<instance>": {"key": "<public key, hex>", "since": <time>}, ...}:
                      whom the auditor trusts, and since when (the stream may hold older events of
                      that publisher, written before it had a key: sealed only, and accepted so).
                      "<service>/*" stands for every instance of a service that has no entry of
                      its own (compose's scaled replicas, whose ids are made when they start)
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from common.security import SecretError, new_secret_file, read_secret

SIGNERS_FILE = "signers.json"

# NOTE: PyNaCl (libsodium) is imported where a key is used: a process given no key (the RDMA test
# VM's messengers, whose guest image does not carry it) never loads it. libsodium, not the
# `cryptography` package (OpenSSL): it signs in about 20 us where OpenSSL took 31 (the conductor
# signs one `routed` event per route). Ed25519 signatures are deterministic, so both make the same
# bytes from the same key and data, and each verifies the other's (events signed before stay valid).


class Signer:
    """A process's private key: signs what it publishes."""

    def __init__(self, seed: bytes) -> None:
        from nacl.bindings import crypto_sign
        from nacl.signing import SigningKey

        self._key = SigningKey(seed)
        self._secret = self._key.encode() + self._key.verify_key.encode()  # libsodium's 64-byte secret key
        self._crypto_sign = crypto_sign

    def sign(self, data: bytes) -> str:
        # NOTE: crypto_sign itself (signature || data), not SigningKey.sign: no SignedMessage built per event
        return self._crypto_sign(data, self._secret)[:64].hex()

    def signed(self, data: bytes, signature: str) -> bool:
        """Whether `signature` over `data` is this key's."""
        return _verified(self._key.verify_key, data, signature)

    @property
    def public_hex(self) -> str:
        return self._key.verify_key.encode().hex()


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
        from nacl.signing import VerifyKey

        entries = {who: k if isinstance(k, dict) else {"key": k, "since": 0.0} for who, k in keys.items()}
        self._keys = {who: VerifyKey(bytes.fromhex(e["key"])) for who, e in entries.items()}
        self._since = {who: float(e.get("since", 0.0)) for who, e in entries.items()}

    def required(self, publisher: str, stored_at: float) -> bool:
        """Must an event of this publisher, stored at `stored_at` (the stream's clock), be signed?
        Not one stored before its publisher had a key (`since`); any other, also of a publisher
        nobody registered."""
        since = self._since.get(self._entry(publisher))
        return since is None or stored_at >= since

    def _entry(self, publisher: str) -> str:
        """Whose key signs for `<service>/<instance>/<incarnation>`: its own entry, else its service's `*`."""
        own = publisher.rsplit("/", 1)[0]
        return own if own in self._keys else f"{own.split('/', 1)[0]}/*"

    @classmethod
    def read(cls, path: str | Path) -> "Signers":
        return cls(json.loads(Path(path).read_text()))

    def __bool__(self) -> bool:
        return bool(self._keys)

    def verify(self, publisher: str, data: bytes, signature: str) -> bool:
        """Whether `signature` over `data` is by the key registered for the publisher named
        `<service>/<instance>/<incarnation>` (its incarnation changes with every start)."""
        key = self._keys.get(self._entry(publisher))
        return key is not None and _verified(key, data, signature)


def _verified(public_key, data: bytes, signature: str) -> bool:
    from nacl.exceptions import BadSignatureError

    try:
        public_key.verify(data, bytes.fromhex(signature))
        return True
    except (BadSignatureError, ValueError):  # a wrong signature, not 64 bytes, or not hex at all
        return False


def register(directory: Path, name: str, publishers: list[str]) -> Path:
    """`name`'s signing key in `directory` (made once, then kept), its public half registered in
    the directory's signers.json for each of `publishers` (since now, where it is new there)."""
    path = key_file(directory, name)
    public = new_key(path).public_hex
    registry = directory / SIGNERS_FILE
    keys = json.loads(registry.read_text()) if registry.exists() else {}
    new = {p: {"key": public, "since": time.time()} for p in publishers if keys.get(p, {}).get("key") != public}
    if new:
        write_signers(registry, keys | new)
    return path


def write_signers(path: Path, keys: dict[str, dict]) -> None:
    path.write_text(json.dumps(keys, indent=1, sort_keys=True))
    path.chmod(0o600)
