"""The images compose runs: a base image with Python 3.11, and the project image on top of it.

Base image, first that works:
  1. $MOONBUS_BASE_IMAGE, if set (it must exist locally or be pullable);
  2. python:3.11-slim (the Dockerfile's default) if the engine already has it;
  3. our own base built before, tagged moonbus/pybase:bookworm-<key> where <key> hashes what
     went into it (suite, mirror, package list), so a changed list builds a new one;
  4. python:3.11-slim pulled from the registry;
  5. built here without any registry: debootstrap a minimal Debian root with python3 and its
     venv module, then `tar | docker import` it (about a minute; Docker keeps it, so once).

Project image: docker/Dockerfile, built with the legacy builder (this Docker CLI may lack buildx),
the network of the host (the engine we start has no bridge of its own), the host's extra CA
certificates (its egress re-signs TLS) and, when the machine has one, the local torch wheel. The
build context is a tar stream made here from the work tree, filtered by .dockerignore the way the
docker CLI filters a directory, with the wheel added as docker/wheels/<name>: nothing is written
into the work tree.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

PUBLIC_BASE = "python:3.11-slim"
PROJECT_IMAGE = "moonbus:latest"
DEBIAN_SUITE = "bookworm"  # python3 is 3.11 there, as in the public base
DEBIAN_MIRROR = "http://deb.debian.org/debian"
BASE_PACKAGES = ("ca-certificates", "python3", "python3-venv", "g++")  # g++: the decode attention kernel
# the import gives the image no environment; the Dockerfile's `PATH=/opt/venv/bin:$PATH` needs one
BASE_CHANGES = ("ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "ENV LANG=C.UTF-8",
                'CMD ["python3"]')
BASE_BUILD_DIR = Path(os.environ.get("MOONBUS_BASE_BUILD_DIR", "/var/cache/moonbus-docker"))
TORCH_WHEEL_GLOB = "torch-2.13.0*-cp311-cp311-*linux*x86_64.whl"
CA_CERTS_GLOB = "/usr/local/share/ca-certificates/*.crt"


class BaseImageUnavailable(RuntimeError):
    """Raised when no base image can be pulled and debootstrap, which would build one, is missing."""


class BuildFailed(RuntimeError):
    """Raised when debootstrap, `docker import` or `docker build` fails; the message ends with its log."""


@dataclass(frozen=True)
class BuiltImage:
    tag: str
    base: str
    torch_wheel: str | None  # the local wheel's file name, or None (torch from the CPU index)
    extra_ca_certs: int  # how many certificate files were added
    seconds: float


def image_exists(tag: str) -> bool:
    return subprocess.run(["docker", "image", "inspect", tag], capture_output=True).returncode == 0


def local_base_tag() -> str:
    key = json.dumps({"suite": DEBIAN_SUITE, "mirror": DEBIAN_MIRROR, "variant": "minbase",
                      "packages": sorted(BASE_PACKAGES), "changes": BASE_CHANGES})
    return f"moonbus/pybase:{DEBIAN_SUITE}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def ensure_base_image(log_path: Path, pull_timeout_s: float = 60) -> str:
    """Return the tag of a base image the engine has, building one where none can be pulled."""
    wanted = os.environ.get("MOONBUS_BASE_IMAGE")
    if wanted:
        if not (image_exists(wanted) or _pull(wanted, pull_timeout_s)):
            raise BuildFailed(f"MOONBUS_BASE_IMAGE={wanted} is neither here nor pullable")
        return wanted
    local = local_base_tag()
    for tag in (PUBLIC_BASE, local):
        if image_exists(tag):
            return tag
    if _pull(PUBLIC_BASE, pull_timeout_s):
        return PUBLIC_BASE
    if shutil.which("debootstrap") is None:
        raise BaseImageUnavailable(f"{PUBLIC_BASE} cannot be pulled and debootstrap is not installed "
                                   "(apt-get install debootstrap) to build a base image without a registry")
    build_local_base(local, log_path)
    return local


def build_local_base(tag: str, log_path: Path) -> None:
    """debootstrap a minimal root with python3 + venv, then import it as `tag`."""
    root = BASE_BUILD_DIR / f"rootfs-{tag.rsplit('-', 1)[-1]}"
    shutil.rmtree(root, ignore_errors=True)  # a partial one from an interrupted run
    root.parent.mkdir(parents=True, exist_ok=True)
    had_run_mount = os.path.exists("/run/mount")  # debootstrap's mount commands create it
    try:
        with open(log_path, "ab") as out:
            _check(subprocess.run(["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}",
                                   DEBIAN_SUITE, str(root), DEBIAN_MIRROR], stdout=out, stderr=subprocess.STDOUT),
                   "debootstrap", log_path)
            # Docker gives containers their own /dev, /proc, /sys; apt's caches only add size.
            tar = subprocess.Popen(["tar", "-C", str(root), "--exclude=./dev/*", "--exclude=./proc/*",
                                    "--exclude=./sys/*", "--exclude=./var/cache/apt/*",
                                    "--exclude=./var/lib/apt/lists/*", "-c", "."], stdout=subprocess.PIPE)
            changes = [arg for change in BASE_CHANGES for arg in ("--change", change)]
            imported = subprocess.run(["docker", "import", *changes, "-", tag], stdin=tar.stdout,
                                      stdout=out, stderr=subprocess.STDOUT)
            tar.stdout.close()
            tar.wait()
            _check(imported, "docker import", log_path)
    finally:
        shutil.rmtree(root, ignore_errors=True)  # Docker keeps the image; the root is not needed
        if not had_run_mount:
            shutil.rmtree("/run/mount", ignore_errors=True)


def find_torch_wheel() -> Path | None:
    """The local torch 2.13.0 CPU wheel: $MOONBUS_TORCH_WHEEL, or one in pip's find-links dirs."""
    explicit = os.environ.get("MOONBUS_TORCH_WHEEL")
    if explicit:
        return Path(explicit) if Path(explicit).is_file() else None
    result = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    dirs = [d for line in result.stdout.splitlines() if "find-links=" in line
            for d in line.split("=", 1)[1].strip("'\"").split()]
    for directory in dirs:
        matches = sorted(glob.glob(os.path.join(directory.removeprefix("file://"), TORCH_WHEEL_GLOB)))
        if matches:
            return Path(matches[-1])
    return None


