"""Which performance profile a service uses: the measured one if `moonbus profile` wrote it,
else an analytic estimate from the model's dimensions (logged, since it is only a guess)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from common import models
from common.decide.perf import HardwareSpec, ModelSpec, Profile, analytic_profile

log = logging.getLogger(__name__)

# NOTE: a rough 2-core CPU running float32 torch; only used until `moonbus profile` has run.
CPU_GUESS = HardwareSpec("cpu-guess", gpu_flops=20e9, hbm_bytes_s=10e9, h2d_bytes_s=10e9, nic_bytes_s=1e9)


def save(profile: Profile, path: str | Path) -> None:
    Path(path).write_text(json.dumps(profile.to_dict(), indent=2) + "\n")


def read(path: str | Path) -> Profile:
    return Profile.from_dict(json.loads(Path(path).read_text()))


def measured_threads(meta: dict) -> dict[str, int]:
    """The torch threads a measured profile (its `meta`) was timed with, per role ({} where it does not say)."""
    threads = meta.get("threads", {})
    return {role: int(n) for role, n in threads.items()} if isinstance(threads, dict) else {}


def profile_path(home: Path, model_name: str, dtype: str) -> Path:
    """One profile per model and dtype: bfloat16 prefill runs 2.5x float32's here."""
    return home / "profiles" / f"{model_name}-{dtype}.json"


def load(home: Path, model: str, explicit: str = "", dtype: str = "float32") -> tuple[Profile, str]:
    """(profile, where it came from)."""
    if explicit:
        return read(explicit), explicit
    ref = models.resolve(model, home)
    path = profile_path(home, ref.name, dtype)
    if path.exists():
        return read(path), str(path)
    shape = models.read_shape(ref)
    spec = ModelSpec(ref.name, layers=shape.num_layers, d_model=shape.hidden_size,
                     n_heads=shape.num_heads, n_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                     dtype_bytes=2 if dtype == "bfloat16" else 4, params=shape.num_params)
    log.warning("no measured profile at %s; using an analytic guess (run `moonbus profile`)", path)
    return analytic_profile(spec, CPU_GUESS), "analytic guess"
