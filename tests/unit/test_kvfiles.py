"""Request KV files are named by owner, and each owner sweeps only what is its own."""

import os
import time

import torch

from common import kvfiles


def test_names_say_who_owns_a_file():
    out = kvfiles.outgoing_name("cmpl-1", 2)
    assert out == "out-cmpl-1-a2.kv"
    assert kvfiles.incoming_name(out, "decode-0") == "in-decode-0__cmpl-1-a2.kv"
    assert kvfiles.incoming_name(out, "") == "in-cmpl-1-a2.kv"  # not attributable: the messenger's stale sweep


def test_a_decode_instance_sweeps_its_own_old_files_only(tmp_path):
    kv = torch.zeros(2, 2, 1, 3, 4)
    handle = kvfiles.write(tmp_path, "n", kvfiles.outgoing_name("r1", 0), kv)
    mine_old = kvfiles.write_bytes(tmp_path, handle, (tmp_path / handle.name).read_bytes(), "n", "decode-0")
    second = kvfiles.write(tmp_path, "n", kvfiles.outgoing_name("r2", 0), kv)
    mine_held = kvfiles.write_bytes(tmp_path, second, (tmp_path / second.name).read_bytes(), "n", "decode-0")
    other = kvfiles.write_bytes(tmp_path, handle, (tmp_path / handle.name).read_bytes(), "n", "decode-1")
    old = time.time() - 100
    for h in (mine_old, mine_held, other):
        os.utime(tmp_path / h.name, (old, old))
    removed = kvfiles.sweep_incoming(tmp_path, "decode-0", older_than_s=30, keep={mine_held.name})
    assert removed == 1
    assert not (tmp_path / mine_old.name).exists()
    assert (tmp_path / mine_held.name).exists() and (tmp_path / other.name).exists()
    assert kvfiles.usage(tmp_path)[0] == 4  # the two out- files, the held one and the other instance's
    assert torch.equal(kvfiles.read(tmp_path, other, remove=True), kv)
