"""API keys, tenants and their limits at the gateway (the API's door).

The key file (`--api-keys FILE`, written by `moonbus keys`) holds only SHA-256 hashes of keys:

    {"keys": [{"hash": "<sha256 of the key>", "tenant": "acme", "max_concurrent": 8,
               "tokens_per_minute": 200000, "shared_cache": false, "label": "ci"}]}

A request presents `Authorization: Bearer <key>`; its hash names the tenant. No key file: the
gateway is open (a local first start; `moonbus up` says so) and every caller is tenant "default".
The file is re-read when it changes, so keys are added and revoked without a restart.

Limits per tenant: requests in flight (`max_concurrent`) and tokens per minute (prompt plus
`max_tokens` are booked at admission and corrected to prompt plus completion at the end); over
either, 429 with Retry-After. They hold over every gateway replica: each gateway tells the others
what its tenants hold (subjects.tenant_usage) and counts theirs in (TenantLimits).

A tenant without its own `max_concurrent` (the default of `moonbus keys add`) gets a fair share
(`--fair-share-floor`). The limits are decided on the decision floor (common/decide/tenancy.py).

Cache namespace: block keys are seeded per tenant ("tenant:<name>"), so equal prompts of two
tenants never share a block, and neither `cached_tokens` nor TTFT tells one tenant anything
about another's prompts. A tenant with `shared_cache` uses the common namespace (tenants share by
both opting in, as operators decide). A request's `cache_salt` (as in vLLM) picks a namespace
within its tenant's: the same tenant with the same salt shares, two tenants never do, whatever
salt they send (a salt is a guessable string, not a secret). On an open gateway everyone is
tenant "default", so a salt there still sets its senders apart from those who send another.
"""

from __future__ import annotations

import json
from pathlib import Path

from common.decide.tenancy import Tenant
from common.kv.blocks import namespace_seed
from common.security import hash_key

OPEN = "default"  # the tenant of an open gateway (no key file)


class KeyFileError(ValueError):
    """Raised when the key file cannot be read or is malformed."""


def cache_seed(tenant: Tenant | None, cache_salt: str | None) -> int:
    """The seed of the request's block keys (its cache namespace)."""
    if cache_salt:
        # the name's length first: a name may hold ":", and "a:b" + "c" must not meet "a" + "b:c"
        name = tenant.name if tenant is not None else OPEN
        return namespace_seed(f"salt:{len(name)}:{name}:{cache_salt}")
    if tenant is None or tenant.shared_cache:
        return namespace_seed("")
    return namespace_seed("tenant:" + tenant.name)


def parse_key_file(text: str) -> dict[str, Tenant]:
    """hash -> Tenant."""
    try:
        entries = json.loads(text)["keys"]
        out = {}
        for e in entries:
            limits = {k: e.get(k) for k in ("max_concurrent", "tokens_per_minute")}
            for name, value in limits.items():
                if value is not None and (not isinstance(value, int) or value < 1):
                    raise ValueError(f"{name} must be a positive integer, got {value!r}")
            if len(e["hash"]) != 64:
                raise ValueError(f"not a SHA-256 hash: {e['hash'][:12]}...")
            out[e["hash"]] = Tenant(str(e["tenant"]), limits["max_concurrent"], limits["tokens_per_minute"],
                                    bool(e.get("shared_cache", False)), bool(e.get("operator", False)))
        return out
    except (ValueError, KeyError, TypeError) as exc:
        raise KeyFileError(f"malformed key file: {exc}") from exc


class KeyBook:
    """The key file, re-read when it changes."""

    def __init__(self, path: str) -> None:
        self.path = Path(path) if path else None
        self._mtime: float | None = None
        self._tenants: dict[str, Tenant] = {}
        if self.path is not None:
            self._reload()

    @property
    def open(self) -> bool:
        return self.path is None

    def _reload(self) -> None:
        try:
            mtime = self.path.stat().st_mtime
            if mtime != self._mtime:
                self._tenants, self._mtime = parse_key_file(self.path.read_text()), mtime
        except OSError as exc:
            raise KeyFileError(f"cannot read the key file {self.path}: {exc}") from exc

    def tenant_of(self, authorization: str | None) -> Tenant | None:
        """The tenant of an `Authorization: Bearer <key>` header; None if it names none."""
        if self.open:
            return Tenant(OPEN, shared_cache=True)  # open: one common cache, as anyone is anyone
        self._reload()
        if not authorization or not authorization.startswith("Bearer "):
            return None
        return self._tenants.get(hash_key(authorization.removeprefix("Bearer ").strip()))
