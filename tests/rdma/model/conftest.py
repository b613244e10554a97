"""A model's KV handed off over rdma, inside the RDMA test VM (opt-in: `make rdma-model-test`).

Collected only in the guest and only when MOONBUS_RDMA_MODEL=1: it needs torch and transformers in
the guest (the host's venv, shared in with the project's tree), and under qemu's software emulation
importing them takes minutes per process (the whole test about 15); the default in-guest suite (tests/rdma) stays
without them.
"""

from __future__ import annotations

import os

if os.environ.get("MOONBUS_RDMA_GUEST") != "1" or os.environ.get("MOONBUS_RDMA_MODEL") != "1":
    collect_ignore_glob = ["test_*.py"]
