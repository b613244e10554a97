"""Tenants' shares of the cluster: requests in flight and tokens per minute, per tenant, over every
gateway replica, and a fair share for a tenant without limits of its own.

A tenant's own limits (its key's `max_concurrent`, `tokens_per_minute`) are checked against what
it holds at this gateway plus what the other gateways last said they hold. A tenant without its
own `max_concurrent` gets a fair share: alone, any number of requests (the conductor's admission
decides); while other tenants hold some too, at most an equal share of every request in flight
(the most of `fair_floor` and all of them over the tenants holding any, the asker counted), so
one tenant's flood cannot crowd the others out. The gateway (services/gateway/tenants.py) reads
the keys, holds one TenantLimits and tells the other gateways its usage.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Tenant:
    name: str
    max_concurrent: int | None = None
    tokens_per_minute: int | None = None
    shared_cache: bool = False
    operator: bool = False  # sees every tenant's routing decisions on /dashboard/state



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
    PEERS_MAX = 64  # other gateways kept at once: one more is ignored until one of them falls silent

    def __init__(self, fair_floor: int = 8) -> None:
        self.fair_floor = fair_floor  # a tenant without max_concurrent may always hold this many (0: no fair share)
        self.in_flight: collections.Counter[str] = collections.Counter()
        self.booked: dict[str, collections.deque[list]] = collections.defaultdict(collections.deque)  # [t, tokens]
        self.peers: dict[str, tuple[float, dict[str, list[int]]]] = {}  # gateway -> (heard at, its usage)

    def heard(self, gateway_id: str, usage: dict[str, list[int]], now: float) -> bool:
        """Another gateway's usage (checked by its wire type: two counts, never negative); False
        when it is ignored: a new gateway while PEERS_MAX others are heard."""
        if gateway_id not in self.peers and len(self.peers) >= self.PEERS_MAX:
            for gateway in [g for g, (at, _) in self.peers.items() if now - at > self.PEER_TTL_S]:
                del self.peers[gateway]
            if len(self.peers) >= self.PEERS_MAX:
                return False
        self.peers[gateway_id] = (now, usage)
        return True

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
