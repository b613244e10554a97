"""The decode engine's KV: fixed-size blocks of one pool, a block table per request.

    k  [num_layers, num_blocks, kv_heads, head_dim, BLOCK]   K transposed within its block
    v  [num_layers, num_blocks, kv_heads, BLOCK, head_dim]

A request holds a list of block ids; its token t lives in block blocks[t // BLOCK] at slot
t % BLOCK. Nothing moves when requests join or leave: a join writes the request's KV into the
blocks it was given, a departure hands the ids back. K is stored transposed in its block so that
the attention kernel (kernels/paged_attention.cpp) scores BLOCK tokens per vector instruction.

The pool is allocated once, empty, on huge pages (hugepages.py: every step reads it whole): pages
of blocks never written cost nothing, so the memory in use follows the tokens held (the
high-water mark of them, in 2 MiB pages: freed blocks are reused first, last freed first, so
pages already touched are reused before new ones).

`BLOCK` is the engine's own page size, independent of the cluster's `--block-tokens` (the unit
of prefix sharing): 16 tokens is one AVX-512 vector of float32 scores, two of AVX2.
"""

from __future__ import annotations

import torch

from common.engine import hugepages

BLOCK = 16


class KvPool:
    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, num_blocks: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        if num_blocks < 1:
            raise ValueError("a KV pool needs at least one block")
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.num_blocks, self.dtype = num_blocks, dtype
        k_shape = (num_layers, num_blocks, kv_heads, head_dim, BLOCK)
        v_shape = (num_layers, num_blocks, kv_heads, BLOCK, head_dim)
        with torch.inference_mode():  # written by steps and loads under the mode (batch.py's NOTE)
            if torch.device(device).type == "cpu":  # read whole every step: on huge pages (hugepages.py)
                self.k, self.v = hugepages.empty(k_shape, dtype), hugepages.empty(v_shape, dtype)
            else:
                self.k = torch.empty(k_shape, dtype=dtype, device=device)
                self.v = torch.empty(v_shape, dtype=dtype, device=device)
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))  # a stack: the last freed is reused first

    @staticmethod
    def blocks_for(tokens: int) -> int:
        return -(-tokens // BLOCK)

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self, count: int) -> list[int] | None:
        """`count` block ids, or None (and nothing taken) when fewer are free."""
        if count > len(self.free):
            return None
        taken = self.free[len(self.free) - count:]
        del self.free[len(self.free) - count:]
        return taken[::-1]

    def release(self, blocks: list[int]) -> None:
        self.free.extend(reversed(blocks))

    @torch.inference_mode()
    def write(self, blocks: list[int], kv: torch.Tensor, start: int = 0) -> None:
        """Store kv [L, 2, H, n, D] as tokens [start, start + n) of the request holding `blocks`;
        `start` is on a block boundary."""
        if start % BLOCK:
            raise ValueError(f"a write starts on a block boundary, not at token {start}")
        n = kv.shape[3]
        first = start // BLOCK
        full, rest = divmod(n, BLOCK)
        if first + full + (rest > 0) > len(blocks):
            raise ValueError(f"{n} tokens from {start} do not fit {len(blocks)} blocks")
        keys, values = kv[:, 0], kv[:, 1]  # [L, H, n, D]
        if full:
            ids = torch.tensor(blocks[first:first + full], dtype=torch.long)
            k = keys[:, :, : full * BLOCK].unflatten(2, (full, BLOCK))  # [L, H, full, BLOCK, D]
            v = values[:, :, : full * BLOCK].unflatten(2, (full, BLOCK))
            self.k[:, ids] = k.permute(0, 2, 1, 4, 3)
            self.v[:, ids] = v.permute(0, 2, 1, 3, 4)
        if rest:
            last = blocks[first + full]
            self.k[:, last, :, :, :rest] = keys[:, :, full * BLOCK:].transpose(2, 3)
            self.v[:, last, :, :rest] = values[:, :, full * BLOCK:]

    def read(self, blocks: list[int], start: int, end: int) -> torch.Tensor:
        """A copy of tokens [start, end) of the request holding `blocks`: [L, 2, H, end - start, D]."""
        first, last = start // BLOCK, -(-end // BLOCK)
        ids = torch.tensor(blocks[first:last], dtype=torch.long)
        k = self.k[:, ids].permute(0, 2, 1, 4, 3).flatten(2, 3)  # [L, H, n_blocks * BLOCK, D]
        v = self.v[:, ids].permute(0, 2, 1, 3, 4).flatten(2, 3)
        lo = start - first * BLOCK
        return torch.stack((k[:, :, lo: lo + end - start], v[:, :, lo: lo + end - start]), dim=1)
