"""Request KV files are named by owner, and each owner sweeps only what is its own."""

import os
import time

import pytest
import torch

from common import kvfiles
from schemas.transfer import KvHandle


def test_names_say_who_owns_a_file():
    out = kvfiles.outgoing_name("cmpl-1", 2)
    assert out == "out-cmpl-1-a2.kv"
    assert kvfiles.incoming_name(out, "decode-0") == "in-decode-0__cmpl-1-a2.kv"
    assert kvfiles.incoming_name(out, "") == "in-cmpl-1-a2.kv"  # not attributable: the messenger's stale sweep


def test_a_decode_instance_sweeps_its_own_old_files_only(tmp_path):
    kv = torch.zeros(2, 2, 1, 3, 4)
    handle = kvfiles.write(tmp_path, "n", kvfiles.outgoing_name("r1", 0), kv)
    second = kvfiles.write(tmp_path, "n", kvfiles.outgoing_name("r2", 0), kv)

    def landed(h, decode):
        return kvfiles.write(tmp_path, "n", kvfiles.incoming_name(h.name, decode), kv)

    mine_old, mine_held, other = landed(handle, "decode-0"), landed(second, "decode-0"), landed(handle, "decode-1")
    landing = tmp_path / f".{kvfiles.incoming_name(kvfiles.outgoing_name('r3', 0), 'decode-0')}.tmp"
    landing.write_bytes(b"x")  # a handoff reservation: its messenger's until it completes
    old = time.time() - 100
    for path in [tmp_path / h.name for h in (mine_old, mine_held, other)] + [landing]:
        os.utime(path, (old, old))
    removed = kvfiles.sweep_incoming(tmp_path, "decode-0", older_than_s=30, keep={mine_held.name})
    assert removed == 1
    assert not (tmp_path / mine_old.name).exists()
    assert (tmp_path / mine_held.name).exists() and (tmp_path / other.name).exists() and landing.exists()
    assert kvfiles.usage(tmp_path)[0] == 5  # the two out- files, the held one, the other instance's, the landing one
    assert torch.equal(kvfiles.read(tmp_path, other, remove=True), kv)
    assert kvfiles.sweep_incoming(tmp_path, "decode-0") == 2  # a restarted decode: the held one and the landing one


def test_a_landed_file_is_checked_as_it_is_read_even_when_its_handle_says_verified(tmp_path):
    kv = torch.ones(2, 2, 1, 3, 4)
    handle = kvfiles.write(tmp_path, "n", "in-d__r1-a0.kv", kv)
    verified = KvHandle(handle.node, handle.name, handle.shape, "float32", handle.checksum, verified=True)
    assert torch.equal(kvfiles.read(tmp_path, verified), kv)
    with pytest.raises(kvfiles.KvChecksumError, match="checksum mismatch"):  # the file may have changed since it landed
        kvfiles.read(tmp_path, KvHandle(handle.node, handle.name, handle.shape, "float32", 0, verified=True))
    with pytest.raises(kvfiles.KvChecksumError):
        kvfiles.read(tmp_path, KvHandle(handle.node, handle.name, handle.shape, "float32", handle.checksum + 1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_kv_keeps_its_dtype_through_a_file(tmp_path, dtype):
    kv = torch.randn(3, 2, 2, 5, 4).to(dtype)
    handle = kvfiles.write(tmp_path, "node-a", "out-r-a0.kv", kv)
    assert handle.dtype == str(dtype).removeprefix("torch.")
    assert (tmp_path / "out-r-a0.kv").stat().st_size == kv.numel() * kv.element_size()  # bf16: half the bytes
    back = kvfiles.read(tmp_path, handle)
    assert back.dtype == dtype and torch.equal(back, kv)


def test_a_bfloat16_slice_goes_out_as_its_own_bytes():
    from common.kv.slices import SliceGeometry

    kv = torch.randn(2, 2, 3, 4, 8).to(torch.bfloat16)  # [L, 2, H, S, D]
    geometry = SliceGeometry(kv.shape, 2)
    buf = bytearray(geometry.nbytes)
    for layer in range(2):
        for offset, view in geometry.pieces(layer, 0, kv[layer]):
            buf[offset:offset + len(view)] = view
    assert torch.equal(torch.frombuffer(buf, dtype=torch.bfloat16).view(kv.shape), kv)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_file_is_read_straight_into_the_front_of_a_larger_buffer_and_checked(tmp_path, dtype):
    """As the decode service loads a joining request: into tokens [0, S) of its row's buffer."""
    kv = torch.randn(3, 2, 2, 5, 4).to(dtype)
    handle = kvfiles.write(tmp_path, "node-a", "out-r-a0.kv", kv)
    buffer = torch.full((3, 2, 2, 9, 4), 7.0, dtype=dtype)
    kvfiles.read_into(tmp_path, handle, buffer[:, :, :, :5])
    assert torch.equal(buffer[:, :, :, :5], kv) and bool((buffer[:, :, :, 5:] == 7).all())  # the rest untouched
    with pytest.raises(kvfiles.KvChecksumError):
        kvfiles.read_into(tmp_path, KvHandle(handle.node, handle.name, handle.shape, handle.dtype, handle.checksum ^ 1),
                          buffer[:, :, :, :5])
    with pytest.raises(ValueError, match="cannot be read into"):
        kvfiles.read_into(tmp_path, handle, buffer[:, :, :, :4])
    short = KvHandle(handle.node, handle.name, [3, 2, 2, 6, 4], handle.dtype, handle.checksum)
    with pytest.raises(kvfiles.KvChecksumError, match="does not hold"):
        kvfiles.read_into(tmp_path, short, buffer[:, :, :, :6])
    whole = torch.empty_like(kv)
    kvfiles.read_into(tmp_path, handle, whole, remove=True)
    assert torch.equal(whole, kv) and not (tmp_path / handle.name).exists()
