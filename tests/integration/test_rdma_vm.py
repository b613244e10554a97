"""The RDMA tests (tests/rdma) on soft-RoCE inside a qemu VM (tools/rdma_vm), reported here.

    the image    cached under tools/rdma_vm's CACHE_DIR, keyed on its package list; built here when
                 missing (debootstrap, about 2-3 minutes, a child process killed past BUILD_S)
    one boot     the control plane on this host (nats-server, conductor, cache index, gateway:
                 the guest reaches them at 10.0.2.2), then `pytest tests/rdma` in the guest: the
                 verbs layer, the rdma backend, two messengers pulling blocks over rdma, and a
                 model's prefill and decode nodes handing its KV off over rdma (tests/rdma/model,
                 greedy tokens checked against generate() run here); qemu is killed past VM_S.
                 It starts in the background as soon as the session has collected this module
                 (tests/integration/conftest.py), so the other tests run meanwhile
    the checks   the guest's pytest exited 0, and its JUnit report has every test of tests/rdma
                 passed: none failed, errored or skipped

Skips, saying what is missing, where the VM cannot run here: no qemu-system-x86_64, or no cached
image and no way to build one (debootstrap, mkfs.ext4, root, the Debian mirror), or too little
memory for the guest. `make rdma-tools` installs qemu and debootstrap where apt-get can.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import urllib.request
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from common import models
from tools.moonbus.cluster.processes import Cluster, ClusterSpec, free_port
from tools.rdma_vm import image as vm_image
from tools.rdma_vm import vm
from tools.rdma_vm.session import guest_pytest, with_host_nats

from tests import required
from tests.integration.conftest import reference_greedy

ROOT = Path(__file__).resolve().parents[2]
RDMA_TESTS = ROOT / "tests" / "rdma"
BUILD_S = 1200  # debootstrap over a slow mirror; a cached image skips this
VM_S = 1500  # boot (~15 s under emulation), the transport tests (~2 min), torch imported once (minutes)
GUEST_MEMORY_MB = 3072  # torch and four service processes
GUEST_MEMORY_BYTES = GUEST_MEMORY_MB << 20
MODEL_PROMPTS = ["The quick brown fox jumps over the lazy dog. " * 6, "Soft-RoCE moves bytes one-sidedly. " * 9]
MODEL_TOKENS = 8

pytestmark = [pytest.mark.integration, pytest.mark.timeout(BUILD_S + VM_S + 120)]


def expected_tests() -> set[str]:
    """'module::name' of every test function in tests/rdma (what the guest must report as passed)."""
    found = set()
    for path in sorted(RDMA_TESTS.rglob("test_*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
                found.add(f"{path.stem}::{node.name}")
    return found


def why_unusable() -> str | None:
    """Why the VM cannot run on this machine (None: it can)."""
    if shutil.which(vm.QEMU) is None:
        return f"{vm.QEMU} is not installed (`make rdma-tools`, or apt-get install qemu-system-x86)"
    if _available_memory() < GUEST_MEMORY_BYTES + (512 << 20):
        return f"less than {(GUEST_MEMORY_BYTES >> 20) + 512} MiB of memory available for the VM"
    if vm_image.cached_image() is not None:
        return None
    missing = vm_image.missing_tools()
    if missing:
        return f"no cached image in {vm_image.CACHE_DIR} and cannot build one: missing {', '.join(missing)}"
    release = f"{vm_image.DEBIAN_MIRROR}/dists/{vm_image.DEBIAN_SUITE}/Release"
    try:
        urllib.request.urlopen(urllib.request.Request(release, method="HEAD"), timeout=15).close()
    except OSError as exc:
        return f"no cached image in {vm_image.CACHE_DIR} and the Debian mirror is unreachable ({release}: {exc})"
    return None


def build_image() -> vm_image.Image:
    """The cached image, built in a child process (its own process group, killed past BUILD_S)."""
    image = vm_image.cached_image()
    if image is not None:
        return image
    proc = subprocess.Popen([sys.executable, "-m", "tools.rdma_vm", "build"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    out = b""
    try:
        out, _ = proc.communicate(timeout=BUILD_S)
    except subprocess.TimeoutExpired:
        out = f"still building after {BUILD_S} s (the build log is under {vm_image.CACHE_DIR})".encode()
    finally:
        if proc.poll() is None:  # past BUILD_S, or interrupted: debootstrap and its children too
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    image = vm_image.cached_image()
    if proc.returncode != 0 or image is None:
        pytest.fail(f"building the RDMA VM image failed (exit {proc.returncode}):\n{out.decode(errors='replace')[-4000:]}")
    return image


@pytest.fixture(scope="module")
def guest_run() -> vm.GuestResult:
    """The one VM boot of the session (started in the background at collection; else now)."""
    why = why_unusable()
    if why is not None:
        required.missing("rdma", why)
    return GuestRun.shared().result()


class GuestRun:
    """tests/rdma in the guest against this host's control plane, on a thread of its own."""

    _shared: "GuestRun | None" = None

    def __init__(self) -> None:
        self._result: vm.GuestResult | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="rdma-vm", daemon=True)

    @classmethod
    def shared(cls) -> "GuestRun":
        """The session's run, started on first use."""
        if cls._shared is None:
            cls._shared = cls()
            cls._shared._thread.start()
        return cls._shared

    def result(self) -> vm.GuestResult:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result

    def _run(self) -> None:
        try:
            image = build_image()
            with tempfile.TemporaryDirectory(prefix="moonbus-rdma-host-") as home:
                self._result = guest_suite(image, Path(home))
            vm.prune_runs(keep=10)
        except BaseException as exc:  # noqa: BLE001 - raised in the test that waits for it
            self._error = exc


