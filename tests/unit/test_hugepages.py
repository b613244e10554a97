"""The decode engine's KV pool on huge pages (common/engine/hugepages.py, common/engine/paged.py)."""

import torch

from common.engine import hugepages
from common.engine.paged import KvPool


def advised_huge(t: torch.Tensor) -> bool:
    """Whether the mapping that holds t's first byte was advised MADV_HUGEPAGE (VmFlags "hg")."""
    address, inside = t.data_ptr(), False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and ":" not in head:  # a mapping's first line: "start-end perms ..."
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return "hg" in line.split()[1:]
    raise AssertionError("t's memory is in no mapping of this process")


def test_a_large_tensor_starts_on_a_huge_page_and_its_mapping_asks_for_huge_pages():
    t = hugepages.empty((3, 1 << 20), torch.bfloat16)
    assert t.shape == (3, 1 << 20) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % hugepages.HUGE_PAGE == 0
    assert advised_huge(t)
    t.fill_(2.5)  # writable, whole
    assert float(t.float().sum()) == 2.5 * t.numel()


def test_a_small_tensor_is_an_ordinary_one():
    t = hugepages.empty((4, 16), torch.float32)
    assert t.shape == (4, 16) and not advised_huge(t)


def test_the_pool_of_a_real_size_holds_its_kv_on_huge_pages_and_gives_back_what_was_written():
    # SmolLM2's shapes (30 layers, 3 kv heads, 64 dims), 256 blocks: 23.6 MB of K and as much of V
    pool = KvPool(30, 3, 64, 256, torch.bfloat16)
    assert advised_huge(pool.k) and advised_huge(pool.v)
    blocks = pool.allocate(5)
    kv = torch.randn(30, 2, 3, 70, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    pool.write(blocks, kv)
    assert torch.equal(pool.read(blocks, 0, 70), kv)
    assert torch.equal(pool.read(blocks, 16, 53), kv[:, :, :, 16:53])
