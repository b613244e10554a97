"""Continuous batching for decode: one model forward per iteration for every running request.

Every running request's KV lives in blocks of one pool (common/engine/paged.py), listed in its
block table; nothing is grown, padded or moved while the batch runs:

    pool blocks   | 0 | 1 | 2 | 3 | 4 | 5 | 6 | 7 | ...
    row 0 (a)     blocks [3, 0, 6]   kv_len 37: the next token's K, V land in block 6, slot 5
    row 1 (b)     blocks [1]         kv_len 9
    row 2 (c)     blocks [5, 2]      kv_len 16: the next lands in block 2, slot 0

A request is given every block of its reservation when it reserves (or joins): its KV so far is
written into them by `load` (from a landed file, `load_file`), on a thread beside the running
steps, and the join itself (`add`) is a few list operations between two steps. The pool is
allocated empty: pages of blocks never written cost nothing.

One `step()` feeds every row its last token at its own position (position id = its kv_len);
each layer's attention is ONE call for the whole batch (common/engine/attention.py): it writes
the new K, V into each row's block and attends each row over exactly its own tokens. Then every
row is sampled with its own settings in one vectorised pass (`common.sampling.sample_rows`).
`remove()` hands a row's blocks back; the last row takes its index, nothing is copied.

Admission: a request reserves `kv_len + tokens it may still generate` (capped by the model's
context) against `kv_budget_tokens`, so a running request never runs out of room; `can_admit()`
checks that and `max_batch`. Both are the decision floor's (`kv_reservation`, `has_room`), which
the simulator counts with too; the late TBT re-check of the design is its `late_verdict`, fed
`admission_state()`. The pool holds the budget plus one block per row of slack (a reservation's
last block is rounded up).

Numerics: the batched attention sums in float32 in its own order, so a row's logits agree with
a sequence decoded alone to rounding, not bit for bit (tests compare tokens alone and logits in
a batch within a stated tolerance); a row's result does not depend on which other rows share
its batch beyond that rounding.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from common import kvfiles
from common.cores import CoreShare
from common.engine.attention import PagedAttention, resolve_backend
from common.engine.llama import Llama
from common.engine.paged import BLOCK, KvPool
from common.sampling import sample_rows
from schemas.route import SamplingParams
from schemas.transfer import KvHandle
from common.decide.admission import has_room, kv_reservation
from common.decide.policy import DecodeCandidate


class BatchFull(RuntimeError):
    """Raised by `add()` or `reserve()` when the request does not fit (max_batch or the KV budget);
    call `can_admit` first."""


@dataclass(frozen=True, slots=True)
class StepResult:
    """One iteration's outcome: the next token of every row that could sample one, and the rows that
    could not (request_id -> why). A failed row stays in the batch until the caller removes it."""

    tokens: dict[str, int]
    errors: dict[str, str]


@dataclass(frozen=True, slots=True)
class RowKv:
    """A request's KV written into its blocks (`BatchEngine.load`): what `add` joins."""

    request_id: str
    kv_len: int


@dataclass
class _Held:
    """Room a request holds: its tokens against the budget and its blocks in the pool."""

    tokens: int
    kv_len: int
    blocks: list[int]


@dataclass
class _Row:
    request_id: str
    sampling: SamplingParams
    last_token: int  # fed at the next step
    num_generated: int  # tokens generated so far (the prefill's first token counts)
    reserved: int  # tokens counted against the budget
    blocks: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class StepStats:
    """What one iteration cost: a sample for fitting the decode step-time model."""

    batch: int
    context_tokens: int  # sum of the rows' KV lengths read by the step
    seconds: float


