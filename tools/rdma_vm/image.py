"""The VM image: a Debian root with soft-RoCE, pyverbs and perftest, as an ext4 disk plus its kernel.

Built once and cached outside the work tree, under CACHE_DIR/image-<key>/ where <key> hashes
everything that goes into it (suite, mirror, package list, initramfs modules, the guest's PID 1,
BUILD_VERSION): a changed list builds a new image, an unchanged one is reused.

    debootstrap --variant=minbase --include=PACKAGES bookworm ROOT MIRROR
    initramfs with MODULES=list (virtio_pci, virtio_blk, ext4): 5.5 MB instead of 35 MB, which
        under software emulation is seconds of boot
    ROOT/sbin/moonbus-init     PID 1: mounts the run share and runs its guest.sh (tools/rdma_vm/guest.sh)
    mkfs.ext4 -d ROOT disk.img (no loop mount), vmlinuz and initrd.img copied beside it

The guest's Python packages that Debian does not ship at the project's pinned versions (nats-py,
orjson, xxhash, pytest, ...) are installed on the host with `pip install --target` into
CACHE_DIR/pydeps-<key>/ and put on the guest's PYTHONPATH: host and guest both run CPython 3.11 on
x86_64 glibc, so the host's manylinux wheels work there.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

log = logging.getLogger(__name__)

ROOT_DIR = Path(__file__).resolve().parents[2]
CACHE_DIR = Path(os.environ.get("MOONBUS_RDMA_VM_CACHE", "/var/cache/moonbus-rdma-vm"))
BUILD_VERSION = 1  # bump when the build steps change in a way the key below does not see
DEBIAN_SUITE = "bookworm"  # Python 3.11, as on the host: the host's wheels work in the guest
DEBIAN_MIRROR = os.environ.get("MOONBUS_DEBIAN_MIRROR", "http://deb.debian.org/debian")
PACKAGES = (
    "linux-image-amd64", "kmod", "iproute2", "procps",  # kernel with rdma_rxe, modprobe, ip/rdma, ps
    "rdma-core", "ibverbs-providers", "ibverbs-utils",  # libibverbs + the rxe provider, ibv_devinfo
    "python3", "python3-pyverbs",  # pyverbs from rdma-core 44
    "perftest",  # ib_write_bw / ib_read_bw: the reference the rdma backend is measured against
)
INITRD_MODULES = ("virtio_pci", "virtio_blk", "ext4")
DISK_HEADROOM_BYTES = 384 << 20  # free space in the guest's root (its writes go to a snapshot anyway)
# Guest Python packages, at the versions pyproject.toml pins (what the in-guest tests import:
# the transport, schemas, the messenger service and pytest). Pure Python or cp311 manylinux wheels.
GUEST_PYTHON_PACKAGES = (
    "nats-py", "orjson", "xxhash", "numpy", "lmdb", "aiohttp", "prometheus-client", "filelock",
    "uvloop", "msgspec", "cryptography", "psutil",  # the links' keyed MAC; --link-peers auto
    "pytest", "pytest-asyncio", "pytest-timeout",
)

# PID 1 of the guest. Kept tiny and baked into the image; what the VM does lives in the run
# share's guest.sh, so that changing it needs no rebuild.
GUEST_INIT = """#!/bin/sh
# moonbus RDMA test VM: PID 1. Mount what the kernel does not, then run the run share's guest.sh.
PATH=/usr/sbin:/usr/bin:/sbin:/bin
export PATH
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev 2>/dev/null
mkdir -p /dev/pts /dev/shm /run /tmp /run/moonbus
mount -t devpts devpts /dev/pts
mount -t tmpfs tmpfs /dev/shm
mount -t tmpfs tmpfs /run
mount -t tmpfs tmpfs /tmp
mkdir -p /run/moonbus
modprobe -a virtio_pci virtio_net 9pnet_virtio 9p
if mount -t 9p -o trans=virtio,version=9p2000.L,msize=524288 run /run/moonbus; then
    sh /run/moonbus/guest.sh
else
    echo "moonbus-init: cannot mount the run share" >&2
