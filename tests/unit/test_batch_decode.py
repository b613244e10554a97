"""Continuous batching (common/engine/batch.py) against per-sequence decoding on tiny-random.

The reference for every row is common.engine.reference: prefill, then decode_step one token at a time,
sampled with common.sampling.sample at the same step index the engine uses.
"""

import pytest
import torch

from common import machine, models, sampling
from common.sampling import is_greedy
from common.engine.llama import Llama
from common.engine import reference as single
from common.decide.perf import DecodeModel, PrefillModel, Profile
from schemas.route import SamplingParams
from common.engine.batch import BatchEngine, BatchFull
from common.engine.paged import BLOCK
from common.decide.admission import late_verdict

GREEDY = SamplingParams(temperature=0.0, max_tokens=64)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=64, seed=7)
HOT = SamplingParams(temperature=1.3, max_tokens=64, seed=123)
STEPS = 10


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def model(request, tmp_path_factory):
    """tiny-random in each dtype a worker runs; the references run in the same dtype."""
    return models.load_model(models.prepare("tiny-random", tmp_path_factory.mktemp("home")), request.param)


def make_prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def make_start(model, prompt: list[int], params: SamplingParams) -> tuple[torch.Tensor, int]:
    """What prefill hands decode: the prompt's KV and the first token."""
    cache, logits = single.prefill(model, prompt)
    return single.kv_from_cache(cache), sampling.sample(logits, params, step=0)


def reference(model, prompt: list[int], params: SamplingParams, steps: int) -> list[int]:
    """Tokens 1..steps of one sequence decoded alone."""
    cache, logits = single.prefill(model, prompt)
    token, out = sampling.sample(logits, params, step=0), []
    for step in range(1, steps + 1):
        token = sampling.sample(single.decode_step(model, token, cache), params, step=step)
        out.append(token)
    return out


# How far the engine's logits may stray from transformers' for the same tokens (tiny-random's
# logits reach ~16). float32: summation order alone (seen here: 1.2e-4 over 20 steps). bfloat16:
# torch's attention rounds its weights to bfloat16 before they multiply V, so a score that differs
# in its last float32 bit flips a weight by one bfloat16 step now and then; the random weights
# amplify that through the layers (seen here: up to 0.8 over 20 steps of a ragged batch).
LOGIT_TOL = {"torch.float32": 1e-3, "torch.bfloat16": 1.0}


def reference_with_margins(model, prompt: list[int], params: SamplingParams, steps: int) -> tuple[list[int], list[float]]:
    """`reference`, with the gap between the best two logits at each step (how near a tie it was)."""
    cache, logits = single.prefill(model, prompt)
    token, out, margins = sampling.sample(logits, params, step=0), [], []
    for step in range(1, steps + 1):
        logits = single.decode_step(model, token, cache).float()
        top = torch.topk(logits, 2).values
        token = sampling.sample(logits, params, step=step)
        out.append(token)
        margins.append(float(top[0] - top[1]) if is_greedy(params) else -1.0)
    return out, margins


def assert_equal_up_to_near_ties(got: list[int], want: list[int], margins: list[float], tol: float, what: str) -> None:
    """Tokens equal until the first step whose reference was a near-tie: a greedy row's best two
    logits within `tol` (its margin). A sampled row has no margin (-1): alone, its draws must
    all equal the reference's (from one uniform per (seed, step), a draw moves only where the
    uniform falls within the logits' drift of a boundary; none does in these sequences)."""
    for step, (a, b, margin) in enumerate(zip(got, want, margins)):
        if a != b:
            assert margin <= tol, f"{what}: step {step + 1} gave {a}, the reference {b}, {margin:.4f} apart (tolerance {tol})"
            return


def run(batch: BatchEngine, steps: int, into: dict[str, list[int]]) -> None:
    for _ in range(steps):
        for rid, token in batch.step().tokens.items():
            into.setdefault(rid, []).append(token)


# ragged batch: (length, sampling) per request
MIXED = [(3, GREEDY), (41, SEEDED), (17, GREEDY), (90, HOT), (1, GREEDY), (64, SEEDED)]


