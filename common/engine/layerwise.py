"""Layer-by-layer prefill for LLaMA-family models: prefix loaded ahead, new KV streamed out, chunks, pipeline.

We walk the model's layers ourselves (common/engine/llama.py: embeddings, rotary tables, causal
mask, each decoder layer, final norm, lm_head on the last position only) so that work can be
slotted between layers:

    loader thread   put prefix L0 | put prefix L1 | put prefix L2 | ...          (ahead of use)
    compute         ............. | layer 0       | layer 1       | layer 2 ...
    streamer thread                               | sink(L0 new)  | sink(L1 new) ...   close() waits

The request's whole KV is assembled in one `KvAssembly` ([L, 2, H, S, D], the wire layout) with
a per-layer watermark "tokens [0, ready) are in place". Computing tokens [a, b) of layer l waits
for watermark a, writes K, V of [a, b) in place, raises the watermark to b, and hands the slice
to the streamer. Everything that fills the prefix goes through the same watermark:
- a prefix source (cached KV from the pool), loaded by a loader thread;
- earlier chunks of this request (chunked prefill, `prefill_chunk` tokens at a time);
- earlier chunks computed by other instances (chunked pipeline parallelism: chunk i on worker
  i mod X; chunk i's layer l starts as soon as chunk i-1's layer l is in, so workers overlap).

A slice handed to a sink is never written again, so the streamer reads it without a copy.
On CUDA the streamer first copies the slice to pinned host memory on a side stream; the sink
thread waits on that copy's event (written for the GPU path, untested: this tree runs CPU torch).

Attention: in bfloat16 on a CPU with AVX-512 BF16 and in float32 on one with AVX2 and FMA or
AVX-512, the engine's C++ flash attention (kernels/prefill_attention.cpp: in bfloat16 2.3-3x
torch's SDPA on one core, in float32 on AVX2 1.4x; docs/benchmarks.md), which
computes as torch's does but sums in its own order, so a prompt's KV agrees with transformers'
to rounding (tests compare greedy tokens and logits within a tolerance). Elsewhere, or with
`attention="sdpa"`: the first chunk of a prompt without prefix runs the same ops as the plain
transformers forward (sdpa with is_causal); later chunks attend with an explicit mask over prefix
+ chunk, so chunked KV equals unchunked KV to float32 rounding (~1e-6), not bit for bit.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from common import kvfiles, security
from common.cores import CoreShare, helper_thread
from common.engine.llama import KvWriter, Llama
from common.kvfiles import checksum
from schemas.transfer import KvHandle


class PrefillAborted(RuntimeError):
    """Raised by a wait on a `KvAssembly` whose producer failed (the loader, a sink, another worker)."""


class KvSink(Protocol):
    """Where a layer's KV goes (a file, a socket, the next pipeline stage). Called from one streamer thread."""

    def write_layer(self, layer: int, start: int, kv: torch.Tensor) -> None:
        """kv: [2, H, n, D] CPU tensor, tokens [start, start + n) of `layer`; read it before returning."""

    def finish(self) -> None:
        """Every slice has been written (called once by `LayerStreamer.close`)."""


class PrefixSource(Protocol):
    """The cached KV of the first `num_tokens` tokens, one layer at a time."""

    num_tokens: int

    def load_layer(self, layer: int) -> torch.Tensor:
        """[2, H, num_tokens, D] of `layer` (called on the loader thread, in layer order)."""


@dataclass(frozen=True)
class PrefillResult:
    kv: torch.Tensor  # [L, 2, H, S, D]: the whole prompt's KV, prefix included
    logits: torch.Tensor  # [vocab] at the last position
    computed_at: float = 0.0  # perf_counter when the last layer's compute ended (the handoff's tail starts)


class TensorPrefix:
    """A prefix held as one [L, 2, H, p, D] tensor (may be a view of a memory-mapped file)."""

    def __init__(self, kv: torch.Tensor) -> None:
        self.kv = kv
        self.num_tokens = kv.shape[3]

    def load_layer(self, layer: int) -> torch.Tensor:
        return self.kv[layer]


