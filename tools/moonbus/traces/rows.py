"""Mooncake-format request traces: one JSON object per line.

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}

timestamp is the arrival time in ms from the start of the trace; hash_ids holds one id per
TRACE_BLOCK_TOKENS-token block of the prompt (the released traces have
len(hash_ids) == ceil(input_length / 512)); equal id chains mean equal prompt prefixes. There is no
text: replay maps ids to token blocks, cachesim and the simulator chain the ids into block keys
(common.kv.blocks.block_keys_from_hash_ids).

`load_trace` returns a list of frozen `TraceRow`s (12k rows load in well under a second) and
rejects a malformed row with `TraceFormatError` naming the file and line.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import orjson

TRACE_BLOCK_TOKENS = 512  # tokens per hash id in the released traces


class TraceFormatError(ValueError):
    """Raised by `load_trace` when a line is not valid JSON or lacks a well-typed field."""

    def __init__(self, path: str | Path, line_no: int, reason: str) -> None:
        super().__init__(f"{path}:{line_no}: {reason}")
        self.path = str(path)
        self.line_no = line_no
        self.reason = reason


@dataclass(frozen=True, slots=True)
class TraceRow:
    """One request of a trace."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRow]:
    """Read the first `limit` rows (all if None) of a JSONL trace; blank lines are skipped."""
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    rows: list[TraceRow] = []
    if limit == 0:
        return rows
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            rows.append(parse_row(line, path, line_no))
            if limit is not None and len(rows) >= limit:
                break
    return rows


def parse_row(line: bytes | str, path: str | Path = "<trace>", line_no: int = 0) -> TraceRow:
    """One JSONL line as a `TraceRow`; `TraceFormatError` if it is malformed."""
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise TraceFormatError(path, line_no, f"not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise TraceFormatError(path, line_no, f"expected a JSON object, got {type(obj).__name__}")
    values = []
    for name in ("timestamp", "input_length", "output_length"):
        value = obj.get(name)
        if not _is_count(value):
            raise TraceFormatError(path, line_no, f"{name!r} must be a non-negative integer, got {value!r}")
        values.append(value)
    hash_ids = obj.get("hash_ids")
    if not isinstance(hash_ids, list) or not all(type(h) is int for h in hash_ids):
        raise TraceFormatError(path, line_no, f"'hash_ids' must be a list of integers, got {hash_ids!r:.80}")
    return TraceRow(values[0], values[1], values[2], tuple(hash_ids))


NAMED_TRACES = {"conversation": "conversation_trace.jsonl", "synthetic": "synthetic_trace.jsonl"}


def trace_dirs() -> list[Path]:
    """Where the released traces are looked for: $MOONBUS_TRACES, then the copies kept in the
    repository (data/traces)."""
    import os

    repo = Path(__file__).resolve().parents[3]
    dirs = [Path(os.environ["MOONBUS_TRACES"])] if os.environ.get("MOONBUS_TRACES") else []
    dirs.append(repo / "data" / "traces")
    return dirs


def resolve_trace(name: str | Path) -> Path:
    """A released trace by name (conversation, synthetic), found in `trace_dirs()`, or any path as given."""
    name = str(name)
    if name not in NAMED_TRACES:
        return Path(name)
    for directory in trace_dirs():
        if (directory / NAMED_TRACES[name]).exists():
            return directory / NAMED_TRACES[name]
    return trace_dirs()[0] / NAMED_TRACES[name]  # does not exist: the caller reports it


def add_trace_arguments(parser: argparse.ArgumentParser) -> None:
    """The `--trace FILE` and `--limit N` flags every trace-reading command shares."""
    parser.add_argument("--trace", required=True, type=resolve_trace,
                        help="Mooncake-format JSONL trace: a path, or conversation / synthetic (the released traces)")
    parser.add_argument("--limit", type=int, default=None, metavar="N", help="read only the first N rows")


def _is_count(value: object) -> bool:
    # bool is an int subclass; a timestamp of `true` is a malformed row, not 1.
    return type(value) is int and value >= 0


# --------------------------------------------------------------------------- prompts for replay


def block_token_ids(hash_id: int, tokens_per_block: int, vocab_size: int, min_token_id: int = 3,
                    seed: int = 0) -> list[int]:
    """The fixed block of `tokens_per_block` token ids that trace hash id `hash_id` stands for.

    Ids are drawn uniformly from [min_token_id, vocab_size) (low ids are usually special tokens) by
    a generator seeded with (seed, hash_id): the same id always gives the same block, in any process.
    """
    if tokens_per_block <= 0:
        raise ValueError(f"tokens_per_block must be > 0, got {tokens_per_block}")
    if not 0 <= min_token_id < vocab_size:
        raise ValueError(f"need 0 <= min_token_id < vocab_size, got {min_token_id}, {vocab_size}")
    import numpy as np  # only replay needs it; load_trace stays light

    rng = np.random.Generator(np.random.PCG64([seed & 0xFFFFFFFF, hash_id & 0xFFFFFFFFFFFFFFFF]))
    return rng.integers(min_token_id, vocab_size, size=tokens_per_block).tolist()


def scaled_input_length(row: TraceRow, tokens_per_block: int) -> int:
    """input_length scaled by tokens_per_block / TRACE_BLOCK_TOKENS, at least 1 token and at most
    the row's blocks (so every full trace block stays a full block)."""
    scaled = round(row.input_length * tokens_per_block / TRACE_BLOCK_TOKENS)
    return max(1, min(scaled, len(row.hash_ids) * tokens_per_block))


def prompt_length(row: TraceRow, tokens_per_block: int, max_tokens: int | None = None) -> int:
    """The length of the row's replayed prompt: `scaled_input_length`, cut to `max_tokens` if given.
    It uses the row's first ceil(length / tokens_per_block) hash ids."""
    length = scaled_input_length(row, tokens_per_block)
    return length if max_tokens is None else max(1, min(length, max_tokens))


def prompt_token_ids(row: TraceRow, tokens_per_block: int, vocab_size: int, min_token_id: int = 3,
                     seed: int = 0, max_tokens: int | None = None) -> list[int]:
    """A prompt whose i-th block of `tokens_per_block` tokens is `block_token_ids(row.hash_ids[i])`.

    Its length is `scaled_input_length`, cut to `max_tokens` if given. Two rows whose hash ids share
    a prefix of k ids get prompts sharing a prefix of k full blocks, so their chained block keys
    (common.kv.blocks.block_keys with block_tokens == tokens_per_block) share exactly that prefix.
    """
    length = prompt_length(row, tokens_per_block, max_tokens)
    tokens: list[int] = []
    for hash_id in row.hash_ids[: -(-length // tokens_per_block)]:
        tokens.extend(block_token_ids(hash_id, tokens_per_block, vocab_size, min_token_id, seed))
    return tokens[:length]