def test_each_request_alone_decodes_as_transformers_does(model):
    """A request alone in the engine: greedy tokens equal transformers' own decoding, except where
    the reference's best two logits are within the dtype's tolerance of each other (a near-tie,
    after which the two sequences may legitimately part); sampled rows draw what the reference draws
    from the same (seed, step) while their logits agree."""
    for i, (n, params) in enumerate(MIXED):
        batch = BatchEngine(Llama.from_hf(model), max_batch=1, kv_budget_tokens=10_000)
        kv, first = make_start(model, make_prompt(n, i), params)
        batch.add("alone", kv, first, params)
        got: dict[str, list[int]] = {}
        run(batch, STEPS, got)
        want, margins = reference_with_margins(model, make_prompt(n, i), params, STEPS)
        assert_equal_up_to_near_ties(got["alone"], want, margins, LOGIT_TOL[str(model.dtype)], f"row {i} alone")


def test_rows_of_a_ragged_batch_agree_with_each_sequence_alone_within_tolerance(model):
    """Every row of a ragged batch, fed the tokens its sequence decodes alone (so a near-tie cannot
    send it elsewhere), has logits within the dtype's stated tolerance of that sequence's at every
    step: the batch's one attention call per layer attends each row over exactly its own tokens."""
    batch = BatchEngine(Llama.from_hf(model), max_batch=8, kv_budget_tokens=10_000)
    alone = {}
    for i, (n, params) in enumerate(MIXED):
        kv, first = make_start(model, make_prompt(n, i), params)
        batch.add(f"r{i}", kv, first, params, num_generated=1)
        alone[f"r{i}"] = [single.prefill(model, make_prompt(n, i))[0], first]
    for step in range(1, STEPS + 1):
        with torch.inference_mode():
            logits = batch._forward(batch.num_running)
        batch.kv_lens += 1
        for rid, (cache, token) in alone.items():
            want = single.decode_step(model, token, cache).float()
            torch.testing.assert_close(logits[batch.index[rid]], want, rtol=0, atol=LOGIT_TOL[str(model.dtype)],
                                       msg=lambda m: f"{rid} at step {step}: {m}")
            alone[rid][1] = int(torch.argmax(want))
            batch.rows[batch.index[rid]].last_token = alone[rid][1]


def test_admitted_mid_batch_leaves_the_others_unchanged(model):
    first_two = [(25, GREEDY), (8, SEEDED)]
    alone: dict[str, list[int]] = {}
    joined: dict[str, list[int]] = {}
    for into, late in ((alone, False), (joined, True)):
        batch = BatchEngine(Llama.from_hf(model), max_batch=4, kv_budget_tokens=10_000)
        for i, (n, params) in enumerate(first_two):
            kv, first = make_start(model, make_prompt(n, i), params)
            batch.add(f"r{i}", kv, first, params)
        run(batch, 4, into)
        if late:
            kv, first = make_start(model, make_prompt(70, 99), HOT)
            batch.add("late", kv, first, HOT)
        run(batch, 6, into)
    assert joined["r0"] == alone["r0"] and joined["r1"] == alone["r1"]
    assert joined["late"] == reference(model, make_prompt(70, 99), HOT, 6)


def test_removing_a_row_leaves_the_others_unchanged(model):
    batch = BatchEngine(Llama.from_hf(model), max_batch=4, kv_budget_tokens=10_000)
    for i, n in enumerate((12, 30, 5)):
        kv, first = make_start(model, make_prompt(n, i), GREEDY)
        batch.add(f"r{i}", kv, first, GREEDY)
    got: dict[str, list[int]] = {}
    run(batch, 3, got)
    batch.remove("r0")  # the last row moves into slot 0
    batch.remove("nobody")
    run(batch, 5, got)
    assert "r0" not in batch and batch.num_running == 2
    assert got["r1"] == reference(model, make_prompt(30, 1), GREEDY, 8)
    assert got["r2"] == reference(model, make_prompt(5, 2), GREEDY, 8)


def test_capacity_counts_reserved_tokens_and_rows(model):
    params = SamplingParams(temperature=0.0, max_tokens=10)
    batch = BatchEngine(Llama.from_hf(model), max_batch=2, kv_budget_tokens=50)
    kv, first = make_start(model, make_prompt(20, 0), params)
    need = batch.tokens_needed(20, params, num_generated=1)
    assert need == 20 + 9  # the KV now and the 9 steps still to run (each adds the fed token's K, V)
    assert batch.can_admit(need)
    batch.add("a", kv, first, params)
    assert batch.reserved_tokens == need and not batch.can_admit(need)
    with pytest.raises(BatchFull):
        batch.add("b", kv, first, params)
    assert batch.admission_state().kv_free_tokens == 50 - need
    batch.remove("a")
    assert batch.reserved_tokens == 0 and batch.can_admit(need)


