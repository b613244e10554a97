"""Boot the RDMA test VM under qemu's software emulation and run one command in it.

    qemu-system-x86_64 -accel tcg,thread=multi -cpu max -machine q35   (no -enable-kvm: this host's
        /dev/kvm only runs specially built guest kernels; a stock Debian kernel hangs under it)
    -kernel/-initrd from the image, root=/dev/vda on the image's disk with snapshot=on (the cached
        image never changes), three 9p shares:
            run   a fresh directory per run: guest.sh, command.sh, env.sh in; rc and logs out
            repo  the project's tree, read-only, at /work in the guest
            deps  the guest's Python packages (image.build_pydeps), read-only, on PYTHONPATH
    user networking: the guest reaches the host's 127.0.0.1 as 10.0.2.2 (HOST_FROM_GUEST)

The guest's exit status comes back through the run share (qemu's own says nothing); None when the
guest never got to write one (a kernel panic, the timeout). The VM is killed by its pid when the
timeout passes or the wait is interrupted, and by the kernel when the process that started it dies.
"""

from __future__ import annotations

import ctypes
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tools.rdma_vm.image import CACHE_DIR, ROOT_DIR, Image

HOST_FROM_GUEST = "10.0.2.2"  # the host's loopback, as user networking shows it to the guest
GUEST_SCRIPT = Path(__file__).with_name("guest.sh")
QEMU = "qemu-system-x86_64"
PR_SET_PDEATHSIG = 1  # prctl(2)


class QemuUnavailable(RuntimeError):
    """Raised when qemu-system-x86_64 is not installed."""


@dataclass(frozen=True)
class GuestResult:
    rc: int | None  # the command's exit status in the guest; None: it never finished
    output: str  # the command's stdout and stderr
    guest_log: str  # guest.sh's own log (shares, network, rxe setup)
    console: str  # the serial console (kernel messages)
    wall_s: float  # from starting qemu until it exited
    started_s: float | None  # from starting qemu until the command began (boot + setup)
    run_dir: Path  # kept: files the command wrote to /run/moonbus are there

    @property
    def ok(self) -> bool:
        return self.rc == 0


def qemu_args(image: Image, run_dir: Path, memory_mb: int, cpus: int, repo: Path) -> list[str]:
    share = "local,security_model=none"
    return [
        QEMU, "-accel", "tcg,thread=multi", "-cpu", "max", "-machine", "q35",
        "-m", str(memory_mb), "-smp", str(cpus),
        "-display", "none", "-vga", "none", "-monitor", "none", "-no-reboot",
        "-serial", f"file:{run_dir / 'console.log'}",
        "-kernel", str(image.kernel), "-initrd", str(image.initrd),
        "-append", "root=/dev/vda rw console=ttyS0 init=/sbin/moonbus-init panic=-1 quiet loglevel=4",
        "-drive", f"file={image.disk},if=virtio,format=raw,snapshot=on",
        "-virtfs", f"{share},path={run_dir},mount_tag=run",
        "-virtfs", f"{share},path={repo},mount_tag=repo,readonly=on",
        "-virtfs", f"{share},path={image.pydeps},mount_tag=deps,readonly=on",
        "-netdev", "user,id=net0", "-device", "virtio-net-pci,netdev=net0",
    ]


GUEST_MEMORY_MB = 1536  # the guest's RAM unless a run asks for more


def run(image: Image, command: str, env: dict[str, str] | None = None, timeout_s: float = 600,
        memory_mb: int = GUEST_MEMORY_MB, cpus: int = 2, repo: Path = ROOT_DIR, log_to: Path | None = None) -> GuestResult:
    """Boot, run `command` (sh syntax) in the guest's /work, power off; never longer than timeout_s."""
    if shutil.which(QEMU) is None:
        raise QemuUnavailable(f"{QEMU} is not installed (apt-get install qemu-system-x86)")
    runs = CACHE_DIR / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=runs))
    shutil.copy(GUEST_SCRIPT, run_dir / "guest.sh")
    (run_dir / "command.sh").write_text(command + "\n")
    (run_dir / "env.sh").write_text("".join(f"export {k}={shlex.quote(v)}\n" for k, v in (env or {}).items()))
    started = time.monotonic()
    with open(run_dir / "qemu.log", "wb") as out:
        proc = subprocess.Popen(qemu_args(image, run_dir, memory_mb, cpus, repo), stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        finally:  # the timeout, or anything that interrupts the wait (Ctrl-C, a test's timeout)
            if proc.poll() is None:
                proc.kill()  # our own child, by its pid
                proc.wait()
    wall = time.monotonic() - started
    result = GuestResult(_read_rc(run_dir / "rc"), _read(run_dir / "output.log"), _read(run_dir / "guest.log"),
                         _read(run_dir / "console.log") + _read(run_dir / "qemu.log"), wall,
                         _command_started(run_dir / "guest.log"), run_dir)
    if log_to is not None:
        log_to.write_text(f"rc={result.rc} wall={wall:.1f}s started={result.started_s}\n--- output\n{result.output}"
                          f"\n--- guest.log\n{result.guest_log}\n--- console\n{result.console}")
    return result


def _die_with_parent() -> None:
    """In qemu's child before exec: qemu is killed when the process that started it dies (a test
    run killed outright leaves no VM behind)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def prune_runs(keep: int = 5) -> None:
    """Keep only the newest `keep` run directories (their logs are what a failed run leaves)."""
    runs = sorted((CACHE_DIR / "runs").glob("run-*"), key=lambda p: p.stat().st_mtime)
    for old in runs[:-keep] if keep else runs:
        shutil.rmtree(old, ignore_errors=True)


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _read_rc(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _command_started(guest_log: Path) -> float | None:
    """The guest's uptime when the command began (its boot and setup under emulation)."""
    for line in _read(guest_log).splitlines():
        if line.startswith("guest: command started at uptime"):
            return float(line.split()[-2])
    return None