class KvAssembly:
    """One request's KV [L, 2, H, S, D], filled slice by slice, with a per-layer watermark.

    It is also a KvSink, so the receiving side (the decode node, the next pipeline stage) can
    assemble layers as they arrive. NOTE: slices of a layer must arrive in token order.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, num_tokens: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        self.kv = torch.empty((num_layers, 2, num_kv_heads, num_tokens, head_dim), dtype=dtype, device=device)
        self.ready = [0] * num_layers  # layer -> tokens [0, ready) in place
        self.error: BaseException | None = None
        self._cond = threading.Condition()

    def write_layer(self, layer: int, start: int, kv: torch.Tensor) -> None:
        end = start + kv.shape[2]
        self.kv[layer, :, :, start:end].copy_(kv)
        self.mark(layer, start, end)

    def finish(self) -> None:
        pass

    def mark(self, layer: int, start: int, end: int) -> None:
        with self._cond:
            if start != self.ready[layer]:
                raise ValueError(f"layer {layer}: slice [{start}, {end}) arrived with [0, {self.ready[layer]}) in place")
            self.ready[layer] = end
            self._cond.notify_all()

    def fail(self, exc: BaseException) -> None:
        with self._cond:
            self.error = self.error or exc
            self._cond.notify_all()

    def wait(self, layer: int, tokens: int, timeout: float | None = None) -> None:
        """Block until tokens [0, tokens) of `layer` are in place."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.ready[layer] >= tokens or self.error is not None, timeout):
                raise TimeoutError(f"layer {layer}: waited {timeout}s for {tokens} tokens, have {self.ready[layer]}")
            if self.error is not None:
                raise PrefillAborted(f"layer {layer}: a producer failed: {self.error!r}") from self.error

    def wait_all(self, timeout: float | None = None) -> torch.Tensor:
        for layer in range(len(self.ready)):
            self.wait(layer, self.kv.shape[3], timeout)
        return self.kv


class FileSink:
    """Writes each slice at its offset in one preallocated [L, 2, H, S, D] file in the KV's dtype (kvfiles' layout).

    The file is filled under a temporary name and renamed by `finish()`, so readers never see a
    half-written one; `handle(node)` then describes it like `kvfiles.write` does.
    """

    def __init__(self, path: Path, shape: tuple[int, int, int, int, int], dtype: str = "float32") -> None:
        self.path = Path(path)
        self.shape = tuple(shape)
        self.dtype = dtype
        self.tmp = self.path.with_name(f".{self.path.name}.tmp")
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = security.open_own(self.tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL)  # new: never through a planted link
        np_dtype = kvfiles.numpy_dtype(dtype)
        with open(fd, "r+b") as f:
            f.truncate(int(np.prod(self.shape)) * np_dtype.itemsize)
            self.array = np.memmap(f, np_dtype, "r+", shape=self.shape)  # the mapping outlives the file object
        self._checksum: int | None = None

    def write_layer(self, layer: int, start: int, kv: torch.Tensor) -> None:
        self.array[layer, :, :, start : start + kv.shape[2]] = kvfiles.as_array(kv)

    def finish(self) -> None:
        self.array.flush()
        self._checksum = checksum(self.array)
        self.array = None  # unmaps
        os.replace(self.tmp, self.path)

    def discard(self) -> None:
        """Drop the file, finished or not (the prefill failed, or the request ended at its first token)."""
        self.array = None
        self.tmp.unlink(missing_ok=True)
        self.path.unlink(missing_ok=True)

    def handle(self, node: str) -> KvHandle:
        if self._checksum is None:
            raise RuntimeError("FileSink.handle() before finish()")
        return KvHandle(node, self.path.name, list(self.shape), self.dtype, self._checksum)


