"""The audit log: one JSON event per state change, on subjects under moonbus.events.

Request kinds, in path order: received, routed, prefilled, kv_transferred, first_token, then
exactly one terminal kind: completed, failed, rejected or cancelled.
"""

from __future__ import annotations

from typing import Any

from schemas.codec import Wire

REQUEST_KINDS = (
    "received",
    "routed",
    "prefilled",
    "kv_transferred",
    "first_token",
    "decode_finished",
    "completed",
    "failed",
    "rejected",
    "cancelled",
)
TERMINAL_KINDS = frozenset({"completed", "failed", "rejected", "cancelled"})


class Event(Wire):
    kind: str
    ts: float  # wall clock, seconds
    service: str
    instance_id: str
    request_id: str = ""
    data: dict[str, Any] = {}
    # the audit chain (common/audit.py), set when the publisher holds the cluster secret
    publisher: str = ""  # <service>/<instance_id>/<incarnation>
    seq: int = 0  # 1, 2, 3, ... per publisher
    prev: str = ""  # the previous event's digest, hex
    prev_ts: float = 0.0  # the previous event's ts
    digest: str = ""  # HMAC-SHA256 keyed with the cluster secret, hex
    sig: str = ""  # Ed25519 signature of the digest by its publisher's own key, hex (common/signing.py)
