"""Layer-wise prefill (common/engine/layerwise.py) against the plain transformers forward on tiny-random."""

import threading
import time

import pytest
import torch

from common import kvfiles, machine, models
from common.engine import kernels
from common.engine.llama import Llama
from common.engine import reference
from common.engine.layerwise import (FileSink, KvAssembly, LayerwisePrefill, PrefillAborted, TensorPrefix,
                                        pipelined_prefill)

# Chunked attention runs masked sdpa over prefix + chunk instead of one causal sdpa, so KV agrees
# to rounding only, and a rounding step is the size of a layer's largest values, not of each
# element's (a hidden state of magnitude 8 rounds by 0.06 in bfloat16, and every K and V element
# of that layer inherits that step). So the error is measured in units of the dtype's epsilon
# times the largest |value| of each layer's K (or V, or the logits). Seen on tiny-random over
# chunks of 17-1000 tokens, on an AVX-512 BF16 CPU and with oneDNN and torch held to AVX2
# (ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2): bfloat16 at most 1.6 units, float32 30 (72
# for the logits). The tolerances leave room above both.
SCALE_UNITS = {torch.float32: 256, torch.bfloat16: 4}


def assert_close_to_scale(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    """got equals want within SCALE_UNITS of eps x the largest |value|, per layer's K and per
    layer's V of a KV tensor [L, 2, H, S, D] (or over the whole of any other tensor); `dtype`:
    the one the values were computed in (want's own by default; float32 logits of a bfloat16
    model are off by bfloat16's steps)."""
    dtype = dtype or want.dtype
    slabs = [(f"layer {l} {'KV'[kv]}", got[l, kv], want[l, kv]) for l in range(want.shape[0]) for kv in (0, 1)] \
        if want.dim() == 5 else [("", got, want)]
    for what, g, w in slabs:
        scale = float(w.float().abs().max())
        err = float((g.float() - w.float()).abs().max())
        tol = SCALE_UNITS[dtype] * torch.finfo(dtype).eps * scale
        assert err <= tol, f"{what}: off by {err:.4g}, more than {SCALE_UNITS[dtype]} x eps x {scale:.4g} = {tol:.4g}"


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def model(request, tmp_path_factory):
    """tiny-random in each dtype a worker runs; the references run in the same dtype."""
    return models.load_model(models.prepare("tiny-random", tmp_path_factory.mktemp("home")), request.param)


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return torch.randint(0, 250, (300,), generator=torch.Generator().manual_seed(0)).tolist()


@pytest.fixture(scope="module")
def whole(model, prompt):
    """The reference: one transformers forward over the whole prompt -> (KV [L,2,H,S,D], logits)."""
    cache, logits = reference.prefill(model, prompt)
    return reference.kv_from_cache(cache), logits.float()  # the engine's logits are float32


def greedy_continuation(model, kv: torch.Tensor, logits: torch.Tensor, steps: int = 5) -> list[int]:
    cache, token, out = reference.cache_from_kv(kv), int(torch.argmax(logits)), []
    for _ in range(steps):
        out.append(token)
        token = int(torch.argmax(reference.decode_step(model, token, cache)))
    return out


class SlowPrefix(TensorPrefix):
    """A prefix that arrives late, layer by layer, so compute must wait for it."""

    def load_layer(self, layer: int) -> torch.Tensor:
        time.sleep(0.01)
        return super().load_layer(layer)


class FailingSink(KvAssembly):
    def write_layer(self, layer, start, kv):
        if layer == 2:
            raise OSError("link down")
        super().write_layer(layer, start, kv)


def test_unchunked_equals_transformers_forward_exactly(model, prompt, whole):
    result = LayerwisePrefill(Llama.from_hf(model), attention="sdpa").run(prompt)
    assert torch.equal(result.kv, whole[0])
    assert torch.equal(result.logits, whole[1])


def test_the_engines_own_attention_agrees_with_transformers_to_rounding(model, prompt, whole):
    """What a worker runs (attention "auto"): the C++ kernel, which sums in its own order, in
    bfloat16 on a CPU with AVX-512 BF16 and in float32 on one with AVX2 and FMA or AVX-512;
    elsewhere torch's SDPA, as transformers runs it."""
    engine_ = LayerwisePrefill(Llama.from_hf(model))
    cpu_fits = machine.has_bf16() if model.dtype == torch.bfloat16 else machine.has_float_vectors()
    assert engine_.kernel == (cpu_fits and kernels.load())
    result = engine_.run(prompt)
    assert_close_to_scale(result.kv, whole[0])
    assert_close_to_scale(result.logits, whole[1], model.dtype)
    assert greedy_continuation(model, result.kv, result.logits) == greedy_continuation(model, *whole)
    if not engine_.kernel:
        assert torch.equal(result.kv, whole[0])


@pytest.mark.parametrize("chunk", [1000, 64, 100, 299, 17])
def test_chunked_equals_unchunked(model, prompt, whole, chunk):
    result = LayerwisePrefill(Llama.from_hf(model), chunk_tokens=chunk).run(prompt)
    assert_close_to_scale(result.kv, whole[0])
    assert_close_to_scale(result.logits, whole[1], model.dtype)
    assert greedy_continuation(model, result.kv, result.logits) == greedy_continuation(model, *whole)


def test_prefix_is_loaded_layer_by_layer_and_only_the_rest_computed(model, prompt, whole):
    prefix = SlowPrefix(whole[0][:, :, :, :120].clone())
    sink = KvAssembly(4, 2, len(prompt), 16)  # the decode side assembling what arrives
    result = LayerwisePrefill(Llama.from_hf(model), chunk_tokens=64).run(prompt, prefix=prefix, sink=sink)
    assert torch.equal(result.kv[:, :, :, :120], whole[0][:, :, :, :120])
    assert_close_to_scale(result.kv, whole[0])
    assert torch.equal(sink.wait_all(timeout=1), result.kv)  # prefix included
    assert greedy_continuation(model, result.kv, result.logits) == greedy_continuation(model, *whole)


def test_filesink_delivers_the_whole_cache_copy(model, prompt, whole, tmp_path):
    sink = FileSink(tmp_path / "r1.kv", tuple(whole[0].shape), str(whole[0].dtype).removeprefix("torch."))
    result = LayerwisePrefill(Llama.from_hf(model)).run(prompt, sink=sink)
    handle = sink.handle("node-a")
    kv = result.kv
    assert_close_to_scale(kv, whole[0])
    assert torch.equal(kvfiles.read(tmp_path, handle), kv)  # checksum verified by the reader too
    expected = kvfiles.write(tmp_path, "node-a", "copy.kv", kv)
    assert handle.checksum == expected.checksum and handle.shape == expected.shape


def test_filesink_with_prefix_and_chunks_matches_the_returned_kv(model, prompt, whole, tmp_path):
    sink = FileSink(tmp_path / "r2.kv", tuple(whole[0].shape), str(whole[0].dtype).removeprefix("torch."))
    result = LayerwisePrefill(Llama.from_hf(model), chunk_tokens=50).run(prompt, prefix=whole[0][:, :, :, :37], sink=sink)
    assert torch.equal(kvfiles.read(tmp_path, sink.handle("n")), result.kv)


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_pipelined_equals_single_instance(model, prompt, whole, workers):
    chunked = LayerwisePrefill(Llama.from_hf(model), chunk_tokens=64)
    single = chunked.run(prompt)
    sink = KvAssembly(4, 2, len(prompt), 16)
    piped = pipelined_prefill(chunked, prompt, workers, sink=sink)
    assert torch.equal(piped.kv, single.kv) and torch.equal(piped.logits, single.logits)
    assert torch.equal(sink.wait_all(timeout=1), single.kv)
    assert_close_to_scale(piped.kv, whole[0])


def test_a_one_chunk_prompt_runs_on_one_worker(model, whole, prompt):
    started = []
    engine_ = LayerwisePrefill(Llama.from_hf(model), chunk_tokens=len(prompt))
    original = engine_.compute_chunk
    engine_.compute_chunk = lambda *a, **k: (started.append(threading.current_thread().name), original(*a, **k))[1]
    piped = pipelined_prefill(engine_, prompt, 2)
    assert started == ["prefill-stage-0"]
    assert torch.equal(piped.kv, LayerwisePrefill(Llama.from_hf(model)).run(prompt).kv)
    assert_close_to_scale(piped.kv, whole[0])


def test_a_failing_sink_aborts_the_prefill(model, prompt):
    with pytest.raises(PrefillAborted, match="link down"):
        LayerwisePrefill(Llama.from_hf(model)).run(prompt, sink=FailingSink(4, 2, len(prompt), 16))


def test_a_prefix_covering_the_whole_prompt_is_refused(model, prompt, whole):
    with pytest.raises(ValueError):
        LayerwisePrefill(Llama.from_hf(model)).run(prompt, prefix=whole[0])


def test_a_bfloat16_file_sink_holds_the_kv_as_computed(tmp_path):
    kv = torch.randn(2, 2, 3, 6, 4).to(torch.bfloat16)
    sink = FileSink(tmp_path / "r3.kv", tuple(kv.shape), "bfloat16")
    for layer in range(2):
        sink.write_layer(layer, 0, kv[layer, :, :, :4])
        sink.write_layer(layer, 4, kv[layer, :, :, 4:])
    sink.finish()
    handle = sink.handle("node-a")
    assert handle.dtype == "bfloat16"
    assert torch.equal(kvfiles.read(tmp_path, handle), kv)
