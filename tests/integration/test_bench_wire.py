"""`moonbus bench wire`, run small: every hot message round-trips, both codecs are timed on the
same messages (the hand-written one out of git, in a child process), and `make bench` gets a row
per message and direction; speed is never asserted."""

from __future__ import annotations

import argparse
import json
import subprocess

import pytest

from tests import required
from tools.moonbus.bench import wire

pytestmark = pytest.mark.integration


def has_revision(revision: str) -> bool:
    return subprocess.run(["git", "-C", str(wire.ROOT), "cat-file", "-e", f"{revision}^{{commit}}"],
                          capture_output=True).returncode == 0


def test_every_hot_message_is_timed_against_the_hand_written_codec(capsys):
    if not has_revision(wire.HAND_WRITTEN_CODEC):
        required.missing("history", f"this clone does not hold {wire.HAND_WRITTEN_CODEC} (the hand-written codec)")
    args = argparse.Namespace(before=wire.HAND_WRITTEN_CODEC, number=5, rounds=1, json=True)
    assert wire.run(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["before_note"] == ""
    assert [r["message"] for r in report["rows"]] == list(wire.messages())
    for r in report["rows"]:
        assert r["bytes"] > 0 and min(r["msgspec_decode_us"], r["hand_written_decode_us"], r["decode_speedup"]) > 0
    rows = wire.summary(report)
    assert len(rows) == 2 * len(report["rows"]) and all("vs hand-written" in r["row"] for r in rows)


def test_without_git_the_hand_written_column_is_left_out_saying_why(capsys):
    args = argparse.Namespace(before="no-such-revision", number=2, rounds=1, json=True)
    assert wire.run(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert "no-such-revision" in report["before_note"]
    assert all("hand_written_decode_us" not in r for r in report["rows"])
    assert all("vs json+checks" in r["row"] for r in wire.summary(report))
