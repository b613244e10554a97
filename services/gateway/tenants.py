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

A tenant without its own `max_concurrent` (the default of `moonbus keys add`) gets a fair share:
alone it may hold any number of requests (the conductor's admission decides), but while other
tenants hold some too, at most an equal share of every request in flight (the most of `fair_floor`,
`--fair-share-floor`, and all of them over the tenants holding any, the asker counted), so one
tenant's flood cannot crowd the others out; the others' requests are admitted at once.

Cache namespace: block keys are seeded per tenant ("tenant:<name>"), so equal prompts of two
tenants never share a block, and neither `cached_tokens` nor TTFT tells one tenant anything
about another's prompts. A tenant with `shared_cache` uses the common namespace; a request's
`cache_salt` (as in vLLM) picks the namespace "salt:<value>", shared by whoever sends the same
salt: deliberate sharing, e.g. of a common system prompt.
"""

from __future__ import annotations

import collections
import json
import math
from dataclasses import dataclass
from pathlib import Path

from common.kv.blocks import namespace_seed
from common.security import hash_key

OPEN = "default"  # the tenant of an open gateway (no key file)


class KeyFileError(ValueError):
    """Raised when the key file cannot be read or is malformed."""


@dataclass(frozen=True)
class Tenant:
    name: str
    max_concurrent: int | None = None
    tokens_per_minute: int | None = None
    shared_cache: bool = False
    operator: bool = False  # sees every tenant's routing decisions on /dashboard/state


def cache_seed(tenant: Tenant | None, cache_salt: str | None) -> int:
    """The seed of the request's block keys (its cache namespace)."""
    if cache_salt:
        return namespace_seed("salt:" + cache_salt)
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


class TenantLimits:
    """Requests in flight and tokens per minute, per tenant, over every gateway replica. Pure: the
    caller passes the clock.

    Each gateway counts its own, publishes them (`usage`, on every change and every second) and
    keeps what the others publish (`heard`, forgotten after PEER_TTL_S without news: a gateway that
    died holds nothing). A tenant's limit is checked against its own count plus the others', so N
    replicas do not give it N times its limit; two gateways admitting at the same instant may pass
    it by what they admit within one message's latency."""

    WINDOW_S = 60.0
    PEER_TTL_S = 3.0

    def __init__(self, fair_floor: int = 8) -> None:
        self.fair_floor = fair_floor  # a tenant without max_concurrent may always hold this many (0: no fair share)
        self.in_flight: collections.Counter[str] = collections.Counter()
        self.booked: dict[str, collections.deque[list]] = collections.defaultdict(collections.deque)  # [t, tokens]
        self.peers: dict[str, tuple[float, dict[str, list[int]]]] = {}  # gateway -> (heard at, its usage)

    def heard(self, gateway_id: str, usage: dict[str, list[int]], now: float) -> None:
        self.peers[gateway_id] = (now, usage)

    def usage(self, now: float) -> dict[str, list[int]]:
        """This gateway's [in flight, tokens in the window] per tenant that has either."""
        out = {}
        for tenant in set(self.in_flight) | set(self.booked):
            pair = [self.in_flight[tenant], self._own_used(tenant, now)]
            if any(pair):
                out[tenant] = pair
        return out

    def _peer(self, tenant: str, i: int, now: float) -> int:
        for gateway in [g for g, (at, _) in self.peers.items() if now - at > self.PEER_TTL_S]:
            del self.peers[gateway]
        return sum(usage.get(tenant, (0, 0))[i] for _, usage in self.peers.values())

    def _held(self, tenant: str, now: float) -> int:
        return self.in_flight[tenant] + self._peer(tenant, 0, now)

    def _too_many(self, tenant: Tenant, now: float) -> str:
        """Why the tenant may not have one more request in flight now ("" if it may)."""
        held = self._held(tenant.name, now)
        if tenant.max_concurrent is not None:
            return f"tenant {tenant.name} already has {tenant.max_concurrent} requests in flight" \
                if held >= tenant.max_concurrent else ""
        if not self.fair_floor or held < self.fair_floor:
            return ""
        everyone = collections.Counter(self.in_flight)
        for _, usage in self.peers.values():  # (_held above dropped the silent ones)
            everyone.update({t: pair[0] for t, pair in usage.items()})
        active = sum(1 for t, n in everyone.items() if n > 0 and t != tenant.name) + 1
        share = max(self.fair_floor, math.ceil(sum(everyone.values()) / active))
        if active > 1 and held >= share:
            return (f"tenant {tenant.name} holds {held} requests in flight, its fair share while {active} tenants are "
                    f"served (a key's --max-concurrent sets its own limit instead)")
        return ""

    def _own_used(self, tenant: str, now: float) -> int:
        window = self.booked[tenant]
        while window and now - window[0][0] >= self.WINDOW_S:
            window.popleft()
        return sum(tokens for _, tokens in window)

    def _used(self, tenant: str, now: float) -> int:
        return self._own_used(tenant, now) + self._peer(tenant, 1, now)

    def precheck(self, tenant: Tenant, now: float) -> tuple[str, float]:
        """What admit() would refuse whatever the request's size: ("", 0) if nothing yet, else (why,
        retry after seconds). Checked before a prompt is tokenized."""
        if why := self._too_many(tenant, now):
            return why, 1.0
        if tenant.tokens_per_minute is not None and self._used(tenant.name, now) >= tenant.tokens_per_minute:
            return (f"tenant {tenant.name} used its {tenant.tokens_per_minute} tokens per minute",
                    self._retry_after(tenant, 1, now))
        return "", 0.0

    def admit(self, tenant: Tenant, tokens: int, now: float) -> tuple[list | None, str, float]:
        """(booking, "", 0) if admitted, else (None, why, retry after seconds)."""
        if why := self._too_many(tenant, now):
            return None, why, 1.0
        if tenant.tokens_per_minute is not None:
            used = self._used(tenant.name, now)
            if used + tokens > tenant.tokens_per_minute:
                if tokens > tenant.tokens_per_minute:
                    return None, (f"the request may use {tokens} tokens; tenant {tenant.name} may use "
                                  f"{tenant.tokens_per_minute} per minute"), self.WINDOW_S
                return None, (f"tenant {tenant.name} used {used} of its {tenant.tokens_per_minute} tokens per "
                              f"minute"), self._retry_after(tenant, tokens, now)
        self.in_flight[tenant.name] += 1
        booking = [now, tokens]
        self.booked[tenant.name].append(booking)
        return booking, "", 0.0

    def _retry_after(self, tenant: Tenant, tokens: int, now: float) -> float:
        """Until enough of the window has expired for `tokens` to fit."""
        excess = self._used(tenant.name, now) + tokens - tenant.tokens_per_minute
        for t, booked in self.booked[tenant.name]:
            excess -= booked
            if excess <= 0:
                return max(1.0, math.ceil(t + self.WINDOW_S - now))
        return self.WINDOW_S

    def release(self, tenant: Tenant, booking: list, used_tokens: int) -> None:
        """The request ended: it no longer counts in flight, and it used what it used."""
        self.in_flight[tenant.name] -= 1
        booking[1] = used_tokens