def guest_suite(image, home: Path) -> vm.GuestResult:
    """The host's control plane (auth off: the guest is this test's own), the references, one boot."""
    (ROOT / ".moonbus").mkdir(mode=0o700, exist_ok=True)  # as `moonbus up` makes it: the owner's alone
    ref = models.prepare(models.TINY_RANDOM, ROOT / ".moonbus" / "rdma-vm-model")  # where the guest sees it too
    guest_model = "/work/" + str(ref.path.relative_to(ROOT))
    tokenizer, model = models.load_tokenizer(ref), models.load_model(ref, "float32")
    expected = []
    for prompt in MODEL_PROMPTS:  # the references, here: the guest has no transformers to spend minutes on
        ids = tokenizer(prompt)["input_ids"]
        want = reference_greedy(model, ids, MODEL_TOKENS, ignore_eos=True)
        expected.append([prompt, ids, want.tokens, want.margins])
    spec = ClusterSpec(home=home, model=str(ref.path), prefill=0, decode=0, auth=False, admission="none",
                       ttft_slo_s=600.0, dtype="float32", port=free_port(), nats_port=free_port())
    cluster = Cluster(spec)  # nats-server, conductor, cache index, gateway: the nodes join from the guest
    cluster.start(ready_timeout_s=300)
    try:
        # the guest's tests are the rdma component: one that cannot run there fails (tests/required.py)
        env = {"MOONBUS_REQUIRE": "rdma",
               "MOONBUS_RDMA_MODEL_DIR": guest_model, "MOONBUS_RDMA_EXPECTED": json.dumps(expected),
               "MOONBUS_RDMA_GATEWAY_URL": f"http://{vm.HOST_FROM_GUEST}:{spec.port}",
               "MOONBUS_RDMA_MODEL_NATS_URL": f"nats://{vm.HOST_FROM_GUEST}:{spec.nats_port}",
               "MOONBUS_RDMA_TORCH_PATH": "/work/.venv/lib/python3.11/site-packages"}
        # the transport tests get a bare nats-server of their own: no conductor to refuse their test nodes
        return with_host_nats(lambda url: guest_pytest(image, url, ["-o", f"timeout={VM_S - 120}", "-s", "tests/rdma"],
                                                       timeout_s=VM_S, env=env, memory_mb=GUEST_MEMORY_MB))
    finally:
        cluster.stop()


def test_the_guest_suite_passes(guest_run, capsys):
    r = guest_run
    with capsys.disabled():  # the guest's own report belongs in the CI log, pass or fail
        print(f"\n--- RDMA VM: guest pytest exit {r.rc}; VM wall {r.wall_s:.0f} s, tests began at guest "
              f"uptime {r.started_s} s; logs in {r.run_dir}\n{r.output.rstrip()[-6000:]}\n---")
    if r.rc is None:  # it never finished: the boot or the guest's setup is the news
        pytest.fail(f"the guest never finished (VM wall {r.wall_s:.0f} s)\n--- guest.log\n{r.guest_log[-3000:]}"
                    f"\n--- console\n{r.console[-3000:]}")
    assert r.rc == 0, f"pytest in the guest exited {r.rc} (output above; logs in {r.run_dir})"


def test_every_rdma_test_ran_and_passed(guest_run):
    report = guest_run.run_dir / "junit.xml"
    assert report.exists(), f"the guest wrote no JUnit report (exit {guest_run.rc}; logs in {guest_run.run_dir})"
    outcomes = junit_outcomes(report)
    bad = {name: outcome for name, outcome in outcomes.items() if outcome != "passed"}
    assert not bad, f"not passed in the guest: {bad}"
    missing = expected_tests() - set(outcomes)
    assert not missing, f"never ran in the guest: {sorted(missing)}"


def junit_outcomes(path: Path) -> dict[str, str]:
    """'module::name' -> passed | failure | error | skipped, from pytest's JUnit XML."""
    outcomes = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").rsplit(".", 1)[-1]
        name = case.get("name", "").split("[", 1)[0]
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        key = f"{module}::{name}"
        outcome = kinds[0] if kinds else "passed"
        if outcomes.get(key, "passed") == "passed":  # a parametrized test: its worst case counts
            outcomes[key] = outcome
    return outcomes


def _available_memory() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62  # unknown: let qemu say
