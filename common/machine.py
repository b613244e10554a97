"""What this machine is, read from the kernel: its CPU's model, vector and matrix units, its memory.

The one place that reads /proc/cpuinfo and the memory limits: the dtype `auto` picks
(models.resolve_dtype), whether oneDNN packs bfloat16 weights (engine/llama.py), the attention
kernel's build key (engine/kernels), a decode instance's default KV room (`memory_bytes`) and the
machine every benchmark records beside its numbers.
"""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

# the flags that decide which kernels run: AVX2, AVX-512 (and its bfloat16 dot products), AMX
VECTOR_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "amx_tile", "amx_bf16")


@functools.cache
def _cpuinfo() -> tuple[str, frozenset[str]]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine(), frozenset()
    model = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")),
                 platform.processor() or platform.machine())
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])
    return model, frozenset(flags)


def flags() -> frozenset[str]:
    return _cpuinfo()[1]


def model_name() -> str:
    return _cpuinfo()[0]


def vector_flags() -> list[str]:
    """This CPU's flags among VECTOR_FLAGS, in that order."""
    present = flags()
    return [flag for flag in VECTOR_FLAGS if flag in present]


def has_bf16() -> bool:
    """Does this CPU compute bfloat16 natively (AVX-512 BF16 or AMX)? There torch's bfloat16
    matmuls beat float32 (2.5x on a 1,024-token prefill here) and oneDNN packs bfloat16 weights."""
    return bool({"avx512_bf16", "amx_bf16"} & flags())


def has_float_vectors() -> bool:
    """Does this CPU have the float32 vectors the engine's kernels are written for (AVX2 with FMA,
    or AVX-512)? Elsewhere they build as scalar loops, slower than torch's own."""
    present = flags()
    return {"avx2", "fma"} <= present or "avx512f" in present


def memory_bytes() -> int:
    """The memory this process may use: the machine's, or its cgroup's limit where that is lower
    (a container with `deploy.resources.limits.memory`)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def describe() -> dict:
    """The machine as every published number records it."""
    return {"cpu": model_name(), "cores": os.cpu_count(), "cpu_flags": vector_flags(),
            "memory_gib": round(memory_bytes() / (1 << 30), 1), "system": f"{platform.system()} {platform.release()}",
            "python": platform.python_version()}
