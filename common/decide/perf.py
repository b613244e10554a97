"""Performance models: how long a prefill, a decode step and a KV transfer take.

Shared by the live conductor (TTFT/TBT prediction), `moonbus profile` (which measures the deployed
model and writes a profile file) and the simulator. Every predictor is a frozen dataclass whose
hot method (`seconds`, `step_seconds`) is plain float arithmetic: the conductor calls it once per
candidate instance per request, so no numpy there.

Prefill. A prefill of n tokens whose first p tokens are cached computes tokens p..n, each
attending to everything before it:
    flops(n) - flops(p),  flops(n) = layers * (4*n^2*d + 22*n*d^2)
so the fitted regression uses the features  [1, n-p, n^2-p^2, p]:
    1          fixed cost (launch, sampling the first token)
    n-p        the linear terms (projections, MLP) of the computed tokens
    n^2-p^2    attention of the computed tokens over the whole context
    p          loading the cached prefix into the device
Fitting minimises RELATIVE error (each row is divided by its measured time), since a 10 ms error
matters for a 50 ms prefill and not for a 5 s one.

Decode. A step of a continuous batch costs  a + b*batch + c*context_tokens  (regression), or for
big models, which are memory-bandwidth bound, (weights + KV read) / HBM bandwidth (analytic).
The predicted TBT of a batch is its step time.

Transfer. (bytes queued at the sender + bytes) / link bandwidth: congestion at the sender is
modelled as waiting for the bytes already queued there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, NamedTuple, Protocol

import numpy as np

PROFILE_VERSION = 1
PREFILL_FEATURES = ("1", "n-p", "n^2-p^2", "p")
DECODE_FEATURES = ("1", "batch", "context_tokens")


class PrefillSample(NamedTuple):
    input_tokens: int
    prefix_tokens: int
    seconds: float


class DecodeSample(NamedTuple):
    batch: int
    context_tokens: int
    seconds: float


class PrefillPredictor(Protocol):
    def seconds(self, input_tokens: int, prefix_tokens: int) -> float: ...


class DecodePredictor(Protocol):
    def step_seconds(self, batch: int, context_tokens: int) -> float: ...


@dataclass(frozen=True, slots=True)
class FitError:
    """Relative error |predicted - measured| / measured over a sample set."""

    mean_rel: float
    max_rel: float
    num_samples: int


def transfer_seconds(nbytes: float, bandwidth_bytes_s: float, queued_bytes: float = 0.0) -> float:
    """Seconds until `nbytes` have crossed a link whose sender already has `queued_bytes` queued."""
    return (queued_bytes + nbytes) / bandwidth_bytes_s


def queue_ends(works: Iterable[float], running_for_s: float | None = None) -> list[float]:
    """Seconds from now until each job of a FIFO queue ends: its predicted work after that of the
    jobs ahead. The first has run `running_for_s` already (None: it has not started). A prefill
    instance reports its queue this way, live (services/prefill/compute.py) and simulated alike."""
    ends, t = [], 0.0
    for i, work in enumerate(works):
        if i == 0 and running_for_s is not None:
            work = max(0.0, work - running_for_s)
        t += work
        ends.append(t)
    return ends


# --------------------------------------------------------------------------- regression models


def _prefill_row(n: float, p: float) -> tuple[float, float, float, float]:
    return (1.0, n - p, n * n - p * p, p)


def _decode_row(batch: float, context: float) -> tuple[float, float, float]:
    return (1.0, batch, context)


def _fit_relative(rows: np.ndarray, seconds: np.ndarray) -> tuple[float, ...]:
    """Non-negative least squares (scipy's nnls) minimising relative error; columns are scaled so
    that n^2 does not dominate.

    NOTE: every feature is a cost (more tokens, a bigger batch, a longer context never make a step
    cheaper), so a negative coefficient is measurement noise; on a CPU where fixed overhead
    dominates it is common, and a step time that falls with the batch size would send every
    request to the busiest instance. Hence non-negative, not plain, least squares.
    """
    # NOTE: imported here, not at the top: only a fit needs it (`moonbus profile`), and every
    # service imports this module; scipy.optimize costs 0.6 s at each process start.
    from scipy.optimize import nnls

    if len(seconds) < rows.shape[1]:
        raise ValueError(f"need at least {rows.shape[1]} samples to fit, got {len(seconds)}")
    if np.any(seconds <= 0):
        raise ValueError("measured seconds must be > 0")
    weighted = rows / seconds[:, None]
    scale = np.linalg.norm(weighted, axis=0)
    scale[scale == 0] = 1.0
    coef, _ = nnls(weighted / scale, np.ones_like(seconds))
    return tuple(float(c) for c in coef / scale)


def _error(predicted: Iterable[float], measured: Iterable[float]) -> FitError:
    pred, meas = np.asarray(list(predicted), float), np.asarray(list(measured), float)
    if len(meas) == 0:
        raise ValueError("no samples")
    rel = np.abs(pred - meas) / meas
    return FitError(float(rel.mean()), float(rel.max()), len(meas))


def _grid(**axes: Iterable[int]) -> dict[str, list[int]]:
    return {name: sorted({int(v) for v in values}) for name, values in axes.items()}


@dataclass(frozen=True, slots=True)
class PrefillModel:
    """Fitted prefill time: coef . [1, n-p, n^2-p^2, p] seconds (see the module docstring)."""

    coef: tuple[float, float, float, float]
    fit_error: FitError | None = None
    grid: dict[str, list[int]] = field(default_factory=dict, compare=False, hash=False)

    KIND = "regression"

    def __post_init__(self) -> None:
        if len(self.coef) != len(PREFILL_FEATURES):
            raise ValueError(f"prefill coef needs {len(PREFILL_FEATURES)} values, got {len(self.coef)}")

    def seconds(self, input_tokens: int, prefix_tokens: int) -> float:
        n, p = input_tokens, prefix_tokens
        c0, c1, c2, c3 = self.coef
        s = c0 + c1 * (n - p) + c2 * (n * n - p * p) + c3 * p
        return s if s > 0.0 else 0.0  # max(0.0, s) without a call (a NaN or -0.0 gives 0.0 alike)

    @classmethod
    def fit(cls, samples: Iterable[PrefillSample]) -> PrefillModel:
        data = [PrefillSample(*s) for s in samples]
        rows = np.array([_prefill_row(s.input_tokens, s.prefix_tokens) for s in data], float)
        coef = _fit_relative(rows, np.array([s.seconds for s in data], float))
        model = cls(coef)  # type: ignore[arg-type]
        grid = _grid(input_tokens=(s.input_tokens for s in data), prefix_tokens=(s.prefix_tokens for s in data))
        return cls(model.coef, model.error_report(data), grid)

    def error_report(self, held_out: Iterable[PrefillSample]) -> FitError:
        data = [PrefillSample(*s) for s in held_out]
        return _error((self.seconds(s.input_tokens, s.prefix_tokens) for s in data), (s.seconds for s in data))

    def to_dict(self) -> dict[str, Any]:
        return _model_dict(self.KIND, PREFILL_FEATURES, self.coef, self.fit_error, self.grid)

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> PrefillModel:
        return cls(tuple(obj["coef"]), _fit_error_from(obj.get("fit_error")), dict(obj.get("grid", {})))  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class DecodeModel:
    """Fitted decode step time: a + b*batch + c*context_tokens seconds; TBT of the batch = step time."""

    coef: tuple[float, float, float]
    fit_error: FitError | None = None
    grid: dict[str, list[int]] = field(default_factory=dict, compare=False, hash=False)

    KIND = "regression"

    def __post_init__(self) -> None:
        if len(self.coef) != len(DECODE_FEATURES):
            raise ValueError(f"decode coef needs {len(DECODE_FEATURES)} values, got {len(self.coef)}")

    def step_seconds(self, batch: int, context_tokens: int) -> float:
        a, b, c = self.coef
        s = a + b * batch + c * context_tokens
        return s if s > 0.0 else 0.0  # max(0.0, s) without a call: the conductor prices ~50 steps a route

    def monotone(self) -> bool:
        """step_seconds never falls as batch or context grows (admission's Retry-After scan relies on it
        to price a run of departures at one time once, not after each): non-negative b and c."""
        return self.coef[1] >= 0 and self.coef[2] >= 0

    @classmethod
    def fit(cls, samples: Iterable[DecodeSample]) -> DecodeModel:
        data = [DecodeSample(*s) for s in samples]
        rows = np.array([_decode_row(s.batch, s.context_tokens) for s in data], float)
        model = cls(_fit_relative(rows, np.array([s.seconds for s in data], float)))  # type: ignore[arg-type]
        grid = _grid(batch=(s.batch for s in data), context_tokens=(s.context_tokens for s in data))
        return cls(model.coef, model.error_report(data), grid)

    def error_report(self, held_out: Iterable[DecodeSample]) -> FitError:
        data = [DecodeSample(*s) for s in held_out]
        return _error((self.step_seconds(s.batch, s.context_tokens) for s in data), (s.seconds for s in data))

    def to_dict(self) -> dict[str, Any]:
        return _model_dict(self.KIND, DECODE_FEATURES, self.coef, self.fit_error, self.grid)

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> DecodeModel:
        return cls(tuple(obj["coef"]), _fit_error_from(obj.get("fit_error")), dict(obj.get("grid", {})))  # type: ignore[arg-type]


def _model_dict(kind: str, features: tuple[str, ...], coef: tuple[float, ...], err: FitError | None, grid: dict) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": kind, "features": list(features), "coef": list(coef), "grid": grid}
    if err is not None:
        out["fit_error"] = {"mean_rel": err.mean_rel, "max_rel": err.max_rel, "num_samples": err.num_samples}
    return out


def _fit_error_from(obj: dict[str, Any] | None) -> FitError | None:
    return None if obj is None else FitError(float(obj["mean_rel"]), float(obj["max_rel"]), int(obj["num_samples"]))


# --------------------------------------------------------------------------- analytic models


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Dimensions of a transformer, enough for FLOPs, weight bytes and KV bytes."""

    name: str
    layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    dtype_bytes: int
    params: float  # number of weights

    def __post_init__(self) -> None:
        for name in ("layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "dtype_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelSpec.{name} must be > 0")
        if self.n_heads % self.n_kv_heads:
            raise ValueError("n_heads must be a multiple of n_kv_heads (grouped-query attention)")

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token: layers * 2 * kv_heads * head_dim * dtype size."""
        return self.layers * 2 * self.n_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes


@dataclass(frozen=True, slots=True)
class HardwareSpec:
    """One serving node. Rates are aggregate over its GPUs, in FLOP/s and bytes/s."""

    name: str
    gpu_flops: float
    hbm_bytes_s: float
    h2d_bytes_s: float
    nic_bytes_s: float

    def __post_init__(self) -> None:
        for name in ("gpu_flops", "hbm_bytes_s", "h2d_bytes_s", "nic_bytes_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"HardwareSpec.{name} must be > 0")


# 64 query heads over 8 KV heads: 8 query heads share each KV head.
LLAMA3_70B = ModelSpec("llama3-70b", layers=80, d_model=8192, n_heads=64, n_kv_heads=8, head_dim=128, dtype_bytes=2, params=70.6e9)
# The default CPU model, run in float32 by the workers.
SMOLLM2_135M = ModelSpec("SmolLM2-135M-Instruct", layers=30, d_model=576, n_heads=9, n_kv_heads=3, head_dim=64, dtype_bytes=4, params=134.5e6)
# 8 x A800: 312 TFLOPS bf16 and 2.0 TB/s HBM each; 128 GB/s host-to-device; 800 Gbps NIC.
A800_X8 = HardwareSpec("8xA800", gpu_flops=8 * 312e12, hbm_bytes_s=8 * 2.0e12, h2d_bytes_s=128e9, nic_bytes_s=800e9 / 8)
MODEL_PRESETS = {m.name: m for m in (LLAMA3_70B, SMOLLM2_135M)}
HARDWARE_PRESETS = {h.name: h for h in (A800_X8,)}


@dataclass(frozen=True, slots=True)
class AnalyticPrefillModel:
    """Prefill time from FLOPs: flops(n) = layers*(a*n^2*d + b*n*d^2); a cached prefix saves flops(p)."""

    layers: int
    d_model: int
    gpu_flops: float
    efficiency: float = 0.5  # share of peak FLOP/s a long prefill reaches (MFU)
    attn_coef: float = 4.0  # a
    linear_coef: float = 22.0  # b

    KIND = "analytic"

    def __post_init__(self) -> None:
        if self.layers <= 0 or self.d_model <= 0 or self.gpu_flops <= 0:
            raise ValueError("layers, d_model and gpu_flops must be > 0")
        if not 0 < self.efficiency <= 1:
            raise ValueError("efficiency must be in (0, 1]")

    @classmethod
    def from_specs(cls, model: ModelSpec, hw: HardwareSpec, efficiency: float = 0.5) -> AnalyticPrefillModel:
        return cls(model.layers, model.d_model, hw.gpu_flops, efficiency)

    def flops(self, n: int) -> float:
        d = self.d_model
        return self.layers * (self.attn_coef * n * n * d + self.linear_coef * n * d * d)

    def seconds(self, input_tokens: int, prefix_tokens: int) -> float:
        # (flops(n) - flops(p)) / rate, written out: this runs once per candidate per request.
        n, p, d = input_tokens, prefix_tokens, self.d_model
        work = self.attn_coef * d * (n * n - p * p) + self.linear_coef * d * d * (n - p)
        return self.layers * work / (self.gpu_flops * self.efficiency)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.KIND, "layers": self.layers, "d_model": self.d_model, "gpu_flops": self.gpu_flops,
                "efficiency": self.efficiency, "attn_coef": self.attn_coef, "linear_coef": self.linear_coef}

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> AnalyticPrefillModel:
        return cls(**{k: v for k, v in obj.items() if k != "kind"})


@dataclass(frozen=True, slots=True)
class AnalyticDecodeModel:
    """Decode step of a memory-bound model: max(bytes read / HBM rate, flops / GPU rate) + overhead.

    Bytes read per step = all weights once + the KV of every token in the batch's context.
    """

    weight_bytes: float
    kv_bytes_per_token: int
    hbm_bytes_s: float
    flops_per_token: float  # ~2 * params
    gpu_flops: float
    efficiency: float = 0.8  # share of peak HBM bandwidth / FLOP/s a decode step reaches
    overhead_s: float = 0.0

    KIND = "analytic"

    def __post_init__(self) -> None:
        if self.hbm_bytes_s <= 0 or self.gpu_flops <= 0:
            raise ValueError("hbm_bytes_s and gpu_flops must be > 0")
        if not 0 < self.efficiency <= 1:
            raise ValueError("efficiency must be in (0, 1]")

    @classmethod
    def from_specs(cls, model: ModelSpec, hw: HardwareSpec, efficiency: float = 0.8) -> AnalyticDecodeModel:
        return cls(model.weight_bytes, model.kv_bytes_per_token, hw.hbm_bytes_s, 2 * model.params, hw.gpu_flops, efficiency)

    def monotone(self) -> bool:
        """step_seconds never falls as batch or context grows: KV bytes and flops per token are not negative."""
        return self.kv_bytes_per_token >= 0 and self.flops_per_token >= 0

    def step_seconds(self, batch: int, context_tokens: int) -> float:
        memory = (self.weight_bytes + self.kv_bytes_per_token * context_tokens) / self.hbm_bytes_s
        compute = batch * self.flops_per_token / self.gpu_flops
        return self.overhead_s + (memory if memory > compute else compute) / self.efficiency

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.KIND, "weight_bytes": self.weight_bytes, "kv_bytes_per_token": self.kv_bytes_per_token,
                "hbm_bytes_s": self.hbm_bytes_s, "flops_per_token": self.flops_per_token, "gpu_flops": self.gpu_flops,
                "efficiency": self.efficiency, "overhead_s": self.overhead_s}

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> AnalyticDecodeModel:
        return cls(**{k: v for k, v in obj.items() if k != "kind"})


# kind -> class, for loading a profile file
PREFILL_KINDS: dict[str, Any] = {"regression": PrefillModel, "analytic": AnalyticPrefillModel}
DECODE_KINDS: dict[str, Any] = {"regression": DecodeModel, "analytic": AnalyticDecodeModel}


# --------------------------------------------------------------------------- the profile file


@dataclass(frozen=True, slots=True)
class Profile:
    """Prefill and decode predictors of one deployed model on one kind of machine, from one JSON file."""

    prefill: Any  # PrefillPredictor with to_dict()
    decode: Any  # DecodePredictor with to_dict()
    model: str = ""
    device: str = ""
    kv_bytes_per_token: int = 0
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def to_dict(self) -> dict[str, Any]:
        return {"version": PROFILE_VERSION, "model": self.model, "device": self.device,
                "kv_bytes_per_token": self.kv_bytes_per_token, "meta": self.meta,
                "prefill": self.prefill.to_dict(), "decode": self.decode.to_dict()}

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> Profile:
        if obj.get("version") != PROFILE_VERSION:
            raise ValueError(f"profile version {obj.get('version')!r}, expected {PROFILE_VERSION}")
        return cls(_load_kind(PREFILL_KINDS, obj["prefill"], "prefill"), _load_kind(DECODE_KINDS, obj["decode"], "decode"),
                   obj.get("model", ""), obj.get("device", ""), int(obj.get("kv_bytes_per_token", 0)), dict(obj.get("meta", {})))


def _load_kind(kinds: dict[str, Any], obj: dict[str, Any], what: str) -> Any:
    kind = obj.get("kind")
    if kind not in kinds:
        raise ValueError(f"{what} model kind {kind!r} is not one of {sorted(kinds)}")
    return kinds[kind].from_dict(obj)


def analytic_profile(model: ModelSpec = LLAMA3_70B, hw: HardwareSpec = A800_X8,
                     prefill_efficiency: float = 0.5, decode_efficiency: float = 0.8) -> Profile:
    """A profile computed from dimensions and datasheet rates, for simulating models we cannot run."""
    return Profile(AnalyticPrefillModel.from_specs(model, hw, prefill_efficiency),
                   AnalyticDecodeModel.from_specs(model, hw, decode_efficiency),
                   model=model.name, device=hw.name, kv_bytes_per_token=model.kv_bytes_per_token,
                   meta={"source": "analytic"})
