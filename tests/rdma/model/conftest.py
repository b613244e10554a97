"""A model's KV handed off over rdma, inside the RDMA test VM: collected only in the guest
(tests/integration/test_rdma_vm.py boots it and gives the host's services and the references).
It needs torch in the guest (the host's venv, shared in with the project's tree); the workers
import no transformers, and tools/rdma_vm/forkserver.py imports torch once for all of them."""

from __future__ import annotations

import os

if os.environ.get("MOONBUS_RDMA_GUEST") != "1":
    collect_ignore_glob = ["test_*.py"]