def test_tbt_recheck_uses_predicted_step_time(model):
    perf = Profile(PrefillModel((0.0, 0.001, 0.0, 0.0)), DecodeModel((0.01, 0.01, 0.0)))  # step = 0.01 + 0.01 * batch
    batch = BatchEngine(Llama.from_hf(model), max_batch=16, kv_budget_tokens=10_000)
    for i in range(3):
        kv, first = make_start(model, make_prompt(4, i), GREEDY)
        batch.add(f"r{i}", kv, first, GREEDY)
    state = batch.admission_state()
    assert late_verdict(state, 10, 30, batch.kv_budget_tokens, perf, tbt_slo_s=0.05) == ""  # batch 4: 0.05 s
    assert late_verdict(state, 10, 30, batch.kv_budget_tokens, perf, tbt_slo_s=0.045) == "tbt"
    assert late_verdict(state, 10, 30, batch.kv_budget_tokens, perf, tbt_slo_s=0.045, check_tbt=False) == ""
    assert late_verdict(state, 10, 10_001, batch.kv_budget_tokens, perf, tbt_slo_s=0.05) == "kv"  # never fits


def test_step_on_empty_batch_returns_nothing(model):
    assert BatchEngine(Llama.from_hf(model), max_batch=2, kv_budget_tokens=100).step().tokens == {}


async def test_engine_driven_as_the_decode_service_drives_it(model):
    """The service loads a row's KV into its blocks (`load`) and runs step() on worker threads, and calls
    add/remove/kv_of on its event loop, never inside torch.inference_mode(). Regression: a buffer
    made inside the mode and written outside it crashed the live decode instance ("Inplace update
    to inference tensor outside InferenceMode")."""
    import asyncio

    assert not torch.is_inference_mode_enabled()
    batch = BatchEngine(Llama.from_hf(model), max_batch=4, kv_budget_tokens=10_000)
    got: dict[str, list[int]] = {}

    async def steps(n: int) -> None:
        for _ in range(n):
            for rid, token in (await asyncio.to_thread(batch.step)).tokens.items():
                got.setdefault(rid, []).append(token)

    kv, first = make_start(model, make_prompt(10, 0), GREEDY)
    batch.reserve("first", batch.tokens_needed(10, GREEDY, 1), kv_len=10)
    batch.add("first", await asyncio.to_thread(batch.load, "first", kv, GREEDY), first, GREEDY)
    await steps(12)
    kv2, first2 = make_start(model, make_prompt(5, 1), GREEDY)
    batch.reserve("second", batch.tokens_needed(5, GREEDY, 1), kv_len=5)
    row = await asyncio.to_thread(batch.load, "second", kv2, GREEDY)  # beside a running step, as the service does
    batch.add("second", row, first2, GREEDY)
    await steps(3)
    stored = batch.kv_of("first")  # what the service stores in the pool when a request finishes
    target = torch.empty_like(stored)
    target.copy_(stored.narrow(3, 0, stored.shape[3]))  # as PoolClient writes a slab slot
    batch.remove("first")
    batch.add("third", kv, first, GREEDY)
    await steps(1)
    assert got["first"] == reference(model, make_prompt(10, 0), GREEDY, 15)
    assert got["second"] == reference(model, make_prompt(5, 1), GREEDY, 4)
    assert got["third"] == reference(model, make_prompt(10, 0), GREEDY, 1)


def test_a_reservation_holds_a_row_and_its_tokens_until_the_request_joins_or_leaves(model):
    params = SamplingParams(temperature=0.0, max_tokens=10)
    batch = BatchEngine(Llama.from_hf(model), max_batch=2, kv_budget_tokens=100)
    need = batch.tokens_needed(20, params, num_generated=1)  # 29
    batch.reserve("a", need, kv_len=20)
    assert batch.reserved_tokens == need and batch.admission_state().kv_free_tokens == 100 - need
    assert batch.num_running == 0 and batch.can_admit(need)
    state = batch.admission_state()  # the late check counts it in the batch: it steps with it from its join
    assert (state.num_running, state.context_tokens) == (1, 20)
    batch.reserve("b", need)
    assert not batch.can_admit(1)  # both rows held, though nothing runs yet
    with pytest.raises(BatchFull):
        batch.reserve("c", 1)
    with pytest.raises(ValueError):
        batch.reserve("a", need)
    kv, first = make_start(model, make_prompt(20, 0), params)
    batch.add("a", batch.load("a", kv, params), first, params)  # takes its reservation over
    assert batch.reserved_tokens == 2 * need and batch.num_running == 1
    batch.remove("b")  # its KV never came: the room goes back
    assert batch.reserved_tokens == need and batch.can_admit(need)
    batch.step()
    batch.remove("a")
    assert batch.reserved_tokens == 0 and batch.can_admit(100)


