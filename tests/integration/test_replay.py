"""`moonbus replay` against a live tiny cluster: every request accounted for, a valid summary."""

import json
from argparse import ArgumentParser
from pathlib import Path

from tools.moonbus.traces.rows import TraceRow
from tools.moonbus.traces import replay


def test_short_replay_gives_a_valid_summary(cluster, tmp_path: Path):
    trace = tmp_path / "trace.jsonl"
    rows = [TraceRow(0, 1500, 256, (1, 2, 3)), TraceRow(200, 1500, 128, (1, 2, 4)),
            TraceRow(400, 1024, 64, (1, 2)), TraceRow(600, 2048, 192, (5, 6, 7, 8))]
    trace.write_text("".join(json.dumps({"timestamp": r.timestamp_ms, "input_length": r.input_length,
                                         "output_length": r.output_length, "hash_ids": list(r.hash_ids)}) + "\n"
                             for r in rows))
    parser = ArgumentParser()
    replay.add_arguments(parser)  # the command's own flags and defaults, as `moonbus replay` parses them
    args = parser.parse_args(["--trace", str(trace), "--url", cluster.spec.url, "--tokens-per-block", "16",
                              "--ttft-slo", "60", "--tbt-slo", "10", "--timeout", "120", "--out", str(tmp_path / "out"),
                              "--plot", "--no-progress"])
    assert replay.run(args) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())["summary"]
    assert summary["requests"] == 4 and summary["ok"] == 4, summary
    assert summary["ttft_p50_s"] > 0 and summary["tbt_p50_s"] is not None
    results = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    # outputs scaled by 16/512: 256 -> 8, 128 -> 4, 64 -> 2, 192 -> 6, forced by ignore_eos
    assert [r["output_tokens"] for r in results] == [8, 4, 2, 6]
    assert [len(r["intervals"]) for r in results] == [7, 3, 1, 5]
    assert [r["input_tokens"] for r in results] == [47, 47, 32, 64]
    for name in ("ttft_cdf.png", "tbt_cdf.png", "load.png"):
        assert (tmp_path / "out" / name).stat().st_size > 0
