"""The auditor's checkpoint: what the events stream held the last time it verified, kept outside it.

Chains find events altered, dropped or deleted inside the stream, but not the stream itself
deleted and rebuilt without some events, or its limits shrunk so that events expire at once:
what is not there anymore leaves no trace in what is. After every clean `moonbus audit verify`
the auditor writes a checkpoint signed with its own key (common/signing.py; `sign-auditor.key`
beside the cluster's other secrets): the stream's creation time, its last stream seq, its limits,
and every chain's head (publisher, seq, digest, stream seq, time). The next verify checks the
stream against it:

  rebuilt   the stream was created after the checkpoint's (deleted and made again)
  rewound   its last stream seq is below the checkpoint's (JetStream never reuses one)
  shrunk    its max age or size is below the checkpoint's (events made to expire early)
  vanished  a chain head the checkpoint saw, young enough to be kept, is not in the stream
  forged    the checkpoint file is not signed by the auditor's key (it was edited)
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from common.audit import Problem, Report, Stored
from common.signing import Signer


@dataclass(frozen=True)
class StreamState:
    created: float
    last_seq: int
    max_age_s: float  # 0 = no limit
    max_bytes: int  # -1 = no limit
    bytes: int = 0  # held now


@dataclass
class Checkpoint:
    stream: StreamState
    heads: dict[str, tuple[int, str, int, float]] = field(default_factory=dict)  # publisher -> (seq, digest, stream seq, ts)
    at: float = 0.0


def heads_of(report: Report, records: list[Stored]) -> dict[str, tuple[int, str, int, float]]:
    """Each verified chain's last event: (seq, digest, stream seq, ts)."""
    heads: dict[str, tuple[int, str, int, float]] = {}
    for r in records:
        if report.marks.get(r.stream_seq) != "verified":
            continue
        obj = orjson.loads(r.payload)
        publisher, seq = obj["publisher"], obj["seq"]
        if publisher not in heads or seq > heads[publisher][0]:
            heads[publisher] = (seq, obj["digest"], r.stream_seq, float(obj.get("ts", 0.0)))
    return heads


def write(path: Path, checkpoint: Checkpoint, signer: Signer) -> None:
    body = orjson.dumps({"stream": checkpoint.stream.__dict__, "heads": checkpoint.heads, "at": checkpoint.at},
                        option=orjson.OPT_SORT_KEYS)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(orjson.dumps({"checkpoint": orjson.loads(body), "sig": signer.sign(body), "signer": signer.public_hex}))
    os.replace(tmp, path)


def read(path: Path, signer: Signer) -> tuple[Checkpoint | None, list[Problem]]:
    """The checkpoint at `path` (None if there is none yet), or a `forged` problem if its
    signature is not the auditor's."""
    if not path.exists():
        return None, []
    try:
        whole = orjson.loads(path.read_bytes())
        body = orjson.dumps(whole["checkpoint"], option=orjson.OPT_SORT_KEYS)
        if not signer.signed(body, whole["sig"]):
            raise ValueError("its signature is not the auditor's")
        c = whole["checkpoint"]
        return Checkpoint(StreamState(**c["stream"]), {p: tuple(h) for p, h in c["heads"].items()}, c["at"]), []
    except (ValueError, KeyError, TypeError) as exc:
        return None, [Problem("forged", "", 0, 0, "", f"the checkpoint {path} cannot be trusted: {exc}")]


def check(checkpoint: Checkpoint, now: StreamState, records: list[Stored] | None,
          wall_now: float | None = None) -> list[Problem]:
    """What the stream lost since the checkpoint, beyond what its limits let expire (`records`:
    the whole stream as read; None for a part of it: its chain heads are then not looked for)."""
    then, problems = checkpoint.stream, []
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(checkpoint.at))
    if now.created > then.created + 1e-3:
        problems.append(Problem("rebuilt", "", 0, 0, "", f"the stream was created at {_t(now.created)}, after the "
                                f"checkpoint of {when} saw it created at {_t(then.created)}: deleted and made again"))
    if now.last_seq < then.last_seq:
        problems.append(Problem("rewound", "", 0, now.last_seq, "", f"its last stream seq is {now.last_seq}, "
                                f"below the {then.last_seq} of the checkpoint of {when}"))
    if (then.max_age_s > 0 and not 0 < now.max_age_s >= then.max_age_s) or \
            (then.max_bytes > 0 and not 0 < now.max_bytes >= then.max_bytes):
        problems.append(Problem("shrunk", "", 0, 0, "", f"its limits (max age {now.max_age_s:g} s, max bytes "
                                f"{now.max_bytes}) are below the checkpoint's ({then.max_age_s:g} s, {then.max_bytes})"))
    if records is None:
        return problems
    held = {r.stream_seq: r for r in records}
    first = min(held, default=now.last_seq + 1)
    wall_now = time.time() if wall_now is None else wall_now
    for publisher, (seq, digest, stream_seq, ts) in sorted(checkpoint.heads.items()):
        # its age does not let it expire yet, nor does the stream's size (it is not full)
        kept = (then.max_age_s <= 0 or ts > wall_now - then.max_age_s) and \
            (now.max_bytes <= 0 or now.bytes < 0.9 * now.max_bytes)
        record = held.get(stream_seq)
        if record is not None and orjson.loads(record.payload).get("digest") == digest:
            continue
        if stream_seq < first and not kept:
            continue  # expired, as the limits allow
        problems.append(Problem("vanished", publisher, seq, stream_seq, "",
                                f"seq {seq} of this chain was at stream seq {stream_seq} at the checkpoint of {when}; "
                                "it is not in the stream now"))
    return problems


def _t(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))
