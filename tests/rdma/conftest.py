"""Tests that need a real RDMA device: collected only inside the RDMA test VM.

tests/integration/test_rdma_vm.py boots the VM (tools/rdma_vm), where guest.sh creates the
soft-RoCE device rxe0 and sets MOONBUS_RDMA_GUEST=1; anywhere else these files are not collected
(that test reports their results). The guest has no torch: import only what the transport needs.
"""

from __future__ import annotations

import os

import pytest

from tests import required

IN_GUEST = os.environ.get("MOONBUS_RDMA_GUEST") == "1"
if not IN_GUEST:
    collect_ignore_glob = ["test_*.py"]

DEVICE = os.environ.get("MOONBUS_RDMA_DEVICE", "rxe0")
NATS_URL = os.environ.get("MOONBUS_RDMA_NATS_URL", "")  # the host's nats-server, as the guest reaches it


@pytest.fixture
def nats_url() -> str:
    if not NATS_URL:
        required.missing("rdma", "no nats-server given (MOONBUS_RDMA_NATS_URL)")
    return NATS_URL
