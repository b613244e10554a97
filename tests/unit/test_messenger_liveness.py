"""A messenger hears a worker's liveness beacon: a prefill busy with a long prompt sends no
heartbeat for seconds (its event loop waits on the forward pass), but its beacon thread goes on,
and its handoff reservations and pins must not be dropped as a dead process's."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from schemas import subjects
from schemas.workers import Alive
from services.messenger.service import MessengerService


def beacon(instance_id: str, incarnation: str, sender: str = "") -> tuple[Alive, SimpleNamespace]:
    """A beacon as the bus hands it over (decoded), with the message it came in."""
    alive = Alive(instance_id, incarnation)
    return alive, SimpleNamespace(subject=subjects.control_alive(sender or instance_id), data=alive.to_bytes())


def test_a_beacon_keeps_a_known_process_alive_and_no_other():
    long_ago = time.monotonic() - 60
    service = SimpleNamespace(seen={"prefill-0": ("a1", long_ago), "decode-0": ("d1", long_ago)},
                              workers={"prefill-0": ("a1", long_ago)})
    for alive, msg in (beacon("decode-0", "d1", sender="prefill-0"), beacon("prefill-0", "a1"),
                       beacon("decode-0", "old"), beacon("stranger", "x")):
        asyncio.run(MessengerService.on_alive(service, alive, msg))
    assert service.seen["prefill-0"][1] > long_ago and service.workers["prefill-0"][1] > long_ago
    # another incarnation's beacon proves nothing, nor one sent in its name by another instance
    assert service.seen["decode-0"] == ("d1", long_ago)
    assert "stranger" not in service.seen and "stranger" not in service.workers