class BatchEngine:
    def __init__(self, model: Llama, max_batch: int, kv_budget_tokens: int, packed: bool = True,
                 attention: str = "auto", cores: CoreShare | None = None) -> None:
        if max_batch < 1 or kv_budget_tokens < 1:
            raise ValueError("max_batch and kv_budget_tokens must be >= 1")
        self.model = model
        self.packed = model.packed() if packed else None  # the projections on oneDNN's packed weights
        self.attention = resolve_backend(attention)  # kernel | padded | rows
        self.norm_kernel = self.attention == "kernel" and model.norm_kernel()  # the norms on kernels/norm.cpp
        self.cores = cores  # None: torch's threads as set; else each step takes this worker's share of the cores
        self.max_batch = max_batch
        self.kv_budget_tokens = kv_budget_tokens
        self.max_context = model.max_context
        self.num_layers, self.num_kv_heads, self.head_dim = model.num_layers, model.num_kv_heads, model.head_dim
        self.device, self.dtype = model.device, model.dtype
        self.pool = KvPool(self.num_layers, self.num_kv_heads, self.head_dim,
                           KvPool.blocks_for(kv_budget_tokens) + max_batch, self.dtype, self.device)
        self.lock = threading.Lock()  # the pool's free list and `held`: loads run on threads
        self.rows: list[_Row] = []  # row index -> _Row
        self.index: dict[str, int] = {}  # request_id -> row index
        self.kv_lens = torch.zeros(0, dtype=torch.long)  # row index -> tokens in its KV
        self.reserved_tokens = 0  # of the running rows and of `pending`
        self.pending: dict[str, _Held] = {}  # request_id -> room held from `reserve` to `add`
        self.loading: dict[str, int] = {}  # request_id -> loads of its KV under way (on threads)
        self.orphaned: dict[str, list[int]] = {}  # request_id -> blocks freed while a load still writes them
        self.tables: torch.Tensor | None = None  # [B, max blocks] int32, rebuilt when rows or their blocks change
        self.last_step: StepStats | None = None

    @classmethod
    def for_memory(cls, model: Llama, max_batch: int, kv_cache_bytes: int, **kwargs) -> "BatchEngine":
        """An engine whose pool takes `kv_cache_bytes` (K and V of every layer, in the model's
        dtype): the budget is what is left of it after one block of slack per row."""
        per_block = 2 * model.num_layers * model.num_kv_heads * model.head_dim * BLOCK * model.embed.element_size()
        blocks = kv_cache_bytes // per_block - max_batch
        if blocks < 1:
            raise ValueError(f"{kv_cache_bytes} bytes of KV cannot hold a block beyond {max_batch} rows' slack "
                             f"({per_block} bytes a block of {BLOCK} tokens)")
        return cls(model, max_batch, blocks * BLOCK, **kwargs)

    # ------------------------------------------------------------------ admission

    @property
    def num_running(self) -> int:
        return len(self.rows)

    @property
    def context_tokens(self) -> int:
        return int(self.kv_lens.sum())

    @property
    def kv_cache_bytes(self) -> int:
        """The pool's size in bytes (every block, K and V of every layer)."""
        return 2 * self.pool.k.numel() * self.pool.k.element_size()

    def tokens_needed(self, kv_len: int, sampling: SamplingParams, num_generated: int) -> int:
        """Tokens a request reserves: its KV now plus one per step it may still run.

        Each step feeds one token (its K, V join the cache) and yields the next, so a request at
        `num_generated` of `max_tokens` runs `max_tokens - num_generated` more steps.
        """
        return kv_reservation(kv_len, sampling.max_tokens, num_generated, self.max_context)

    def can_admit(self, num_tokens: int) -> bool:
        return has_room(len(self.rows) + len(self.pending), self.max_batch, self.reserved_tokens, num_tokens,
                        self.kv_budget_tokens)

    def reserve(self, request_id: str, num_tokens: int, kv_len: int = 0) -> None:
        """Hold a row, `num_tokens` of the budget and their blocks for a request whose KV (`kv_len`
        tokens) is on its way (`load` writes it, `add` takes the room over; `remove` gives it back).
        `admission_state` counts it in the batch already: it steps with it from its join on."""
        if request_id in self.index or request_id in self.pending:
            raise ValueError(f"request {request_id} already holds room")
        if not self.can_admit(num_tokens):
            raise BatchFull(f"request {request_id}: {num_tokens} tokens do not fit ({self._room()})")
        blocks = self._allocate(request_id, max(num_tokens, kv_len + 1))
        self.pending[request_id] = _Held(num_tokens, kv_len, blocks)
        self.reserved_tokens += num_tokens

    def admission_state(self, instance_id: str = "", node: str = "", step_factor: float = 1.0) -> DecodeCandidate:
        """This engine as the conductor sees a decode instance (heartbeats, `late_verdict`)."""
        joining = sum(held.kv_len for held in self.pending.values())
        return DecodeCandidate(instance_id, node, len(self.rows) + len(self.pending), self.context_tokens + joining,
                               self.kv_budget_tokens - self.reserved_tokens, step_factor)

    def _room(self) -> str:
        return (f"{len(self.rows)} running and {len(self.pending)} joining of {self.max_batch} rows, "
                f"{self.reserved_tokens}/{self.kv_budget_tokens} tokens")

    def _allocate(self, request_id: str, tokens: int) -> list[int]:
        with self.lock:
            blocks = self.pool.allocate(KvPool.blocks_for(tokens))
        if blocks is None:  # the budget's slack is one block per row: only a caller past its reservation gets here
            raise BatchFull(f"request {request_id}: no {KvPool.blocks_for(tokens)} free blocks in the pool "
                            f"({self.pool.num_free} free)")
        return blocks

    def _release(self, request_id: str, blocks: list[int]) -> None:
        with self.lock:
            if self.loading.get(request_id):  # a load still writes them: freed when it ends
                self.orphaned.setdefault(request_id, []).extend(blocks)
            else:
                self.pool.release(blocks)

    # ------------------------------------------------------------------ membership

    # NOTE: the pool is written under inference mode (steps and loads run on worker threads; the
    # service calls add/remove/kv_of on its event-loop thread), and a tensor made inside the mode
    # cannot be written in place outside it.
    @torch.inference_mode()
    def load(self, request_id: str, prompt_kv: torch.Tensor, sampling: SamplingParams,
             num_generated: int = 1) -> RowKv:
        """Write a request's KV so far (prompt_kv [L, 2, H, S, D]) into the blocks it reserved.
        Any thread, beside running steps."""
        return self._load(request_id, tuple(prompt_kv.shape), sampling, num_generated,
                          lambda blocks: self.pool.write(blocks, prompt_kv.to(self.dtype)))

    @torch.inference_mode()
    def load_file(self, request_id: str, shm_dir, handle: KvHandle, sampling: SamplingParams,
                  num_generated: int = 1, remove: bool = False) -> RowKv:
        """A landed KV file, checked (`kvfiles.read_into`), written into the blocks the request
        reserved; a file in another dtype or shape than the model's is refused (ValueError), as
        the cluster's layout check refuses such an instance. Any thread, as `load`."""
        def write(blocks: list[int]) -> None:
            kv = torch.empty(tuple(handle.shape), dtype=self.dtype, device=self.device)
            kvfiles.read_into(shm_dir, handle, kv, remove)
            self.pool.write(blocks, kv)

        return self._load(request_id, tuple(handle.shape), sampling, num_generated, write)

    def _load(self, request_id: str, shape: tuple, sampling: SamplingParams, num_generated: int, write) -> RowKv:
        num_layers, _, heads, kv_len, head_dim = shape
        if (num_layers, heads, head_dim) != (self.num_layers, self.num_kv_heads, self.head_dim):
            raise ValueError(f"KV shape {shape} does not fit the model")
        if kv_len >= self.max_context:
            raise ValueError(f"{kv_len} tokens leave no room in context {self.max_context}")
        with self.lock:
            held = self.pending.get(request_id)
            if held is None:  # never reserved, or removed meanwhile (a hand-back while its load was queued)
                raise ValueError(f"request {request_id} holds no room in the batch")
            need = KvPool.blocks_for(max(self.tokens_needed(kv_len, sampling, num_generated), kv_len + 1))
            if need > len(held.blocks):  # more KV than it reserved for
                more = self.pool.allocate(need - len(held.blocks))
                if more is None:
                    raise BatchFull(f"request {request_id}: no room for {kv_len} tokens in the pool")
                held.blocks.extend(more)
            held.kv_len = kv_len
            self.loading[request_id] = self.loading.get(request_id, 0) + 1
            blocks = list(held.blocks)
        try:
            write(blocks)
        finally:
            with self.lock:
                self.loading[request_id] -= 1
                if not self.loading[request_id]:
                    del self.loading[request_id]
                    self.pool.release(self.orphaned.pop(request_id, []))
        return RowKv(request_id, kv_len)

    def add(self, request_id: str, prompt_kv: torch.Tensor | RowKv, last_token: int, sampling: SamplingParams,
            num_generated: int = 1) -> None:
        """Join a request: prompt_kv is its whole KV so far, [L, 2, H, S, D] (reserved and loaded
        here), or already in its blocks (`reserve`, then `load` or `load_file`); last_token is fed
        next. Takes over the room `reserve` held."""
        if request_id in self.index:
            raise ValueError(f"request {request_id} is already running")
        if not isinstance(prompt_kv, RowKv):
            kv_len = prompt_kv.shape[3]
            if request_id not in self.pending:
                self.reserve(request_id, self.tokens_needed(kv_len, sampling, num_generated), kv_len)
            try:
                prompt_kv = self.load(request_id, prompt_kv, sampling, num_generated)
            except ValueError as exc:
                raise ValueError(f"request {request_id}: {exc}") from None
        row = prompt_kv
        if row.request_id != request_id:
            raise ValueError(f"KV loaded for {row.request_id} cannot join as {request_id}")
        reserved = self.tokens_needed(row.kv_len, sampling, num_generated)
        held = self.pending.pop(request_id)
        self.reserved_tokens -= held.tokens
        if not self.can_admit(reserved) or KvPool.blocks_for(row.kv_len + 1) > len(held.blocks):
            self.pending[request_id] = held  # still its own: the caller decides whether to give it back
            self.reserved_tokens += held.tokens
            raise BatchFull(f"request {request_id}: {reserved} tokens do not fit ({self._room()})")
        self.rows.append(_Row(request_id, sampling, last_token, num_generated, reserved, held.blocks))
        self.index[request_id] = len(self.rows) - 1
        self.kv_lens = torch.cat((self.kv_lens, torch.tensor([row.kv_len])))
        self.reserved_tokens += reserved
        self.tables = None

    def remove(self, request_id: str) -> None:
        """Drop a finished or cancelled request, or the room reserved for it (a no-op for an unknown id)."""
        held = self.pending.pop(request_id, None)
        if held is not None:
            self.reserved_tokens -= held.tokens
            self._release(request_id, held.blocks)
        row = self.index.pop(request_id, None)
        if row is None:
            return
        gone = self.rows[row]
        self.reserved_tokens -= gone.reserved
        self._release(request_id, gone.blocks)
        last = len(self.rows) - 1
        if row != last:  # keep rows contiguous: the last row takes the freed index
            self.kv_lens[row] = self.kv_lens[last]
            self.rows[row] = self.rows[last]
            self.index[self.rows[row].request_id] = row
        self.rows.pop()
        self.kv_lens = self.kv_lens[:last].clone()
        self.tables = None

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.index

    def kv_of(self, request_id: str) -> torch.Tensor:
        """A copy of the request's KV so far, [L, 2, H, kv_len, D] (e.g. to store it in the pool)."""
        return self.kv_span(request_id, 0, self.kv_len(request_id))

    def kv_span(self, request_id: str, start: int, end: int) -> torch.Tensor:
        """A copy of tokens [start, end) of the request's KV, [L, 2, H, end - start, D]."""
        row = self.index[request_id]
        if not 0 <= start <= end <= int(self.kv_lens[row]):
            raise ValueError(f"request {request_id}: span [{start}, {end}) outside its {int(self.kv_lens[row])} tokens")
        return self.pool.read(self.rows[row].blocks, start, end)

    def kv_len(self, request_id: str) -> int:
        return int(self.kv_lens[self.index[request_id]])

    def num_generated(self, request_id: str) -> int:
        return self.rows[self.index[request_id]].num_generated

    # ------------------------------------------------------------------ the iteration

    @torch.inference_mode()
    def step(self) -> StepResult:
        """One forward for every running row; each row's next token, or why it could not get one.

        A row that cannot sample (broken logits) is reported in `errors`; the others carry on. If
        the forward itself raises, nothing changed: the KV written at each row's position is
        overwritten by the next step, since kv_lens only moves after a successful forward.
        """
        if not self.rows:
            return StepResult({}, {})
        started = time.perf_counter()
        batch = len(self.rows)
        context = self.context_tokens
        for row, kv_len in zip(self.rows, self.kv_lens.tolist()):
            if kv_len >= len(row.blocks) * BLOCK:  # stepped past its reservation (a caller ignoring max_tokens)
                self._grow(row, kv_len)
        if self.cores is not None:
            self.cores.claim()
        try:
            logits = self._forward(batch)
            result = self._sample(logits)
        finally:
            if self.cores is not None:
                self.cores.release()
        self.kv_lens += 1
        self.last_step = StepStats(batch, context, time.perf_counter() - started)
        return result

    def _forward(self, batch: int) -> torch.Tensor:
        model = self.model
        positions = self.kv_lens.to(self.device)  # [B]: each row's new token sits at its kv_len
        tokens = torch.tensor([[r.last_token] for r in self.rows], device=self.device)
        hidden = model.embed_tokens(tokens)
        cos, sin = model.rope(positions[:, None])
        cache = PagedAttention(self.pool, self._tables(), positions, self.attention)
        # NOTE: one float32 row on one thread is the one case where MKL's dense GEMV beat the packed
        # weights here; in bfloat16 the packed ones win there too (11 ms a step against 33 dense)
        packed = self.packed if batch > 1 or torch.get_num_threads() > 1 or self.dtype != torch.float32 else None
        for idx in range(model.num_layers):
            hidden = model.layer(idx, hidden, cos, sin, cache, packed, self.norm_kernel)
        return model.logits(hidden, packed, self.norm_kernel)  # [B, vocab], float32

    def _tables(self) -> torch.Tensor:
        if self.tables is None:
            width = max(len(r.blocks) for r in self.rows)
            tables = torch.zeros((len(self.rows), width), dtype=torch.int32)
            for i, row in enumerate(self.rows):
                tables[i, : len(row.blocks)] = torch.tensor(row.blocks, dtype=torch.int32)
            self.tables = tables
        return self.tables

    def _grow(self, row: _Row, kv_len: int) -> None:
        if kv_len >= self.max_context:
            raise ValueError(f"a row of {kv_len} tokens is at the model's context {self.max_context}")
        row.blocks.extend(self._allocate(row.request_id, BLOCK))
        self.tables = None

    def _sample(self, logits: torch.Tensor) -> StepResult:
        picked = sample_rows(logits, [r.sampling for r in self.rows], [r.num_generated for r in self.rows])
        tokens, errors = {}, {}
        for row, token in zip(self.rows, picked):
            if isinstance(token, str):
                errors[row.request_id] = token
                continue
            row.last_token = token
            row.num_generated += 1
            tokens[row.request_id] = token
        return StepResult(tokens, errors)
