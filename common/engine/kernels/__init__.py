"""The engine's own C++ kernels, built with torch's cpp_extension for this machine's CPU.

`paged_attention.cpp`: decode attention over the paged KV pool, one call per layer for the whole
batch (`torch.ops.moonbus.decode_attention`). `prefill_attention.cpp`: a prompt chunk's causal
attention (`torch.ops.moonbus.prefill_attention`), in float32 on the CPU's float32 vectors and in
bfloat16 on its bfloat16 dot products (that path built only where the CPU has AVX-512 BF16;
`Llama.prefill_kernel` says where it runs). `vec.h`: the float32 vectors both are written on. `make` builds them (`python -m common.engine.kernels`);
a process that finds no build for this CPU builds it on first use when a C++ compiler is there.

Built with -march=native: the library is keyed by the source, torch's version, the flags and the
CPU's vector flags, so a machine of another kind (AVX2 only, AVX-512, AMX) builds its own instead of
loading one that would fault on an instruction it lacks. Where nothing can be built (no
compiler, e.g. a slim container), `load()` returns False and the engine attends with torch's ops
(common/engine/attention.py says which backend runs).

Where the libraries go: $MOONBUS_KERNEL_DIR, else build/kernels/ at the repository's root; a
process that cannot write there (a container's user) builds into ~/.cache/moonbus/kernels/.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
from pathlib import Path
from subprocess import SubprocessError

import torch

from common import machine

log = logging.getLogger(__name__)

# the decode kernel, the prefill one (its bfloat16 path on AVX-512 BF16 CPUs only) and RMSNorm
SOURCES = [Path(__file__).with_name("paged_attention.cpp"), Path(__file__).with_name("prefill_attention.cpp"),
           Path(__file__).with_name("norm.cpp")]
HEADERS = [Path(__file__).with_name("vec.h")]  # what the sources include: part of the build's key
NAME = "moonbus_kernels"
# MOONBUS_KERNEL_MARCH builds for another CPU than this one (e.g. x86-64-v3: AVX2 without
# AVX-512), to test that path on a machine that has more
MARCH = os.environ.get("MOONBUS_KERNEL_MARCH", "native")
CFLAGS = [f"-march={MARCH}", "-O3", "-fopenmp", "-fno-math-errno", "-ffp-contract=fast", "-Wno-unused-function"]

_state: dict[str, object] = {}  # "loaded": bool, "why": str


class KernelUnavailable(RuntimeError):
    """Raised by `require()` when the kernels cannot be loaded or built here; the message says why."""


def _key() -> str:
    return hashlib.sha256(b"".join(src.read_bytes() for src in SOURCES + HEADERS) + torch.__version__.encode() + ",".join(machine.vector_flags()).encode()
                          + " ".join(CFLAGS).encode()).hexdigest()[:16]


def build_dirs() -> list[Path]:
    """Where this CPU's build may be, in order: $MOONBUS_KERNEL_DIR (else build/kernels/ at the
    repository's root: what `make` and an image build write), then the user's cache (where a
    process that cannot write the first builds it)."""
    configured = os.environ.get("MOONBUS_KERNEL_DIR", "")
    first = Path(configured) if configured else Path(__file__).resolve().parents[3] / "build" / "kernels"
    return [first / _key(), Path.home() / ".cache" / "moonbus" / "kernels" / _key()]


def build_dir() -> Path:
    """Where this CPU's build is, or goes: the first of `build_dirs` that holds it, else the
    first that can be written."""
    dirs = build_dirs()
    for d in dirs:
        if (d / f"{NAME}.so").exists():
            return d
    for d in dirs:
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(d, os.W_OK):
            return d
    return dirs[0]


def library_path() -> Path:
    return build_dir() / f"{NAME}.so"


def build(verbose: bool = False) -> Path:
    """Compile the kernels for this CPU (half a minute or so); returns the library's path."""
    from torch.utils import cpp_extension

    if shutil.which(os.environ.get("CXX", "c++")) is None:
        raise KernelUnavailable("no C++ compiler (c++) on PATH to build the decode attention kernel")
    out = build_dir()
    out.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(NAME, [str(src) for src in SOURCES], extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"], build_directory=str(out),
                       is_python_module=False, verbose=verbose)
    return out / f"{NAME}.so"


def load(build_if_missing: bool = True) -> bool:
    """Load the kernels into torch.ops.moonbus; True when they are there. Never raises: why they
    are not is `why_unavailable()`."""
    if "loaded" in _state:
        return bool(_state["loaded"])
    try:
        require(build_if_missing)
    except (KernelUnavailable, OSError, RuntimeError) as exc:
        _state.update(loaded=False, why=str(exc))
        log.warning("the decode attention kernel is unavailable (%s); attention runs on torch's ops", exc)
        return False
    return True


def require(build_if_missing: bool = True) -> None:
    """Load the kernels, building them if allowed; raises KernelUnavailable otherwise."""
    if _state.get("loaded"):
        return
    path = library_path()
    if not path.exists():
        if not build_if_missing:
            raise KernelUnavailable(f"not built for this CPU ({path}); `make` builds it")
        try:
            path = build()
        except (OSError, RuntimeError, SubprocessError) as exc:
            raise KernelUnavailable(f"could not build it: {exc}") from exc
    if not hasattr(torch.ops.moonbus, "decode_attention"):
        torch.ops.load_library(str(path))
    _state.update(loaded=True, why="")


def provides(op: str) -> bool:
    """Whether the kernels load here (built or buildable) and define `torch.ops.moonbus.<op>`."""
    return load() and hasattr(torch.ops.moonbus, op)


def why_unavailable() -> str:
    return str(_state.get("why", ""))



def main() -> int:
    path = build(verbose="-v" in sys.argv)
    torch.ops.load_library(str(path))
    print(f"the engine's kernels: {path} (CPU flags: {', '.join(machine.vector_flags()) or 'none'})")
    return 0

