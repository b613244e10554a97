"""Tensors on transparent huge pages (2 MiB), for what a decode step reads whole every step.

A decode step reads every projection weight and every running request's KV once. On 4 KiB pages
that read walks the page tables every 4 KiB, and the CPU's prefetcher stops at each page's edge;
on 2 MiB pages it streams. Measured on an AVX-512 BF16 EPYC (docs/benchmarks.md, 2026-12-06
night), `moonbus bench engine`'s decode attention over 32 rows of 1,024 tokens: 26.2 ms against
28.2 on two threads (5 alternated runs each, within their spread), no change on one thread.

The kernel gives an anonymous mapping huge pages where it is asked to (`madvise(MADV_HUGEPAGE)`),
which is what Linux's default THP setting (`madvise`) honours; torch's allocator asks only under
THP_MEM_ALLOC_ENABLE, for every tensor, where a step's short-lived activations would then pay
2 MiB page faults. So the few long-lived tensors ask here, and a system without the setting (or
not Linux) gets torch's ordinary memory. Pages are still touched lazily: a pool never filled costs
nothing.
"""

from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE = 2 << 20


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor on huge pages where the system gives them (fresh anonymous
    pages: zeros); one under 2 MiB, or where Python has no MADV_HUGEPAGE, is torch.empty's."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype)
    # one extra huge page so that the tensor can start on a huge page's boundary
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # THP disabled ("never") or not in this kernel: ordinary pages, same tensor
        pass
    raw = torch.frombuffer(buf, dtype=torch.uint8)  # holds `buf` for as long as a view of it lives
    start = -raw.data_ptr() % HUGE_PAGE
    return raw[start:start + nbytes].view(dtype).view(shape)