def test_a_row_stepped_past_its_reservation_grows_and_decodes_on(model):
    """The service ends a row at max_tokens; a caller that steps on (the benches do) still gets
    per-sequence tokens: the row's buffer grows by a copy of that row alone."""
    params = SamplingParams(temperature=0.0, max_tokens=2)
    batch = BatchEngine(Llama.from_hf(model), max_batch=2, kv_budget_tokens=1000)
    kv, first = make_start(model, make_prompt(6, 0), params)
    batch.reserve("a", batch.tokens_needed(6, params, 1), kv_len=6)
    row = batch.load("a", kv, params)
    assert len(batch.pending["a"].blocks) == 1  # its reservation: the KV now and the one step left, 7 tokens
    batch.add("a", row, first, params)
    got: dict[str, list[int]] = {}
    run(batch, 12, got)
    assert got["a"] == reference(model, make_prompt(6, 0), params, 12)
    assert len(batch.rows[0].blocks) * BLOCK >= 18


def test_a_row_that_cannot_sample_fails_alone(model, monkeypatch):
    batch = BatchEngine(Llama.from_hf(model), max_batch=4, kv_budget_tokens=10_000)
    tiny_t = SamplingParams(temperature=1e-40, max_tokens=64)  # greedy, not NaN
    for i, params in enumerate((GREEDY, tiny_t, SEEDED)):
        kv, first = make_start(model, make_prompt(6 + i, i), params)
        batch.add(f"r{i}", kv, first, params)
    real_forward = batch._forward

    def broken_row_1(b):
        logits = real_forward(b)
        logits[batch.index["r1"]] = float("nan")
        return logits

    monkeypatch.setattr(batch, "_forward", broken_row_1)
    result = batch.step()
    assert set(result.tokens) == {"r0", "r2"} and "no finite logit" in result.errors["r1"]
    monkeypatch.setattr(batch, "_forward", real_forward)
    batch.remove("r1")
    assert set(batch.step().tokens) == {"r0", "r2"}


def test_the_simulated_decode_instance_counts_room_as_the_live_engine_does(model):
    """One sequence of joins and a departure through the live engine and the simulator's decode
    instance: the same reservation per request, the same room left, the same yes/no on room."""
    from tools.sim.decode import DecodeBatch
    from tools.sim.instances import DecodeInstance, Nic
    from tools.sim.request import SimRequest

    budget = 120
    live = BatchEngine(Llama.from_hf(model), max_batch=8, kv_budget_tokens=budget)
    simulated = DecodeInstance("d0", Nic(1e9), DecodeBatch(lambda b, c, t: 0.01, 64, lambda *a: None), budget)
    for i, (prompt_len, max_tokens) in enumerate([(20, 10), (30, 40), (8, 3), (40, 60), (10, 5)]):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        r = SimRequest(i, 0.0, prompt_len, max_tokens, [], max_tokens)
        need = live.tokens_needed(prompt_len, params, num_generated=1)
        assert simulated.needed(r) == need
        assert simulated.has_room(r) == live.can_admit(need), (i, need, live.reserved_tokens)
        if live.can_admit(need):
            kv, first = make_start(model, make_prompt(prompt_len, i), params)
            live.add(f"r{i}", kv, first, params)
            simulated.batch.members.append(r)
        assert simulated.kv_free() == live.admission_state().kv_free_tokens
        if i == 2:  # the first one leaves
            live.remove("r0")
            simulated.batch.members.remove(next(m for m in simulated.batch.members if m.index == 0))
            assert simulated.kv_free() == live.admission_state().kv_free_tokens
    assert live.num_running == len(simulated.batch.members) == 3  # (40, 60) never found room