class LayerStreamer:
    """Runs a sink on a background thread, so a layer's KV is copied out while the next computes."""

    _DONE = object()

    def __init__(self, sink: KvSink) -> None:
        self.sink = sink
        self.error: BaseException | None = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._side = torch.cuda.Stream() if torch.cuda.is_available() else None
        self._thread = threading.Thread(target=self._run, name="kv-streamer", daemon=True)
        self._thread.start()

    def submit(self, layer: int, start: int, kv: torch.Tensor) -> None:
        if self.error is not None:
            raise PrefillAborted(f"the KV sink failed: {self.error!r}") from self.error
        event = None
        if kv.is_cuda:  # copy to pinned host memory on a side stream; the sink thread waits for it
            self._side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._side):
                host = torch.empty(kv.shape, dtype=kv.dtype, pin_memory=True)
                host.copy_(kv, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
            kv = host
        self._queue.put((layer, start, kv, event))

    def close(self) -> None:
        """Wait for every submitted slice, then finish the sink; re-raises a sink failure."""
        self._queue.put(self._DONE)
        self._thread.join()
        if self.error is not None:
            raise PrefillAborted(f"the KV sink failed: {self.error!r}") from self.error
        self.sink.finish()

    def _run(self) -> None:
        helper_thread()
        while (item := self._queue.get()) is not self._DONE:
            if self.error is not None:
                continue  # drain
            layer, start, kv, event = item
            try:
                if event is not None:
                    event.synchronize()
                self.sink.write_layer(layer, start, kv)
            except BaseException as exc:  # noqa: BLE001 - handed to the compute thread
                self.error = exc


class LayerwisePrefill:
    """Prefill of one LLaMA-family model, layer by layer. One instance per model; thread-safe per call."""

    def __init__(self, model: Llama, chunk_tokens: int = 0, cores: CoreShare | None = None,
                 attention: str = "auto") -> None:
        self.model = model
        self.kernel = model.prefill_kernel(attention)  # the C++ flash attention, else torch's SDPA
        self.chunk_tokens = chunk_tokens  # 0 = the whole prompt at once
        self.cores = cores  # None: torch's threads as set; else each layer takes this worker's share of the cores
        self.num_layers, self.num_kv_heads, self.head_dim = model.num_layers, model.num_kv_heads, model.head_dim
        self.device, self.dtype = model.device, model.dtype

    def new_assembly(self, num_tokens: int) -> KvAssembly:
        return KvAssembly(self.num_layers, self.num_kv_heads, num_tokens, self.head_dim, self.dtype, self.device)

    def chunks(self, start: int, end: int) -> list[tuple[int, int]]:
        step = self.chunk_tokens or (end - start)
        return [(a, min(a + step, end)) for a in range(start, end, step)]

    @torch.inference_mode()
    def run(self, token_ids: list[int], prefix: PrefixSource | torch.Tensor | None = None,
            sink: KvSink | None = None, send_prefix: bool = True) -> PrefillResult:
        """Prefill `token_ids` (prefix tokens included). The sink gets every layer's KV, prefix too
        unless send_prefix=False; it has all of it when this returns."""
        if isinstance(prefix, torch.Tensor):
            prefix = TensorPrefix(prefix)
        num_prefix = prefix.num_tokens if prefix is not None else 0
        if not 0 <= num_prefix < len(token_ids):
            raise ValueError(f"prefix of {num_prefix} tokens for a prompt of {len(token_ids)}: nothing to compute")
        kv = self.new_assembly(len(token_ids))
        streamer = LayerStreamer(sink) if sink is not None else None
        loader = None
        if prefix is not None and num_prefix:
            loader = threading.Thread(target=self._load_prefix, args=(prefix, kv, streamer if send_prefix else None),
                                      name="kv-prefix-loader", daemon=True)
            loader.start()
        try:
            for a, b in self.chunks(num_prefix, len(token_ids)):
                logits = self.compute_chunk(token_ids, a, b, kv, streamer)
            computed_at = time.perf_counter()
        except BaseException as exc:
            kv.fail(exc)  # unblocks the loader
            raise
        finally:
            if self.cores is not None:
                self.cores.release()
            if loader is not None:
                loader.join()
            if streamer is not None:
                streamer.close()
        return PrefillResult(kv.kv, logits, computed_at)

    @torch.inference_mode()
    def compute_chunk(self, token_ids: list[int], start: int, end: int, kv: KvAssembly,
                      streamer: LayerStreamer | None = None) -> torch.Tensor:
        """Compute tokens [start, end) into `kv`, waiting per layer for tokens [0, start) to be there.

        Returns the logits [vocab] of position end - 1. This is the unit a pipeline worker runs.
        """
        model = self.model
        positions = torch.arange(start, end, device=self.device)[None, :]
        hidden = model.embed_tokens(torch.tensor([token_ids[start:end]], device=self.device))
        cos, sin = model.rope(positions)
        cache = _SpanCache(kv.kv, start, end, None if self.kernel else self._mask(start, end), self.kernel)
        for layer_idx in range(model.num_layers):
            kv.wait(layer_idx, start)
            if self.cores is not None:
                self.cores.claim()
            hidden = model.layer(layer_idx, hidden, cos, sin, cache)
            kv.mark(layer_idx, start, end)
            if streamer is not None:
                streamer.submit(layer_idx, start, kv.kv[layer_idx, :, :, start:end])
        return model.logits(hidden)[0]

    def _mask(self, start: int, end: int) -> torch.Tensor | None:
        """Causal mask of queries [start, end) over keys [0, end); None for a first chunk (sdpa's is_causal)."""
        if start == 0:
            return None
        keys = torch.arange(end, device=self.device)
        return (keys[None, :] <= torch.arange(start, end, device=self.device)[:, None])[None, None]

    @torch.inference_mode()
    def _load_prefix(self, prefix: PrefixSource, kv: KvAssembly, streamer: LayerStreamer | None) -> None:
        helper_thread()
        p = prefix.num_tokens
        try:
            for layer in range(self.num_layers):
                if kv.error is not None:
                    return
                kv.kv[layer, :, :, :p].copy_(prefix.load_layer(layer))
                if streamer is not None:  # NOTE: queued before it counts as in place, so that the
                    streamer.submit(layer, 0, kv.kv[layer, :, :, :p])  # layer's computed slice cannot overtake it
                kv.mark(layer, 0, p)
        except BaseException as exc:  # noqa: BLE001 - surfaces in the compute thread's wait
            kv.fail(exc)


class _SpanCache(KvWriter):
    """The cache a decoder layer sees while tokens [start, end) are computed: their K, V are
    written into the assembly in place, and they attend over [0, end) (`Llama.causal_attention`:
    the kernel, or SDPA with `mask`, None for a first chunk, whose causal attention needs none)."""

    def __init__(self, kv: torch.Tensor, start: int, end: int, mask: torch.Tensor | None, kernel: bool) -> None:
        self.kv, self.start, self.end, self.mask, self.kernel = kv, start, end, mask, kernel

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, idx: int, model) -> torch.Tensor:
        layer = self.kv[idx]
        layer[0, :, self.start : self.end] = k[0]
        layer[1, :, self.start : self.end] = v[0]
        return model.causal_attention(q, layer[0, :, : self.end], layer[1, :, : self.end], self.start, self.mask,
                                      self.kernel)


