"""`moonbus cachesim` (tools/moonbus/traces/cachesim.py): exact hit counts on tiny and real traces."""

import argparse
import json
from pathlib import Path

import pytest

from common.kv.blocks import block_keys_from_hash_ids
from tools.moonbus.traces.rows import TraceFormatError, load_trace, resolve_trace
from tools.moonbus.traces import cachesim

CONVERSATION = resolve_trace("conversation")


def write_trace(path: Path, hash_id_lists) -> Path:
    path.write_text(
        "".join(json.dumps({"timestamp": i, "input_length": 512 * len(h), "output_length": 1, "hash_ids": h}) + "\n"
                for i, h in enumerate(hash_id_lists))
    )
    return path


def run_cli(*argv) -> int:
    parser = argparse.ArgumentParser()
    cachesim.add_arguments(parser)
    return cachesim.run(parser.parse_args([str(a) for a in argv]))


TINY = [[1, 2, 3], [1, 2, 4], [1, 5], [6, 2, 3], [1, 2, 3]]


def test_tiny_trace_infinite_capacity():
    requests = [block_keys_from_hash_ids(h) for h in TINY]
    r = cachesim.simulate(requests, "inf", "lru")
    # hits: 0, [1,2]=2, [1]=1, 0 (6 is new: 2,3 are a different chain), [1,2,3]=3
    assert (r.num_blocks, r.num_hits) == (14, 6)


def test_tiny_trace_small_capacity_lru():
    requests = [block_keys_from_hash_ids(h) for h in TINY]
    r = cachesim.simulate(requests, 3, "lru")
    # cap 3: after r0 {1,2,3}; r1 hits 1,2 then 4 evicts 3 -> {1,2,4}; r2 hits 1, 5 evicts 2 -> {4,1,5};
    # r3 misses, its 3 blocks evict 4,1,5; r4 misses 1 -> 0 hits
    assert r.num_hits == 3


def test_cli_json_and_table(tmp_path, capsys):
    trace = write_trace(tmp_path / "t.jsonl", TINY)
    assert run_cli("--trace", trace, "--capacity-blocks", "3", "inf", "--json") == 0
    out = json.loads(capsys.readouterr().out)
    assert [(r["capacity_blocks"], r["num_hits"]) for r in out["results"]] == [(3, 3), ("inf", 6)]
    assert out["results"][1]["hit_ratio"] == round(6 / 14, 6)
    assert run_cli("--trace", trace, "--capacity-blocks", "inf", "--policy", "lfu", "--limit", "2") == 0
    table = capsys.readouterr().out
    assert "2 requests, 6 blocks" in table and "inf" in table


def test_capacity_argument_is_checked(tmp_path):
    trace = write_trace(tmp_path / "t.jsonl", TINY)
    with pytest.raises(SystemExit):
        run_cli("--trace", trace, "--capacity-blocks", "0")
    with pytest.raises(SystemExit):
        run_cli("--trace", trace, "--capacity-blocks", "many")


def test_malformed_row_names_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1]}\n\n'
                    '{"timestamp": 0, "input_length": "x", "output_length": 1, "hash_ids": [1]}\n')
    with pytest.raises(TraceFormatError, match=r"bad.jsonl:3: 'input_length'"):
        load_trace(path)
    path.write_text("{not json\n")
    with pytest.raises(TraceFormatError, match=":1: not valid JSON"):
        load_trace(path)
    assert len(load_trace(write_trace(tmp_path / "ok.jsonl", TINY), limit=2)) == 2


def test_real_trace_infinite_capacity_matches_prefix_chain_count():
    rows = load_trace(CONVERSATION, limit=500)
    assert len(rows) == 500
    # Independent count: a block hits iff its whole id chain up to it was seen in an earlier request.
    seen: set[tuple[int, ...]] = set()
    expected = total = 0
    for row in rows:
        chains = [row.hash_ids[: i + 1] for i in range(len(row.hash_ids))]
        expected += sum(1 for c in chains if c in seen)
        total += len(chains)
        seen.update(chains)
    requests = [block_keys_from_hash_ids(row.hash_ids) for row in rows]
    for policy in ("lru", "lfu", "length-aware"):
        r = cachesim.simulate(requests, "inf", policy)
        assert (r.num_blocks, r.num_hits) == (total, expected)
    assert 0 < expected < total