def test_a_span_of_a_rows_kv_is_a_copy_of_those_tokens(model):
    batch = BatchEngine(Llama.from_hf(model), max_batch=2, kv_budget_tokens=1000)
    kv, first = make_start(model, make_prompt(40, 0), GREEDY)
    batch.add("a", kv, first, GREEDY)
    batch.step()
    assert batch.kv_len("a") == 41
    span = batch.kv_span("a", 16, 32)
    assert torch.equal(span, batch.kv_of("a")[:, :, :, 16:32])
    span.zero_()  # a copy: the batch's own KV is untouched
    assert not torch.equal(span, batch.kv_of("a")[:, :, :, 16:32])
    with pytest.raises(ValueError):
        batch.kv_span("a", 32, 48)


def test_on_packed_weights_a_rows_logits_do_not_depend_on_its_batch(model):
    """The decode step's projections on oneDNN's packed weights: a row gets the same logits, bit
    for bit, in a batch of 2 as in a batch of 6, and the dense weights' within rounding. Where
    oneDNN cannot pack (bfloat16 on a CPU without the avx512_bf16 or amx_bf16 flag) the engine
    runs the dense weights, and a row's logits in a batch of 2 and of 6 agree within rounding."""
    llama = Llama.from_hf(model)

    def logits_of(rows: int, packed: bool) -> torch.Tensor:
        batch = BatchEngine(llama, max_batch=8, kv_budget_tokens=10_000, packed=packed)
        for i, (n, params) in enumerate(MIXED[:rows]):
            kv, first = make_start(model, make_prompt(n, i), params)
            batch.add(f"r{i}", kv, first, params, num_generated=1)
        with torch.inference_mode():
            return batch._forward(rows)

    if llama.packed() is None:
        # float32 always packs; bfloat16 where oneDNN has bf16 units to pack for (machine.has_bf16)
        assert llama.dtype == torch.bfloat16, f"{llama.dtype} weights did not pack (CPU flags {machine.vector_flags()})"
        torch.testing.assert_close(logits_of(2, packed=True), logits_of(6, packed=True)[:2], rtol=0,
                                   atol=LOGIT_TOL[str(model.dtype)])
        return
    small, large = logits_of(2, packed=True), logits_of(6, packed=True)
    assert torch.equal(small, large[:2])
    tol = {torch.float32: 1e-4, torch.bfloat16: LOGIT_TOL["torch.bfloat16"]}[llama.dtype]
    torch.testing.assert_close(large, logits_of(6, packed=False), rtol=tol, atol=tol)


def test_a_join_that_does_not_fit_keeps_its_reservation(model):
    params = SamplingParams(temperature=0.0, max_tokens=10)
    batch = BatchEngine(Llama.from_hf(model), max_batch=2, kv_budget_tokens=40)
    batch.reserve("a", 15, kv_len=6)
    kv, first = make_start(model, make_prompt(30, 0), params)  # needs 30 + 9 = 39: fits the budget of 40
    big, _ = make_start(model, make_prompt(35, 1), params)  # needs 35 + 9 = 44: never fits
    with pytest.raises(BatchFull):
        batch.add("a", batch.load("a", big, params), first, params)
    assert list(batch.pending) == ["a"] and batch.pending["a"].tokens == 15
    assert batch.reserved_tokens == 15 and batch.num_running == 0
    batch.add("a", batch.load("a", kv, params), first, params)
    assert not batch.pending and batch.reserved_tokens == 39


def test_a_load_for_a_request_removed_meanwhile_writes_nothing_and_its_blocks_come_back(model):
    """The service hands a request back while its KV loads on a thread: the load then finds no
    room to write into (it fails alone), and blocks freed while a load still wrote them are reused
    only once it ended."""
    params = SamplingParams(temperature=0.0, max_tokens=8)
    batch = BatchEngine(Llama.from_hf(model), max_batch=2, kv_budget_tokens=64)
    kv, _ = make_start(model, make_prompt(20, 0), params)
    free = batch.pool.num_free
    batch.reserve("gone", batch.tokens_needed(20, params, 1), kv_len=20)
    batch.remove("gone")
    with pytest.raises(ValueError, match="holds no room"):
        batch.load("gone", kv, params)
    assert batch.pool.num_free == free and not batch.pending

    batch.reserve("slow", batch.tokens_needed(20, params, 1), kv_len=20)
    held = list(batch.pending["slow"].blocks)
    written = []

    def write(blocks):  # stands in for a file read: the request is removed while it runs
        batch.remove("slow")
        assert batch.pool.num_free == free - len(held)  # not handed out while still being written
        written.append(blocks)

    batch._load("slow", tuple(kv.shape), params, 1, write)
    assert written == [held] and batch.pool.num_free == free and not batch.loading