def pipelined_prefill(engine: LayerwisePrefill, token_ids: list[int], num_workers: int, sink: KvSink | None = None,
                      threads_per_worker: int = 0) -> PrefillResult:
    """Chunked pipeline parallelism in one process: chunk i runs on worker thread i mod num_workers.

    Each worker waits, layer by layer, for the KV of the chunks before its own, so chunk i+1's
    layer l runs while chunk i computes layer l+1. All workers share one KvAssembly here; across
    instances each would hold its own, filled by the previous stage's sink. threads_per_worker > 0
    sets each worker thread's torch intra-op threads (OpenMP's setting is per calling thread).
    """
    if num_workers < 1:
        raise ValueError("num_workers must be >= 1")
    chunks = engine.chunks(0, len(token_ids))
    kv = engine.new_assembly(len(token_ids))
    streamer = LayerStreamer(sink) if sink is not None else None
    logits: dict[int, torch.Tensor] = {}

    def work(worker: int) -> None:
        if threads_per_worker:
            torch.set_num_threads(threads_per_worker)
        try:
            for i in range(worker, len(chunks), num_workers):
                logits[i] = engine.compute_chunk(token_ids, *chunks[i], kv, streamer)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            kv.fail(exc)

    threads_before = torch.get_num_threads()  # NOTE: torch also records the last setting process-wide
    workers = [threading.Thread(target=work, args=(w,), name=f"prefill-stage-{w}", daemon=True)
               for w in range(min(num_workers, len(chunks)))]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    torch.set_num_threads(threads_before)
    if streamer is not None:
        streamer.close()
    if kv.error is not None:
        raise PrefillAborted(f"a pipeline stage failed: {kv.error!r}") from kv.error
    return PrefillResult(kv.kv, logits[len(chunks) - 1])