fi
sync
echo o > /proc/sysrq-trigger  # power off: qemu exits
sleep 10
"""


class ImageUnavailable(RuntimeError):
    """Raised when the image cannot be built here (no debootstrap or mkfs.ext4, not root)."""


class BuildFailed(RuntimeError):
    """Raised when a build step fails; the message ends with the tail of its log."""


@dataclass(frozen=True)
class Image:
    directory: Path
    disk: Path
    kernel: Path
    initrd: Path
    pydeps: Path
    built_s: float  # seconds spent building now (0.0: reused from the cache)


def image_key() -> str:
    spec = {"suite": DEBIAN_SUITE, "mirror": DEBIAN_MIRROR, "packages": sorted(PACKAGES),
            "initrd_modules": INITRD_MODULES, "init": GUEST_INIT, "version": BUILD_VERSION}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def guest_requirements() -> list[str]:
    """GUEST_PYTHON_PACKAGES pinned as pyproject.toml pins them ("name==version")."""
    project = tomllib.loads((ROOT_DIR / "pyproject.toml").read_text())["project"]
    pins = {}
    for spec in project["dependencies"] + project["optional-dependencies"]["test"]:
        name, _, version = spec.partition("==")
        pins[name.strip().lower()] = version.strip()
    return [f"{name}=={pins[name]}" if pins.get(name) else name for name in GUEST_PYTHON_PACKAGES]


def pydeps_key(requirements: list[str]) -> str:
    spec = {"requirements": requirements, "python": sys.version_info[:2], "version": BUILD_VERSION}
    return hashlib.sha256(json.dumps(spec).encode()).hexdigest()[:16]


def missing_tools() -> list[str]:
    """What building needs and this machine lacks (empty: it can build)."""
    missing = [tool for tool in ("debootstrap", "mkfs.ext4", "chroot") if shutil.which(tool) is None]
    if os.geteuid() != 0:
        missing.append("root (debootstrap needs it)")
    return missing


def cached_image() -> Image | None:
    directory = CACHE_DIR / f"image-{image_key()}"
    pydeps = CACHE_DIR / f"pydeps-{pydeps_key(guest_requirements())}"
    if (directory / "done").exists() and (pydeps / "done").exists():
        return _image(directory, pydeps, 0.0)
    return None


def ensure_image() -> Image:
    """The cached image, built first if needed (safe across processes: a lock file serializes)."""
    image = cached_image()
    if image is not None:
        return image
    missing = missing_tools()
    if missing:
        raise ImageUnavailable(f"cannot build the RDMA VM image: missing {', '.join(missing)}")
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with FileLock(CACHE_DIR / ".lock"):
        directory = CACHE_DIR / f"image-{image_key()}"
        if not (directory / "done").exists():
            build_image(directory)
        pydeps = CACHE_DIR / f"pydeps-{pydeps_key(guest_requirements())}"
        if not (pydeps / "done").exists():
            build_pydeps(pydeps, guest_requirements())
    return _image(directory, pydeps, time.monotonic() - started)


def _image(directory: Path, pydeps: Path, built_s: float) -> Image:
    return Image(directory, directory / "disk.img", directory / "vmlinuz", directory / "initrd.img", pydeps, built_s)


def build_image(directory: Path) -> None:
    shutil.rmtree(directory, ignore_errors=True)  # a partial one from an interrupted build
    directory.mkdir(parents=True)
    root, log_path = directory / "root", directory / "build.log"
    had_run_mount = os.path.exists("/run/mount")  # debootstrap's mount commands create it
    started = time.monotonic()
    try:
        _run(["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", DEBIAN_SUITE, str(root),
              DEBIAN_MIRROR], "debootstrap", log_path)
        _configure_root(root)
        _run(["chroot", str(root), "update-initramfs", "-u", "-k", "all"], "update-initramfs", log_path)
        kernel = _newest(root / "boot", "vmlinuz-*")
        shutil.copy2(kernel, directory / "vmlinuz")
        shutil.copy2(_newest(root / "boot", "initrd.img-*"), directory / "initrd.img")
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists", "usr/share/doc", "usr/share/man"):
            shutil.rmtree(root / junk, ignore_errors=True)
        size = _tree_bytes(root) + DISK_HEADROOM_BYTES
        disk = directory / "disk.img"
        with open(disk, "wb") as fh:
            fh.truncate(size)  # sparse
        _run(["mkfs.ext4", "-q", "-F", "-L", "moonbus-rdma", "-d", str(root), str(disk)], "mkfs.ext4", log_path)
        shutil.rmtree(root)
        (directory / "done").write_text(json.dumps({"seconds": round(time.monotonic() - started, 1),
                                                    "kernel": kernel.name, "packages": PACKAGES}))
        log.info("RDMA VM image built in %.0f s: %s", time.monotonic() - started, directory)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if not had_run_mount:
            shutil.rmtree("/run/mount", ignore_errors=True)


def _configure_root(root: Path) -> None:
    """A small initramfs, PID 1, and a few files a root without systemd or udev wants."""
    conf = root / "etc/initramfs-tools"
    text = (conf / "initramfs.conf").read_text()
    (conf / "initramfs.conf").write_text(text.replace("MODULES=most", "MODULES=list"))
    with open(conf / "modules", "a") as fh:
        fh.write("\n".join(INITRD_MODULES) + "\n")
    init = root / "sbin/moonbus-init"
    init.write_text(GUEST_INIT)
    init.chmod(0o755)
    (root / "etc/hostname").write_text("moonbus-rdma\n")
    (root / "etc/hosts").write_text("127.0.0.1 localhost moonbus-rdma\n")


def build_pydeps(target: Path, requirements: list[str]) -> None:
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    log_path = target.with_suffix(".log")
    _run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-compile",
          "--only-binary=:all:", "--target", str(target), *requirements], "pip install --target", log_path)
    (target / "done").write_text(json.dumps(requirements))


def _run(args: list[str], what: str, log_path: Path) -> None:
    with open(log_path, "ab") as out:
        out.write(f"$ {' '.join(args)}\n".encode())
        out.flush()
        result = subprocess.run(args, stdout=out, stderr=subprocess.STDOUT, env=os.environ | {
            "DEBIAN_FRONTEND": "noninteractive", "LC_ALL": "C"})
    if result.returncode != 0:
        tail = log_path.read_text(errors="replace")[-3000:]
        raise BuildFailed(f"{what} exited {result.returncode}; {log_path} ends with:\n{tail}")


def _newest(directory: Path, pattern: str) -> Path:
    found = sorted(directory.glob(pattern))
    if not found:
        raise BuildFailed(f"no {pattern} in {directory}")
    return found[-1]


def _tree_bytes(root: Path) -> int:
    """Bytes the tree needs on ext4 (rounded up per 4 KiB block, plus inodes)."""
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames + dirnames:
            with contextlib.suppress(OSError):
                total += (os.lstat(os.path.join(dirpath, name)).st_size + 4095) // 4096 * 4096 + 256
    return total
