"""The machine's cores shared among the workers computing (common/cores.py), through one share file."""

import os
import subprocess
import sys
import time

import pytest
import torch

from common import cores
from common.cores import CoreShare


@pytest.fixture
def share_file(tmp_path):
    return tmp_path / "cores"


def test_alone_a_worker_takes_every_core_and_beside_a_busy_one_half(share_file):
    decode = CoreShare("decode", share_file, cores=4)
    prefill = CoreShare("prefill", share_file, cores=4)
    assert decode.claim() == 4  # prefill idle
    assert prefill.claim() == 2  # both busy now
    assert decode.claim() == 2
    prefill.release()
    assert decode.claim() == 4
    assert torch.get_num_threads() == 4  # set in the thread that computes
    decode.release()


def test_an_odd_core_goes_to_decode_first(share_file):
    prefill = CoreShare("prefill", share_file, cores=3)
    decode = CoreShare("decode", share_file, cores=3)
    prefill.claim()
    assert decode.claim() == 2  # the remainder: decode holds the batch's TBT
    assert prefill.share() == 1


def test_more_workers_than_cores_each_get_one(share_file):
    workers = [CoreShare("prefill", share_file, cores=2) for _ in range(3)]
    assert [w.claim() for w in workers][-1] == 1
    assert all(w.share() == 1 for w in workers)


def test_a_dead_or_stale_workers_slot_counts_for_nothing(share_file, monkeypatch):
    other = subprocess.run([sys.executable, "-c", f"""
from pathlib import Path
from common.cores import CoreShare
CoreShare("decode", Path({str(share_file)!r}), cores=2).claim()  # busy, then gone without a word
"""], cwd=os.getcwd(), check=True)
    assert other.returncode == 0
    mine = CoreShare("prefill", share_file, cores=2)
    assert mine.slot == 0  # the dead process's slot is reused
    assert mine.claim() == 2
    busy = CoreShare("decode", share_file, cores=2)
    busy.claim()
    assert mine.share() == 1
    assert mine.share(now=time.monotonic() + cores.STALE_S + 1) == 2  # busy too long without a word: a dead worker


def test_a_share_file_of_another_user_or_a_link_is_refused(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_bytes(b"")
    link = tmp_path / "cores"
    link.symlink_to(target)
    with pytest.raises(OSError):
        CoreShare("decode", link)
    assert cores.for_worker("decode", threads=2) is None  # a fixed number of threads: no share


def test_a_worker_computes_on_one_thread_and_every_other_thread_on_one_torch_thread():
    # run in a process of its own: the event loop's thread and torch's process-wide setting change
    code = """
import asyncio, threading, torch
from common.cores import ComputeThread

def threads():  # after a parallel operation, as a thread computes
    torch.ones(1 << 20).add_(1)
    return torch.get_num_threads()

async def main():
    compute = ComputeThread.start(3)
    on_compute = await compute.run(threads)
    on_helper = await asyncio.to_thread(threads)
    print(on_compute, on_helper, threads())
    compute.close()

torch.set_num_threads(4)
asyncio.run(main())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["3", "1", "1"]  # the compute thread's 3; the default executor's and the event loop's 1


def test_a_decode_instance_hears_the_most_urgent_request_in_each_prefill_queue_beside_it(share_file):
    decode = CoreShare("decode", share_file, cores=2)
    first, second = CoreShare("prefill", share_file, cores=2), CoreShare("prefill", share_file, cores=2)
    assert decode.prefill_urgent() == []
    first.waiting(100.0, 130.0)
    second.waiting(104.0, 134.0)
    first.claim()  # a claim and a release keep the waiting request: they write the busy time only
    first.release()
    assert sorted(decode.prefill_urgent()) == [(100.0, 130.0), (104.0, 134.0)]
    decode.waiting(1.0, 2.0)  # a decode instance's own slot is not a prefill queue
    assert first.prefill_urgent() == [(104.0, 134.0)]  # a prefill instance hears the others' queues, not its own
    second.waiting(0.0, 0.0)  # its queue emptied
    assert decode.prefill_urgent() == [(100.0, 130.0)]
    first.close()
    assert decode.prefill_urgent() == []


def test_a_dead_prefill_instances_queue_counts_for_nothing(share_file):
    subprocess.run([sys.executable, "-c", f"""
from pathlib import Path
from common.cores import CoreShare
CoreShare("prefill", Path({str(share_file)!r}), cores=2).waiting(100.0, 130.0)  # then gone without a word
"""], cwd=os.getcwd(), check=True)
    assert CoreShare("decode", share_file, cores=2).prefill_urgent() == []
