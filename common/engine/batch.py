"""Continuous batching for decode: one model forward per iteration for every running request.

Each running request is a row of one right-padded KV buffer, allocated once and grown in
chunks (never re-padded per step):

    kv  [num_layers, 2 (K, V), rows_cap, num_kv_heads, tokens_cap, head_dim]

    row 0  | t0 t1 t2 t3 t4 t5 . . . . |   kv_len 6: the next token's K, V land at 6
    row 1  | t0 t1 t2 . . . . . . . . |   kv_len 3
    row 2  | t0 t1 t2 t3 t4 t5 t6 t7 . |   kv_len 8
             <------ width = max kv_len + 1 ------>   (the buffer holds at least this)

One `step()` feeds every row its last token at its own position (position id = its kv_len),
writes the new K, V in place at that position, attends each row over exactly its own tokens
(no padding is read), and samples every row with its own settings (greedy rows by one batched
argmax, the others through `common.sampling.sample`, seeded per (seed, step) as in prefill).
Rows stay contiguous: `remove()` moves the last row into the freed slot.

Admission: a request reserves `kv_len + tokens it may still generate` (capped by the model's
context) against `kv_budget_tokens`, so a running request never runs out of room; `can_admit()`
checks that and `max_batch`. Both are the decision floor's (`kv_reservation`, `has_room`), which
the simulator counts with too; the late TBT re-check of ARCHITECTURE.md is its `late_verdict`,
fed `admission_state()`.
NOTE: the budget counts reserved tokens, not the padded buffer: with very ragged lengths the
buffer holds up to rows * (longest + grow) tokens.

Numerics: attention runs per row over the row's own length, the kernel a sequence decoded alone
runs, so a row's result does not depend on its batch; measured here, logits equal per-sequence
decoding bit for bit in bfloat16 (oneDNN's bf16 matmuls give the same row for M=1 and M=B) and
to ~1e-6 in float32 (whose M=1 kernel differs in the last bits). Tests check tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from common.engine.llama import KvWriter, Llama
from common.sampling import SamplingError, is_greedy, sample
from schemas.route import SamplingParams
from common.decide.admission import has_room, kv_reservation
from common.decide.policy import DecodeCandidate


class BatchFull(RuntimeError):
    """Raised by `add()` when the request does not fit (max_batch or the KV budget); call `can_admit` first."""


@dataclass(frozen=True, slots=True)
class StepResult:
    """One iteration's outcome: the next token of every row that could sample one, and the rows that
    could not (request_id -> why). A failed row stays in the batch until the caller removes it."""

    tokens: dict[str, int]
    errors: dict[str, str]


@dataclass
class _Row:
    request_id: str
    sampling: SamplingParams
    last_token: int  # fed at the next step
    num_generated: int  # tokens generated so far (the prefill's first token counts)
    reserved: int  # tokens counted against the budget


@dataclass(frozen=True, slots=True)
class StepStats:
    """What one iteration cost: a sample for fitting the decode step-time model."""

    batch: int
    context_tokens: int  # sum of the rows' KV lengths read by the step
    seconds: float


class BatchEngine:
    def __init__(self, model: Llama, max_batch: int, kv_budget_tokens: int, grow_tokens: int = 256,
                 packed: bool = True) -> None:
        if max_batch < 1 or kv_budget_tokens < 1 or grow_tokens < 1:
            raise ValueError("max_batch, kv_budget_tokens and grow_tokens must be >= 1")
        self.model = model
        self.packed = model.packed() if packed else None  # the projections on oneDNN's packed weights
        self.max_batch = max_batch
        self.kv_budget_tokens = kv_budget_tokens
        self.grow_tokens = grow_tokens
        self.max_context = model.max_context
        self.num_kv_heads, self.head_dim = model.num_kv_heads, model.head_dim
        self.device, self.dtype = model.device, model.dtype
        self.rows: list[_Row] = []  # row index -> _Row
        self.index: dict[str, int] = {}  # request_id -> row index
        self.kv_lens = torch.zeros(0, dtype=torch.long)  # row index -> tokens in its KV
        self.kv = self._alloc(1, grow_tokens)
        self.reserved_tokens = 0
        self.last_step: StepStats | None = None

    # ------------------------------------------------------------------ admission

    @property
    def num_running(self) -> int:
        return len(self.rows)

    @property
    def context_tokens(self) -> int:
        return int(self.kv_lens.sum())

    def tokens_needed(self, kv_len: int, sampling: SamplingParams, num_generated: int) -> int:
        """Tokens a request reserves: its KV now plus one per step it may still run.

        Each step feeds one token (its K, V join the cache) and yields the next, so a request at
        `num_generated` of `max_tokens` runs `max_tokens - num_generated` more steps.
        """
        return kv_reservation(kv_len, sampling.max_tokens, num_generated, self.max_context)

    def can_admit(self, num_tokens: int) -> bool:
        return has_room(len(self.rows), self.max_batch, self.reserved_tokens, num_tokens, self.kv_budget_tokens)

    def admission_state(self, instance_id: str = "", node: str = "", step_factor: float = 1.0) -> DecodeCandidate:
        """This engine as the conductor sees a decode instance (heartbeats, `late_verdict`)."""
        return DecodeCandidate(instance_id, node, len(self.rows), self.context_tokens,
                               self.kv_budget_tokens - self.reserved_tokens, step_factor)

    # ------------------------------------------------------------------ membership

    # NOTE: every method that touches the KV buffer runs under inference mode. The service calls
    # add/remove/kv_of on its event-loop thread and step on a worker thread: a buffer grown inside
    # one mode and written in place outside it is what crashed the live decode instance.
    @torch.inference_mode()
    def add(self, request_id: str, prompt_kv: torch.Tensor, last_token: int, sampling: SamplingParams,
            num_generated: int = 1) -> None:
        """Join a request: prompt_kv [L, 2, H, S, D] (its whole KV so far), last_token is fed next."""
        if request_id in self.index:
            raise ValueError(f"request {request_id} is already running")
        num_layers, _, heads, kv_len, head_dim = prompt_kv.shape
        if (num_layers, heads, head_dim) != (self.kv.shape[0], self.num_kv_heads, self.head_dim):
            raise ValueError(f"request {request_id}: KV shape {tuple(prompt_kv.shape)} does not fit the model")
        if kv_len >= self.max_context:
            raise ValueError(f"request {request_id}: {kv_len} tokens leave no room in context {self.max_context}")
        reserved = self.tokens_needed(kv_len, sampling, num_generated)
        if not self.can_admit(reserved):
            raise BatchFull(f"request {request_id}: {reserved} tokens do not fit "
                            f"({len(self.rows)}/{self.max_batch} rows, {self.reserved_tokens}/{self.kv_budget_tokens} tokens)")
        row = len(self.rows)
        self._ensure(row + 1, kv_len + 1)
        self.kv[:, :, row, :, :kv_len] = prompt_kv.to(self.device, self.dtype)
        self.kv[:, :, row, :, kv_len:] = 0  # keeps the invariant (see _ensure)
        self.rows.append(_Row(request_id, sampling, last_token, num_generated, reserved))
        self.index[request_id] = row
        self.kv_lens = torch.cat((self.kv_lens, torch.tensor([kv_len])))
        self.reserved_tokens += reserved

    @torch.inference_mode()
    def remove(self, request_id: str) -> None:
        """Drop a finished or cancelled request (a no-op for an unknown id)."""
        row = self.index.pop(request_id, None)
        if row is None:
            return
        self.reserved_tokens -= self.rows[row].reserved
        last = len(self.rows) - 1
        if row != last:  # keep rows contiguous: the last row moves into the hole
            n = int(self.kv_lens[last])
            self.kv[:, :, row, :, :n] = self.kv[:, :, last, :, :n]
            self.kv_lens[row] = self.kv_lens[last]
            self.rows[row] = self.rows[last]
            self.index[self.rows[row].request_id] = row
        self.rows.pop()
        self.kv_lens = self.kv_lens[:last].clone()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.index

    @torch.inference_mode()
    def kv_of(self, request_id: str) -> torch.Tensor:
        """A copy of the request's KV so far, [L, 2, H, kv_len, D] (e.g. to store it in the pool)."""
        return self.kv_span(request_id, 0, self.kv_len(request_id))

    def kv_span(self, request_id: str, start: int, end: int) -> torch.Tensor:
        """A copy of tokens [start, end) of the request's KV, [L, 2, H, end - start, D]."""
        row = self.index[request_id]
        if not 0 <= start <= end <= int(self.kv_lens[row]):
            raise ValueError(f"request {request_id}: span [{start}, {end}) outside its {int(self.kv_lens[row])} tokens")
        return self.kv[:, :, row, :, start:end].clone()

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
        width = int(self.kv_lens.max()) + 1
        self._ensure(batch, width)
        logits = self._forward(batch)
        result = self._sample(logits)
        self.kv_lens += 1
        self.last_step = StepStats(batch, context, time.perf_counter() - started)
        return result

    def _forward(self, batch: int) -> torch.Tensor:
        model = self.model
        positions = self.kv_lens.to(self.device)[:, None]  # [B, 1]: each row's new token sits at its kv_len
        tokens = torch.tensor([[r.last_token] for r in self.rows], device=self.device)
        hidden = model.embed_tokens(tokens)
        cos, sin = model.rope(positions)
        cache = _RowsCache(self.kv, batch, positions[:, 0])
        # NOTE: one row on one thread is the one case where MKL's dense GEMV beat the packed weights here
        packed = self.packed if batch > 1 or torch.get_num_threads() > 1 else None
        for idx in range(model.num_layers):
            hidden = model.layer(idx, hidden, cos, sin, cache, packed)
        return model.logits(hidden, packed)  # [B, vocab], float32

    def _sample(self, logits: torch.Tensor) -> StepResult:
        greedy = torch.argmax(logits, dim=-1).tolist()
        # a row is finite when its sum is (NaN and inf carry through; a sum that overflows only
        # sends the row through `sample`, which sanitizes): one pass, where isfinite took three
        finite = torch.isfinite(logits.sum(dim=-1)).tolist()
        tokens, errors = {}, {}
        for i, row in enumerate(self.rows):
            try:
                if is_greedy(row.sampling) and finite[i]:
                    token = greedy[i]
                else:  # sampled, or a greedy row whose logits need sanitizing
                    token = sample(logits[i], row.sampling, step=row.num_generated)
            except SamplingError as exc:
                errors[row.request_id] = str(exc)
                continue
            row.last_token = token
            row.num_generated += 1
            tokens[row.request_id] = token
        return StepResult(tokens, errors)

    # ------------------------------------------------------------------ the buffer

    def _alloc(self, rows: int, tokens: int) -> torch.Tensor:
        shape = (self.model.num_layers, 2, rows, self.num_kv_heads, tokens, self.head_dim)
        return torch.empty(shape, dtype=self.dtype, device=self.device)

    @torch.inference_mode()
    def _ensure(self, rows: int, tokens: int) -> None:
        """Grow the buffer to hold `rows` rows of `tokens` tokens (rows double, tokens grow in chunks).

        NOTE: invariant: every position of a running row holds finite values. Padding is masked,
        but a NaN or inf left there by uninitialised memory would still poison the attention
        (NaN * 0). The buffer is allocated empty, so that rows nobody uses cost no page faults;
        `add` zeroes a new row's tail, and growth zeroes the new tail of the running rows.
        """
        _, _, rows_cap, _, tokens_cap, _ = self.kv.shape
        if rows <= rows_cap and tokens <= tokens_cap:
            return
        new_rows = max(rows_cap, min(max(rows, 2 * rows_cap), self.max_batch))
        new_tokens = max(tokens_cap, -(-tokens // self.grow_tokens) * self.grow_tokens)
        grown = self._alloc(new_rows, new_tokens)
        n = len(self.rows)
        grown[:, :, :n, :, :tokens_cap] = self.kv[:, :, :n]
        grown[:, :, :n, :, tokens_cap:] = 0
        self.kv = grown


class _RowsCache(KvWriter):
    """The batch's cache as a decoder layer sees it.

    Writes the new token's K, V of every row at that row's position, in place, then attends each
    row over exactly its own tokens. NOTE: one attention per row, not one masked attention over
    the padded width: the masked kernel's blocked softmax rounds differently from a sequence's own
    (in bfloat16, enough to flip a near tie), so each row gets exactly what it would alone, and the
    padding costs nothing.
    """

    def __init__(self, kv: torch.Tensor, batch: int, positions: torch.Tensor) -> None:
        self.kv, self.batch, self.positions = kv, batch, positions
        self.rows = torch.arange(batch, device=kv.device)
        self.ends = (positions + 1).tolist()  # row -> its tokens, the new one included

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, idx: int, model) -> torch.Tensor:
        keys, values = self.kv[idx, 0], self.kv[idx, 1]  # [rows_cap, H, tokens_cap, D]
        keys[self.rows, :, self.positions] = k[:, :, 0]
        values[self.rows, :, self.positions] = v[:, :, 0]
        if self.batch == 1:
            return model.attention(q, keys[:1, :, : self.ends[0]], values[:1, :, : self.ends[0]])
        return torch.cat([model.attention(q[r : r + 1], keys[r : r + 1, :, :end], values[r : r + 1, :, :end])
                          for r, end in enumerate(self.ends)])
