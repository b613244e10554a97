"""The live-route benchmark's fake fleet beats like independent processes: each on its own phase."""

from __future__ import annotations

import pytest

from tools.moonbus.bench.fleet import HEARTBEAT_S, MESSENGER_EVERY, beat_schedule


def test_every_worker_beats_once_per_interval_and_every_messenger_once_per_period():
    sends = beat_schedule(32, 32)
    assert [s[0] for s in sends] == sorted(s[0] for s in sends)
    for i in range(32):
        times = [t for t, sender, _ in sends if sender == i]
        assert len(times) == MESSENGER_EVERY
        assert [b - a for a, b in zip(times, times[1:])] == pytest.approx([HEARTBEAT_S] * (MESSENGER_EVERY - 1))
    assert sorted(sender for _, sender, _ in sends if sender < 0) == list(range(-32, 0))
    assert all(0 <= t < MESSENGER_EVERY * HEARTBEAT_S for t, _, _ in sends)


def test_workers_do_not_beat_in_step():
    sends = beat_schedule(32, 0)
    first = sorted(t for t, _, tick in sends if tick == 0)
    assert len(set(first)) == 32
    assert min(b - a for a, b in zip(first, first[1:])) == pytest.approx(HEARTBEAT_S / 32)
