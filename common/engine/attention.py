"""Decode attention over the paged KV pool (common/engine/paged.py): one call per layer for the
whole batch.

Backends, side by side in `moonbus bench engine` (its `attention` section):

    kernel   the C++ flash-decoding kernel (kernels/paged_attention.cpp), threads over rows and
             spans of their tokens, each K and V read once, the softmax fused: the default
             wherever it builds. Its numbers in docs/benchmarks.md.
    padded   torch alone: the batch's blocks gathered into one padded [B, H, T, D] tensor, one
             batched matmul attention with a mask (what runs where no compiler built the kernel).
    rows     torch alone, one scaled_dot_product_attention per row over its own tokens (the
             engine's attention before the pool; kept for comparison, never the default).

Every backend first writes each row's new K and V at its position, then attends the row's query
heads over its tokens [0, position]. `auto` is `kernel` when it loads, else `padded`.
"""

from __future__ import annotations

import logging

import torch

from common.engine import kernels
from common.engine.llama import KvWriter
from common.engine.paged import BLOCK, KvPool

log = logging.getLogger(__name__)

BACKENDS = ("auto", "kernel", "padded", "rows")
SPAN_TOKENS = 512  # a row's tokens per work item of the kernel (a long row spreads over threads): torch's key block


def resolve_backend(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r} is not one of {BACKENDS}")
    if name == "auto":
        return "kernel" if kernels.load() else "padded"
    if name == "kernel":
        kernels.require()
    return name


class PagedAttention(KvWriter):
    """The batch's cache as a decoder layer sees it: the pool, each row's blocks (`tables`
    [B, max blocks] int32) and the position its new token takes (`positions` [B] int64)."""

    def __init__(self, pool: KvPool, tables: torch.Tensor, positions: torch.Tensor, backend: str) -> None:
        self.pool, self.tables, self.positions = pool, tables, positions
        self.attend_rows = {"kernel": self._kernel, "padded": self._padded, "rows": self._rows}[backend]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, idx: int, model) -> torch.Tensor:
        # q [B, Hq, 1, D]; k, v [B, Hkv, 1, D] -> [B, Hq, 1, D]
        return self.attend_rows(q[:, :, 0].contiguous(), k[:, :, 0].contiguous(), v[:, :, 0].contiguous(), idx,
                                model.scale).unsqueeze(2)

    def attend_projected(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, idx: int,
                         model) -> torch.Tensor | None:
        # the kernel rotates q and k, writes K and V and attends in one call (torch's backends: None)
        if self.attend_rows != self._kernel:
            return None
        batch = qkv.shape[0]
        return torch.ops.moonbus.decode_attention_qkv(
            qkv[:, 0], cos[:, 0], sin[:, 0], self.pool.k[idx], self.pool.v[idx], self.tables, self.positions,
            model.scale, SPAN_TOKENS, model.num_heads).view(batch, 1, -1)

    def _kernel(self, q, k, v, idx: int, scale: float) -> torch.Tensor:
        return torch.ops.moonbus.decode_attention(q, k, v, self.pool.k[idx], self.pool.v[idx], self.tables,
                                                  self.positions, scale, SPAN_TOKENS)

    def _write(self, k, v, idx: int) -> None:
        rows = torch.arange(len(self.positions))
        blocks = self.tables[rows, self.positions // BLOCK].long()
        slots = self.positions % BLOCK
        self.pool.k[idx][blocks, :, :, slots] = k  # [B, Hkv, D] at (block, :, :, slot)
        self.pool.v[idx][blocks, :, slots] = v

    def _gathered(self, idx: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's first `width` blocks as [B, Hkv, width * BLOCK, D] K and V."""
        ids = self.tables[:, :width].long()
        keys = self.pool.k[idx][ids].permute(0, 2, 1, 4, 3).flatten(2, 3)  # [B, Hkv, T, D]
        values = self.pool.v[idx][ids].permute(0, 2, 1, 3, 4).flatten(2, 3)
        return keys, values

    def _padded(self, q, k, v, idx: int, scale: float) -> torch.Tensor:
        self._write(k, v, idx)
        batch, heads, dim = q.shape
        kv_heads = k.shape[1]
        width = int(self.positions.max()) // BLOCK + 1
        keys, values = self._gathered(idx, width)
        seen = torch.arange(width * BLOCK)[None, :] <= self.positions[:, None]  # [B, T]
        # unwritten slots hold whatever the pool's pages held: never let them reach a product
        values = values.masked_fill(~seen[:, None, :, None], 0)
        # as torch's CPU flash attention computes it (so a fallback row agrees with transformers):
        # scores in float32, then scaled; weights exp(s - max) summed in float32 and, in bfloat16,
        # rounded to bfloat16 before they multiply V
        grouped = q.view(batch, kv_heads, heads // kv_heads, dim).float()
        scores = torch.matmul(grouped, keys.float().transpose(2, 3)) * scale  # [B, Hkv, G, T]
        scores = scores.masked_fill(~seen[:, None, None, :], float("-inf"))
        weights = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
        total = weights.sum(dim=-1, keepdim=True)
        out = torch.matmul(weights.to(q.dtype).float(), values.float()) / total  # [B, Hkv, G, D]
        return out.reshape(batch, heads, dim).to(q.dtype)

    def _rows(self, q, k, v, idx: int, scale: float) -> torch.Tensor:
        self._write(k, v, idx)
        out = []
        for row, end in enumerate((self.positions + 1).tolist()):
            width = -(-end // BLOCK)
            ids = self.tables[row, :width].long()
            # contiguous, as a sequence's own cache is: torch picks its flash kernel for those
            keys = self.pool.k[idx][ids].permute(1, 0, 3, 2).flatten(1, 2)[None, :, :end].contiguous()  # [1, Hkv, end, D]
            values = self.pool.v[idx][ids].permute(1, 0, 2, 3).flatten(1, 2)[None, :, :end].contiguous()
            out.append(torch.nn.functional.scaled_dot_product_attention(
                q[row: row + 1, :, None], keys, values, scale=scale, enable_gqa=keys.shape[1] != q.shape[1])[:, :, 0])
        return torch.cat(out)
