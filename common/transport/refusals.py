"""How often a refused connection is told: a log line or an audit event per network, and a cap on all.

A stranger who opens connections the KV links refuse must not flood the log or the signed audit
stream. Counting per address is not enough: the loopback range (127.0.0.0/8) and IPv6 give one
machine as many addresses as it likes. So refusals are told per *source*, an IPv4 /24 (the whole
loopback range as one) or an IPv6 /64, at most once per window each, and at most `cap` sources in
one window in all; every refusal not told is counted, and the next line told carries the count.
Pure: the caller passes the clock and holds the lock.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

SOURCES_KEPT = 4096  # sources remembered; the oldest half is forgotten past this


def source_of(address: str) -> str:
    """The network a refused connection is counted under: an IPv4 /24 (all of loopback as one),
    an IPv6 /64 (an IPv4-mapped one as its IPv4); anything that is not an address, itself."""
    try:
        ip = ipaddress.ip_address(address.strip("[]").split("%", 1)[0])
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback and isinstance(ip, ipaddress.IPv4Address):
        return "127.0.0.0/8"
    prefix = 24 if isinstance(ip, ipaddress.IPv4Address) else 64
    return str(ipaddress.ip_network(f"{ip}/{prefix}", strict=False))


@dataclass(frozen=True, slots=True)
class Told:
    """A refusal to tell now: its source, the refusals from that source not told since its last
    line, and those from every source not told because the window's cap was reached."""

    source: str
    untold: int
    untold_elsewhere: int


@dataclass(slots=True)
class Refusals:
    window_s: float = 10.0
    cap: int = 20  # sources told per window, in all
    _told_at: dict[str, float] = field(default_factory=dict)  # source -> when last told
    _untold: dict[str, int] = field(default_factory=dict)  # source -> refusals not told since
    _window_start: float = float("-inf")
    _told_in_window: int = 0
    _over_cap: int = 0  # refusals not told because the cap was reached, since the last line told

    def refused(self, address: str, now: float) -> Told | None:
        """Count a refusal from `address`; what to tell, or None (counted, told later)."""
        source = source_of(address)
        if now - self._window_start >= self.window_s:
            self._window_start, self._told_in_window = now, 0
        if now - self._told_at.get(source, float("-inf")) < self.window_s:
            self._untold[source] = self._untold.get(source, 0) + 1
            return None
        if self._told_in_window >= self.cap:
            self._over_cap += 1
            return None
        self._told_in_window += 1
        self._told_at[source] = now
        if len(self._told_at) > SOURCES_KEPT:
            for old in sorted(self._told_at, key=self._told_at.get)[: SOURCES_KEPT // 2]:
                self._told_at.pop(old, None)
                self._untold.pop(old, None)
        told = Told(source, self._untold.pop(source, 0), self._over_cap)
        self._over_cap = 0
        return told
