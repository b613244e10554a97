"""Replay prompts: block keys of the built token ids reproduce the trace's hash-id sharing exactly."""



from common.kv.blocks import block_keys
from common.traces import TraceRow, block_token_ids, load_trace, prompt_token_ids, resolve_trace, scaled_input_length

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
