"""Where one layer slice of a request's KV lives in its [L, 2, H, S, D] buffer, and its coverage.

A request's KV travels (the handoff, pipeline stages) as layer slices: K and V of tokens
[start, start + n) of one layer. In the C-order [L, 2 (K, V), H, S, D] buffer that is 2 * H runs
of n * D values, one per (K/V, head):

    run (kv, h) starts at ((layer * 2 + kv) * H + h) * S * D + start * D      (in values)

so a sender writes a slice as 2 * H pieces at those offsets (from views of its own buffer: no
copy), and a receiver checks that a write's pieces are exactly a slice's runs before it counts
the slice as landed.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:  # the messenger imports this module and never loads torch (seconds, hundreds of MB)
    import torch


class SliceGeometry:
    """The runs of layer slices in one request's [L, 2, H, S, D] buffer of `itemsize`-byte values."""

    def __init__(self, shape: Sequence[int], itemsize: int = 4) -> None:
        self.num_layers, two, self.num_kv_heads, self.num_tokens, self.head_dim = shape
        if two != 2:
            raise ValueError(f"shape {list(shape)} is not [L, 2, H, S, D]")
        self.itemsize = itemsize

    @property
    def nbytes(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.num_tokens * self.head_dim * self.itemsize

    def runs(self, layer: int, start: int, num_tokens: int) -> list[tuple[int, int]]:
        """[(byte offset, nbytes)] of the slice, in (K/V, head) order."""
        row = self.head_dim * self.itemsize
        out = []
        for kv in range(2):
            for h in range(self.num_kv_heads):
                base = ((layer * 2 + kv) * self.num_kv_heads + h) * self.num_tokens
                out.append(((base + start) * row, num_tokens * row))
        return out

    def check(self, layer: int, start: int, num_tokens: int) -> None:
        if not (0 <= layer < self.num_layers and num_tokens > 0 and 0 <= start
                and start + num_tokens <= self.num_tokens):
            raise ValueError(f"slice of layer {layer}, tokens [{start}, {start + num_tokens}) does not fit "
                             f"{self.num_layers} layers x {self.num_tokens} tokens")

    def pieces(self, layer: int, start: int, kv: torch.Tensor) -> list[tuple[int, memoryview]]:
        """(offset, bytes) of a slice `kv` [2, H, n, D] for `write`: views of its rows, no copy."""
        n = kv.shape[2]
        offsets = self.runs(layer, start, n)
        out = []
        for i, (offset, nbytes) in enumerate(offsets):
            run = kv[i // self.num_kv_heads, i % self.num_kv_heads]
            if not run.is_contiguous():
                run = run.contiguous()
            if run.element_size() == 2:  # numpy has no bfloat16: its raw 16-bit words
                import torch

                run = run.view(torch.uint16)
            view = memoryview(run.numpy()).cast("B")
            out.append((offset, view))
        return out


def meta(layer: int, start: int, num_tokens: int) -> dict[str, int]:
    """What a slice write carries for its receiver."""
    return {"layer": layer, "start": start, "tokens": num_tokens}


def from_meta(m: dict) -> tuple[int, int, int]:
    try:
        return int(m["layer"]), int(m["start"]), int(m["tokens"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"a slice write needs layer, start and tokens; got {m}") from exc


class Coverage:
    """Which tokens of each layer have landed (thread-safe): slices may come in any order."""

    def __init__(self, geometry: SliceGeometry) -> None:
        self.geometry = geometry
        self.spans: list[list[tuple[int, int]]] = [[] for _ in range(geometry.num_layers)]
        self.nbytes = 0
        self._lock = threading.Lock()

    def add(self, m: dict, pieces: list[tuple[int, int]]) -> tuple[int, int, int]:
        """Record a landed write; ValueError if it is not exactly one slice of this buffer."""
        layer, start, n = from_meta(m)
        self.geometry.check(layer, start, n)
        if [tuple(p) for p in pieces] != self.geometry.runs(layer, start, n):
            raise ValueError(f"the pieces of slice {m} are not where that slice lives")
        with self._lock:
            self.spans[layer].append((start, start + n))
            self.nbytes += sum(nbytes for _, nbytes in pieces)
        return layer, start, n

    def missing(self) -> str:
        """'' when every layer is covered from 0 to the last token, else what is missing."""
        with self._lock:
            for layer, spans in enumerate(self.spans):
                covered = 0
                for a, b in sorted(spans):
                    if a > covered:
                        break
                    covered = max(covered, b)
                if covered < self.geometry.num_tokens:
                    return f"layer {layer} has tokens [0, {covered}) of {self.geometry.num_tokens}"
        return ""