def extra_ca_certs() -> list[Path]:
    return [Path(p) for p in sorted(glob.glob(CA_CERTS_GLOB))]


def build_project_image(root: Path, base: str, log_path: Path, tag: str = PROJECT_IMAGE,
                        remove_replaced: bool = False) -> BuiltImage:
    """docker build docker/Dockerfile from a tar stream of `root` (+ the torch wheel, if any).

    remove_replaced: remove the image `tag` named before, once the build has replaced it (with
    the layers only it used). NOTE: not `docker image prune`: the torch stage's images are
    untagged, and pruning them would throw away the cache of the slowest step.
    """
    started = time.monotonic()
    replaced = _image_id(tag)
    wheel, certs = find_torch_wheel(), extra_ca_certs()
    args = ["docker", "build", "--network", "host", "-f", "docker/Dockerfile", "-t", tag,
            "--build-arg", f"BASE_IMAGE={base}"]
    if certs:
        pem = "\n".join(p.read_text().strip() for p in certs)
        args += ["--build-arg", f"EXTRA_CA_CERTS={pem}"]
    if wheel:
        args += ["--build-arg", f"TORCH_WHEEL={wheel.name}"]
    env = os.environ | {"DOCKER_BUILDKIT": "0"}  # the legacy builder takes a tar context on stdin
    with open(log_path, "ab") as out:
        proc = subprocess.Popen([*args, "-"], stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            # GNU format: the docker CLI tells a tar from a Dockerfile by parsing the first header
            # within the first 1 KiB, which a pax header block would push out of reach.
            with tarfile.open(fileobj=proc.stdin, mode="w|", format=tarfile.GNU_FORMAT) as tar:
                for path, arcname in context_files(root):
                    tar.add(path, arcname=arcname, recursive=False, filter=_normalize)
                if wheel:
                    tar.add(wheel, arcname=f"docker/wheels/{wheel.name}", filter=_normalize)
            proc.stdin.close()
        except BrokenPipeError:
            pass  # docker stopped reading: its exit status and log say why
        _check(subprocess.CompletedProcess(args, proc.wait()), "docker build", log_path)
    if remove_replaced and replaced and replaced != _image_id(tag):
        subprocess.run(["docker", "rmi", replaced], capture_output=True)
    return BuiltImage(tag, base, wheel.name if wheel else None, len(certs), time.monotonic() - started)


def context_files(root: Path):
    """(path, name in the context) for every file `docker build root` would send, in a fixed order."""
    patterns = dockerignore_patterns(root)
    can_prune = not any(exception for _, exception in patterns)  # else a file below may be let back in
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        rel_dir = "" if rel_dir == "." else rel_dir + "/"
        dirnames[:] = sorted(d for d in dirnames if not (can_prune and _ignored(rel_dir + d, patterns)))
        for name in sorted(filenames):
            rel = rel_dir + name
            if not _ignored(rel, patterns):
                yield os.path.join(root, rel), rel


def dockerignore_patterns(root: Path) -> list[tuple[re.Pattern, bool]]:
    """(pattern, is_exception) for each line of .dockerignore, in order (the last match wins)."""
    path = root / ".dockerignore"
    lines = path.read_text().splitlines() if path.exists() else []
    patterns = []
    for line in (l.strip() for l in lines):
        if not line or line.startswith("#"):
            continue
        exception = line.startswith("!")
        cleaned = os.path.normpath(line.lstrip("!").strip()).lstrip("/")
        regex = ""
        for part in re.split(r"(\*\*/?|\*|\?)", cleaned):
            regex += {"**": ".*", "**/": "(.*/)?", "*": "[^/]*", "?": "[^/]"}.get(part, re.escape(part))
        patterns.append((re.compile(regex + "$"), exception))
    return patterns


def _ignored(rel: str, patterns: list[tuple[re.Pattern, bool]]) -> bool:
    # As the docker CLI does: a pattern excludes a path when it matches it or any directory above it.
    parts = rel.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    ignored = False
    for regex, exception in patterns:
        if any(regex.match(p) for p in prefixes):
            ignored = not exception
    return ignored


def _normalize(info: tarfile.TarInfo) -> tarfile.TarInfo:
    # Owned by root, like the docker CLI's own context; the builder's cache ignores times.
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mtime = int(info.mtime)
    return info


def _image_id(tag: str) -> str | None:
    result = subprocess.run(["docker", "image", "inspect", "--format", "{{.Id}}", tag], capture_output=True, text=True)
    return result.stdout.strip() if result.returncode == 0 else None


def _pull(tag: str, timeout_s: float) -> bool:
    try:
        return subprocess.run(["docker", "pull", tag], capture_output=True, timeout=timeout_s).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def _check(result: subprocess.CompletedProcess, what: str, log_path: Path) -> None:
    if result.returncode != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
        raise BuildFailed(f"{what} failed (exit {result.returncode}); {log_path} ends:\n{tail}")


def main() -> int:
    """`make images`: the images a stack runs (`docker stack deploy` ignores build:), built on the
    Docker engine that answers: the base image where none is there, then moonbus:latest."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from tools.compose_e2e.engine import docker_answers

    if not docker_answers():
        print("images: no Docker engine answers (start dockerd, or run `make compose-test`, which starts its own)",
              file=sys.stderr)
        return 1
    log_path = Path(os.environ.get("MOONBUS_IMAGES_LOG", "/tmp/moonbus-images.log"))
    try:
        base = ensure_base_image(log_path)
        built = build_project_image(Path(__file__).resolve().parents[2], base, log_path)
    except (BaseImageUnavailable, BuildFailed) as exc:
        print(f"images: {exc}", file=sys.stderr)
        return 1
    print(f"{built.tag} on {built.base} in {built.seconds:.1f} s (torch from {built.torch_wheel or 'the CPU index'}; "
          f"log {log_path}); a swarm's other nodes need it too (docker save | docker load, or a registry)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
