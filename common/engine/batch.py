"""Continuous batching for decode: one model forward per iteration for every running request.

Each running request holds its own KV buffer, sized once when it joins to everything it has
reserved (its KV so far plus one token per step it may still run), so nothing is ever grown,
padded or moved while the batch runs:

    row.kv  [num_layers, 2 (K, V), num_kv_heads, capacity, head_dim]

    row 0  | t0 t1 t2 t3 t4 t5 . . |          kv_len 6: the next token's K, V land at 6
    row 1  | t0 t1 t2 . . . . . . . . . . |   kv_len 3
    row 2  | t0 t1 t2 t3 t4 t5 t6 t7 . |     kv_len 8

The buffer is allocated empty: the pages of tokens not yet generated cost nothing until a step
writes them, so the memory in use follows the tokens held, not the reservations. `make_row`
and `row_from_file` build a row's buffer without touching the engine, so the decode service reads
a joining request's KV file into it on a thread beside the running steps, and the join itself
(`add`) is a few list operations between two steps.

One `step()` feeds every row its last token at its own position (position id = its kv_len),
writes the new K, V in place at that position, attends each row over exactly its own tokens,
and samples every row with its own settings (greedy rows by one batched argmax, the others
through `common.sampling.sample`, seeded per (seed, step) as in prefill). `remove()` drops a
row's buffer; the last row takes its index, nothing is copied.

Admission: a request reserves `kv_len + tokens it may still generate` (capped by the model's
context) against `kv_budget_tokens`, so a running request never runs out of room; `can_admit()`
checks that and `max_batch`. Both are the decision floor's (`kv_reservation`, `has_room`), which
the simulator counts with too; the late TBT re-check of ARCHITECTURE.md is its `late_verdict`,
fed `admission_state()`. A request whose KV is still loading holds its room with `reserve()`.

Numerics: attention runs per row over the row's own length, the kernel a sequence decoded alone
runs, so a row's result does not depend on its batch; measured here, logits equal per-sequence
decoding bit for bit in bfloat16 (oneDNN's bf16 matmuls give the same row for M=1 and M=B) and
to ~1e-6 in float32 (whose M=1 kernel differs in the last bits). Tests check tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from common import kvfiles
from common.engine.llama import KvWriter, Llama
from common.sampling import SamplingError, is_greedy, sample
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
    """A request's KV in the buffer it will run in (`BatchEngine.make_row`)."""

    kv: torch.Tensor  # [L, 2, H, capacity, D]; tokens [0, kv_len) hold the KV so far
    kv_len: int


@dataclass
class _Row:
    request_id: str
    sampling: SamplingParams
    last_token: int  # fed at the next step
    num_generated: int  # tokens generated so far (the prefill's first token counts)
    reserved: int  # tokens counted against the budget
    kv: torch.Tensor  # [L, 2, H, capacity, D]
    layers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(init=False)

    def __post_init__(self) -> None:
        self.hold(self.kv)

    def hold(self, kv: torch.Tensor) -> None:
        """Take `kv` as the row's buffer; `layers` are its views a step reads, made once: per layer
        (K and V [2, H, capacity, D], K [1, H, capacity, D], V [1, H, capacity, D])."""
        self.kv = kv
        self.layers = [(layer, layer[0:1], layer[1:2]) for layer in kv.unbind(0)]


@dataclass(frozen=True, slots=True)
class StepStats:
    """What one iteration cost: a sample for fitting the decode step-time model."""

    batch: int
    context_tokens: int  # sum of the rows' KV lengths read by the step
    seconds: float


