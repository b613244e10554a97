"""Components a test may need that a machine may lack, and what a missing one means.

Outside CI a missing component skips its tests, saying why (`make test` prints every skip reason).
`MOONBUS_REQUIRE` (comma-separated names, or `all`; `.ci/run` sets `all`) turns that skip into a
failure, so a run that must prove them cannot pass with them untested:

    rdma      soft-RoCE in the qemu VM (tests/integration/test_rdma_vm.py)
    compose   a Docker engine and compose (tests/integration/test_compose_e2e.py, tests/unit/test_compose.py)
    hosts     network namespaces for nodes on separate hosts (tests/integration/test_hosts.py)
    mounts    a private mount namespace (root and unshare(1)) with a read-only bind mount, the model
              store as containers mount it (tests/unit/test_models.py)
    browser   headless chromium and chromedriver (tests/integration/test_dashboard.py)
    mooncake  Mooncake's Transfer Engine, the transfer bench's baseline (tests/integration/test_bench_transfer.py)
    kernel    the engine's C++ kernels built for this CPU (tests/unit/test_attention_kernel.py,
              test_prefill_attention.py; without them the engine attends with torch's ops, and says so)
    history   the git history back to the hand-written codec msgspec replaced, the wire bench's baseline
              (tests/integration/test_bench_wire.py; a shallow clone lacks it: `git fetch --unshallow`)
"""

from __future__ import annotations

import os

import pytest

COMPONENTS = ("rdma", "compose", "hosts", "mounts", "browser", "mooncake", "kernel", "history")


def required(component: str) -> bool:
    if component not in COMPONENTS:
        raise ValueError(f"unknown component {component!r}; known: {COMPONENTS}")
    wanted = {c.strip() for c in os.environ.get("MOONBUS_REQUIRE", "").split(",") if c.strip()}
    return "all" in wanted or component in wanted


def missing(component: str, why: str) -> None:
    """The component cannot run here: fail if this run requires it, else skip. Never returns."""
    if required(component):
        pytest.fail(f"{component} is required (MOONBUS_REQUIRE) but cannot run here: {why}", pytrace=False)
    pytest.skip(f"{component}: {why}")
