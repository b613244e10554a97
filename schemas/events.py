"""The audit log: one JSON event per state change, on subjects under moonbus.events.

Request kinds, in path order: received, routed, prefilled, kv_transferred, first_token, then
exactly one terminal kind: completed, failed, rejected or cancelled.

The planner's decisions (a conductor started with --planner; common/decide/planner.py) are
`planned` instance events, on moonbus.events.instance.planned.<conductor id> (PLANNED_ALL for
every conductor), stored in the events stream like every audited event. A driver that starts
and drains workers subscribes there (or reads the stream from where it stopped) and decodes the
event's `data` with `Planned.from_dict`: it brings the prefill and decode instances it runs to
`prefill` and `decode`, and replaces the `lost_*` ones (a death is not load: the targets do not
move for it). One is published each time a target changes, and each time a role lost instances.
"""

from __future__ import annotations

from typing import Any

from schemas import subjects
from schemas.codec import NonNegative, Wire

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


PLANNED = "planned"  # an instance event: the planner's targets (Planned), published by a conductor
PLANNED_ALL = subjects.instance_event(PLANNED, "*")


def planned_subject(conductor_id: str) -> str:
    """moonbus.events.instance.planned.<conductor id>: one conductor's planner decisions."""
    return subjects.instance_event(PLANNED, conductor_id)


class Planned(Wire):
    """The data of a `planned` event: how many instances of each role the load needs, and why."""

    prefill: NonNegative  # the target: instances taking work (a driver starts or drains to reach it)
    decode: NonNegative
    previous_prefill: NonNegative = 0  # the targets before this decision
    previous_decode: NonNegative = 0
    reasons: list[str] = []  # one short sentence per change, or per loss
    demand_prefill: float = 0.0  # instances' worth of work the decision judged
    demand_decode: float = 0.0
    utilization_prefill: float = 0.0  # busy share of the instances taking work, in the window
    utilization_decode: float = 0.0
    lost_prefill: NonNegative = 0  # lost in the window: replace them, the target stays
    lost_decode: NonNegative = 0
    attainment: float | None = None  # in the window, as the conductor knows it (None: unknown)
    slack: float = 1.0  # prefill's target utilisation is times this: how hot the attainment lets it run
