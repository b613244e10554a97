"""Replay prompts: block keys of the built token ids reproduce the trace's hash-id sharing exactly."""



from common.kv.blocks import block_keys
from tools.moonbus.traces.rows import TraceRow, block_token_ids, load_trace, prompt_token_ids, resolve_trace, scaled_input_length

TRACE = resolve_trace("conversation")


def common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def test_block_is_fixed_and_in_range():
    a = block_token_ids(42, 16, 259)
    assert a == block_token_ids(42, 16, 259)
    assert a != block_token_ids(43, 16, 259)
    assert len(a) == 16 and all(3 <= t < 259 for t in a)


def test_lengths_scale():
    row = TraceRow(0, 1100, 10, (1, 2, 3))  # 2 full trace blocks + 76 tokens
    assert scaled_input_length(row, 16) == round(1100 * 16 / 512) == 34
    ids = prompt_token_ids(row, 16, 259)
    assert len(ids) == 34 and ids[:16] == block_token_ids(1, 16, 259) and ids[32:] == block_token_ids(3, 16, 259)[:2]
    assert len(prompt_token_ids(row, 16, 259, max_tokens=20)) == 20


def test_block_keys_reproduce_hash_id_sharing():
    rows = load_trace(TRACE, 150)
    B = 16
    keys = [block_keys(prompt_token_ids(r, B, 259), B) for r in rows]
    shared_pairs = 0
    for i in range(len(rows)):
        for j in range(i + 1, len(rows)):
            ids = common_prefix(rows[i].hash_ids, rows[j].hash_ids)
            want = min(ids, len(keys[i]), len(keys[j]))
            assert common_prefix(keys[i], keys[j]) == want, (i, j)
            shared_pairs += want > 0
    assert shared_pairs > 100  # the check is not vacuous: many pairs share prefixes


def test_the_exported_trace_is_what_replay_sends():
    """`moonbus replay --export`: each row names the hash ids its prompt is built from and that
    prompt's length, so another client (aiperf, block size B) builds prompts of the same lengths
    sharing the same prefixes; times are divided by --speed."""
    import argparse

    from tools.moonbus.traces.replay import add_arguments, exported, output_tokens

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--trace", "conversation", "--speed", "0.5", "--tokens-per-block", "32",
                              "--max-output", "32", "--max-input", "900"])
    rows = load_trace(TRACE, 200)
    out = exported(rows, args)
    for row, e in zip(rows, out):
        length = len(prompt_token_ids(row, 32, 259, max_tokens=900))
        n = len(e["hash_ids"])
        assert e["input_length"] == length and (n - 1) * 32 < length <= n * 32  # aiperf's rule for a block size
        assert tuple(e["hash_ids"]) == row.hash_ids[:n]
        assert e["timestamp"] == round((row.timestamp_ms - rows[0].timestamp_ms) * 2)
        assert e["output_length"] == output_tokens(row, args) <= 32
    assert any(len(e["hash_ids"]) < len(r.hash_ids) for r, e in zip(rows, out))  # --max-input cut some
