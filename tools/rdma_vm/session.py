"""What the host runs around the VM: a nats-server the guest reaches, the in-guest tests, the bench.

    with_host_nats(fn)     a nats-server on the host's 127.0.0.1 (JetStream on, store in a temp
                           dir) for the duration of fn(guest_url); the guest reaches it through
                           user networking at 10.0.2.2
    guest_pytest(...)      `python3 -m pytest tests/rdma` in the guest; a JUnit XML report comes
                           back through the run share (GuestResult.run_dir / "junit.xml")
    run_bench(...)         perftest's ib_write_bw / ib_read_bw and the rdma backend
                           (tools/rdma_vm/bench_guest.py) on the same rxe device, one VM boot
"""

from __future__ import annotations

import json
import shlex
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable, TypeVar

from tools.moonbus.cluster.processes import free_port, nats_server_binary
from tools.rdma_vm.image import Image
from tools.rdma_vm import vm

T = TypeVar("T")
GUEST_PYTEST = "python3 -m pytest -q -p no:cacheprovider -o addopts= -rs --junitxml=/run/moonbus/junit.xml"


def with_host_nats(fn: Callable[[str], T]) -> T:
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="moonbus-rdma-nats-") as store:
        with open(Path(store) / "nats.log", "wb") as log:
            proc = subprocess.Popen([nats_server_binary(), "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", store],
                                    stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_listening(port, 10.0)
            return fn(f"nats://{vm.HOST_FROM_GUEST}:{port}")
        finally:
            proc.terminate()  # our own child, by its pid
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def guest_pytest(image: Image, nats_url: str, args: list[str] | None = None, timeout_s: float = 600,
                 env: dict[str, str] | None = None, python_path: str = "", memory_mb: int = vm.GUEST_MEMORY_MB) -> vm.GuestResult:
    """`python_path`: more for the guest's PYTHONPATH (e.g. the shared venv's site-packages, for torch)."""
    command = f"{GUEST_PYTEST} {' '.join(shlex.quote(a) for a in (args or ['tests/rdma']))}"
    if python_path:
        command = f"PYTHONPATH=$PYTHONPATH:{shlex.quote(python_path)} {command}"
    return vm.run(image, command, env={"MOONBUS_RDMA_NATS_URL": nats_url, **(env or {})}, timeout_s=timeout_s,
                  memory_mb=memory_mb)


def run_bench(image: Image, mib: int, timeout_s: float = 900) -> tuple[vm.GuestResult, str]:
    """(result, table): MB/s of ib_write_bw, ib_read_bw and the rdma backend's write and read."""
    result = vm.run(image, f"python3 -m tools.rdma_vm.bench_guest --mib {mib} --out /run/moonbus/bench.json",
                    timeout_s=timeout_s)
    path = result.run_dir / "bench.json"
    if not path.exists():
        return result, "no bench results (see the output)"
    rows = json.loads(path.read_text())
    lines = [f"{'what':<44} {'MB/s':>8} {'vs perftest':>12}"]
    for row in rows:
        ratio = f"{row['ratio']:.2f}" if row.get("ratio") is not None else ""
        lines.append(f"{row['what']:<44} {row['mb_s']:>8.1f} {ratio:>12}")
    return result, "\n".join(lines)


def _wait_listening(port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nats-server did not listen on port {port}")