class BatchEngine:
    def __init__(self, model: Llama, max_batch: int, kv_budget_tokens: int, packed: bool = True) -> None:
        if max_batch < 1 or kv_budget_tokens < 1:
            raise ValueError("max_batch and kv_budget_tokens must be >= 1")
        self.model = model
        self.packed = model.packed() if packed else None  # the projections on oneDNN's packed weights
        self.max_batch = max_batch
        self.kv_budget_tokens = kv_budget_tokens
        self.max_context = model.max_context
        self.num_layers, self.num_kv_heads, self.head_dim = model.num_layers, model.num_kv_heads, model.head_dim
        self.device, self.dtype = model.device, model.dtype
        self.rows: list[_Row] = []  # row index -> _Row
        self.index: dict[str, int] = {}  # request_id -> row index
        self.kv_lens = torch.zeros(0, dtype=torch.long)  # row index -> tokens in its KV
        self.reserved_tokens = 0  # of the running rows and of `pending`
        self.pending: dict[str, tuple[int, int]] = {}  # request_id -> (tokens held, its KV length), `reserve` to `add`
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
        return has_room(len(self.rows) + len(self.pending), self.max_batch, self.reserved_tokens, num_tokens,
                        self.kv_budget_tokens)

    def reserve(self, request_id: str, num_tokens: int, kv_len: int = 0) -> None:
        """Hold a row and `num_tokens` of the budget for a request whose KV (`kv_len` tokens) is on
        its way (`add` takes them over; `remove` gives them back). `admission_state` counts it in the
        batch already: it steps with it from its join on."""
        if request_id in self.index or request_id in self.pending:
            raise ValueError(f"request {request_id} already holds room")
        if not self.can_admit(num_tokens):
            raise BatchFull(f"request {request_id}: {num_tokens} tokens do not fit ({self._room()})")
        self.pending[request_id] = (num_tokens, kv_len)
        self.reserved_tokens += num_tokens

    def admission_state(self, instance_id: str = "", node: str = "", step_factor: float = 1.0) -> DecodeCandidate:
        """This engine as the conductor sees a decode instance (heartbeats, `late_verdict`)."""
        joining = sum(kv_len for _, kv_len in self.pending.values())
        return DecodeCandidate(instance_id, node, len(self.rows) + len(self.pending), self.context_tokens + joining,
                               self.kv_budget_tokens - self.reserved_tokens, step_factor)

    def _room(self) -> str:
        return (f"{len(self.rows)} running and {len(self.pending)} joining of {self.max_batch} rows, "
                f"{self.reserved_tokens}/{self.kv_budget_tokens} tokens")

    # ------------------------------------------------------------------ membership

    # NOTE: every method that makes or writes a KV buffer runs under inference mode: the service
    # calls add/remove/kv_of on its event-loop thread, make_row and step on worker threads, and a
    # tensor made inside the mode cannot be written in place outside it.
    @torch.inference_mode()
    def make_row(self, prompt_kv: torch.Tensor, sampling: SamplingParams, num_generated: int = 1) -> RowKv:
        """The buffer a request will run in, holding its KV so far (prompt_kv [L, 2, H, S, D]).

        Reads nothing of the engine's state but the model's shape, so it may run on any thread."""
        row = self.empty_row(prompt_kv.shape, sampling, num_generated)
        row.kv[:, :, :, : row.kv_len] = prompt_kv
        return row

    @torch.inference_mode()
    def empty_row(self, shape, sampling: SamplingParams, num_generated: int = 1) -> RowKv:
        """The buffer for a request whose KV so far has `shape` [L, 2, H, S, D], sized to its
        reservation; the caller fills tokens [0, S) (`make_row`, `row_from_file`) before `add`."""
        num_layers, _, heads, kv_len, head_dim = shape
        if (num_layers, heads, head_dim) != (self.num_layers, self.num_kv_heads, self.head_dim):
            raise ValueError(f"KV shape {tuple(shape)} does not fit the model")
        if kv_len >= self.max_context:
            raise ValueError(f"{kv_len} tokens leave no room in context {self.max_context}")
        capacity = max(self.tokens_needed(kv_len, sampling, num_generated), kv_len + 1)
        kv = torch.empty((num_layers, 2, heads, capacity, head_dim), dtype=self.dtype, device=self.device)
        return RowKv(kv, kv_len)

    @torch.inference_mode()
    def row_from_file(self, shm_dir, handle: KvHandle, sampling: SamplingParams, num_generated: int = 1,
                      remove: bool = False) -> RowKv:
        """A landed KV file read straight into the buffer the request will run in (`kvfiles.read_into`:
        no copy of its own). Any thread, as `make_row`; a file in another dtype or shape than the
        model's is refused (ValueError), as the cluster's layout check refuses such an instance."""
        row = self.empty_row(handle.shape, sampling, num_generated)
        kvfiles.read_into(shm_dir, handle, row.kv[:, :, :, : row.kv_len], remove)
        return row

    def add(self, request_id: str, prompt_kv: torch.Tensor | RowKv, last_token: int, sampling: SamplingParams,
            num_generated: int = 1) -> None:
        """Join a request: prompt_kv is its whole KV so far, [L, 2, H, S, D] or already in its
        buffer (`make_row`); last_token is fed next. Takes over the room `reserve` held for it."""
        if request_id in self.index:
            raise ValueError(f"request {request_id} is already running")
        try:
            row = prompt_kv if isinstance(prompt_kv, RowKv) else self.make_row(prompt_kv, sampling, num_generated)
        except ValueError as exc:
            raise ValueError(f"request {request_id}: {exc}") from None
        reserved = self.tokens_needed(row.kv_len, sampling, num_generated)
        held = self.pending.pop(request_id, None)
        if held is not None:
            self.reserved_tokens -= held[0]
        if not self.can_admit(reserved):
            if held is not None:  # still its own: the caller decides whether to give it back
                self.pending[request_id] = held
                self.reserved_tokens += held[0]
            raise BatchFull(f"request {request_id}: {reserved} tokens do not fit ({self._room()})")
        self.rows.append(_Row(request_id, sampling, last_token, num_generated, reserved, row.kv))
        self.index[request_id] = len(self.rows) - 1
        self.kv_lens = torch.cat((self.kv_lens, torch.tensor([row.kv_len])))
        self.reserved_tokens += reserved

    def remove(self, request_id: str) -> None:
        """Drop a finished or cancelled request, or the room reserved for it (a no-op for an unknown id)."""
        held = self.pending.pop(request_id, None)
        if held is not None:
            self.reserved_tokens -= held[0]
        row = self.index.pop(request_id, None)
        if row is None:
            return
        self.reserved_tokens -= self.rows[row].reserved
        last = len(self.rows) - 1
        if row != last:  # keep rows contiguous: the last row takes the freed index
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
        return self.rows[row].kv[:, :, :, start:end].clone()

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
            if kv_len >= row.kv.shape[3]:  # stepped past its reservation (a caller ignoring max_tokens)
                row.hold(self._grown(row.kv, kv_len))
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
        cache = _RowsCache([r.layers for r in self.rows], positions[:, 0].tolist())
        # NOTE: one row on one thread is the one case where MKL's dense GEMV beat the packed weights here
        packed = self.packed if batch > 1 or torch.get_num_threads() > 1 else None
        for idx in range(model.num_layers):
            hidden = model.layer(idx, hidden, cos, sin, cache, packed)
        return model.logits(hidden, packed)  # [B, vocab], float32

    def _grown(self, kv: torch.Tensor, kv_len: int) -> torch.Tensor:
        grown = torch.empty((*kv.shape[:3], min(2 * kv.shape[3], self.max_context), kv.shape[4]), dtype=kv.dtype,
                            device=kv.device)
        if grown.shape[3] <= kv_len:
            raise ValueError(f"a row of {kv_len} tokens is at the model's context {self.max_context}")
        grown[:, :, :, :kv_len] = kv[:, :, :, :kv_len]
        return grown

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


class _RowsCache(KvWriter):
    """The batch's cache as a decoder layer sees it.

    Writes the new token's K, V of every row at that row's position in the row's own buffer, then
    attends each row over exactly its own tokens. NOTE: one attention per row, not one masked
    attention over a padded width: the masked kernel's blocked softmax rounds differently from a
    sequence's own (in bfloat16, enough to flip a near tie), so each row gets exactly what it would
    alone. A row's buffer has room for the position it writes: it was sized to the row's
    reservation, which counts every step the row may run (`step` grows one stepped past it).
    """

    def __init__(self, rows: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]], positions: list[int]) -> None:
        self.rows, self.positions = rows, positions
        self.ends = [pos + 1 for pos in positions]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, idx: int, model) -> torch.Tensor:
        new = torch.stack((k[:, :, 0], v[:, :, 0]), dim=1).unbind(0)  # per row [2, H, D]
        out = []
        for layers, pos, end, q_row, kv_row in zip(self.rows, self.positions, self.ends, q.split(1), new):
            both, keys, values = layers[idx]
            both[:, :, pos] = kv_row
            out.append(model.attention(q_row, keys[:, :, :end], values[:, :, :end]))
        return out[0] if len(out) == 1 else torch.cat(out)
