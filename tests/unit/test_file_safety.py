"""The cluster's files are opened where they are, never through a link planted in their place, and
its state directories (its home, its secrets, the SSD tier) are refused where they are a link or
others could write them: whatever was planted is refused by name, and a link's target is untouched."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from common import kvfiles, security
from common.engine.layerwise import FileSink
from common.kv.blocks import KvLayout
from common.kv.slab import DramSlab, SlabError
from common.security import UnsafeDirectory, UnsafeFile
from common.transport import Transports
from schemas.transfer import AcceptKv, KvHandle
from services.messenger.handoff import Reservations
from services.messenger.ssd import SsdStore
from tools.moonbus.cluster import keys as keys_tool
from tools.moonbus.cluster.security import ClusterSecrets

TARGET = b"another file of this user's, which a planted link points at\n"


@pytest.fixture
def target(tmp_path):
    """What a link planted in the cluster's way points at: it must come out as it went in."""
    path = tmp_path / "victim"
    path.write_bytes(TARGET)
    yield path
    assert path.read_bytes() == TARGET


def plant(link, target):
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)
    return link


def test_a_link_in_place_of_a_secret_is_refused_not_written_through_or_trusted(tmp_path, target):
    secrets_dir = tmp_path / "home" / "secrets"
    plant(secrets_dir / "cluster.key", target)  # it would be read as the cluster's secret
    with pytest.raises(UnsafeFile, match="cluster.key is not a plain file"):
        ClusterSecrets.create(secrets_dir)
    os.unlink(secrets_dir / "cluster.key")
    dangling = plant(secrets_dir / "nats-admin.pw", tmp_path / "made-elsewhere")  # would create its target
    with pytest.raises(UnsafeFile, match="nats-admin.pw is not a plain file"):
        ClusterSecrets.create(secrets_dir)
    with pytest.raises(UnsafeFile, match="nats-admin.pw is a link"):
        security.new_secret_file(dangling)
    assert not (tmp_path / "made-elsewhere").exists()
    os.unlink(dangling)
    made = ClusterSecrets.create(secrets_dir)  # once the links are gone
    assert stat.S_IMODE(os.stat(made.cluster_key).st_mode) == 0o600
    with pytest.raises(UnsafeFile, match="is a link"):
        security.write_private(plant(secrets_dir / "link.pem", target), b"a certificate")


def test_a_link_at_a_kv_files_temporary_name_is_refused_and_its_target_untouched(tmp_path, target):
    shm = tmp_path / "shm"
    name = kvfiles.outgoing_name("r1", 0)
    plant(shm / f".{name}.tmp", target)
    with pytest.raises(UnsafeFile, match=rf"\.{name}\.tmp is already there"):
        kvfiles.write(shm, "n", name, torch.ones(2, 2, 1, 3, 4))
    assert not (shm / name).exists()


def test_a_link_at_a_streamed_kv_files_temporary_name_is_refused_and_its_target_untouched(tmp_path, target):
    """A coupled instance's prefill streams its KV into a node-local file (FileSink) layer by layer."""
    shm = tmp_path / "shm"
    name = kvfiles.outgoing_name("r2", 0)
    plant(shm / f".{name}.tmp", target)
    with pytest.raises(UnsafeFile, match=rf"\.{name}\.tmp is already there"):
        FileSink(shm / name, (2, 2, 1, 3, 4), "float32")
    assert not (shm / name).exists()


def test_a_link_in_place_of_a_landed_kv_file_is_not_read(tmp_path):
    kv = torch.ones(2, 2, 1, 3, 4)
    handle = kvfiles.write(tmp_path, "n", "in-d__r1-a0.kv", kv)
    os.rename(tmp_path / handle.name, tmp_path / "elsewhere.kv")
    plant(tmp_path / handle.name, tmp_path / "elsewhere.kv")  # the same bytes, checksum and all
    with pytest.raises(UnsafeFile, match="in-d__r1-a0.kv is a link"):
        kvfiles.read(tmp_path, handle)


def test_a_link_at_the_slabs_path_is_refused_when_it_is_made_and_when_it_is_mapped(tmp_path, target):
    link = plant(tmp_path / "slab-1", target)
    with pytest.raises(UnsafeFile, match="slab-1 is already there"):
        DramSlab.create(str(link), num_slots=2, slot_nbytes=64)
    with pytest.raises(UnsafeFile, match="slab-1 is a link"):
        DramSlab.attach(str(link))
    real = DramSlab.create(str(tmp_path / "slab-2"), num_slots=2, slot_nbytes=64)
    try:
        os.unlink(link)
        link.symlink_to(tmp_path / "slab-2")
        with pytest.raises(UnsafeFile, match="slab-1 is a link"):  # even to a real slab
            DramSlab.attach(str(link))
        with pytest.raises(SlabError, match="no slab"):
            DramSlab.attach(str(tmp_path / "slab-3"))
    finally:
        real.close()


def test_a_link_at_a_handoff_reservation_is_refused_and_its_target_untouched(tmp_path, target):
    transports = Transports("tcp", b"k" * 32)
    try:
        reservations = Reservations("node-d0", tmp_path, KvLayout(3, 2, 4, 4), 64, transports, 60.0)
        plant(tmp_path / ".in-decode-0__r1-a0.kv.tmp", target)
        with pytest.raises(UnsafeFile, match=r"\.in-decode-0__r1-a0\.kv\.tmp is already there"):
            reservations.accept(AcceptKv("r1", 0, 6, "prefill-0:abc", "decode-0", "node-p0"), "node-p0")
        assert reservations.held == {}
    finally:
        transports.close()


def test_a_link_at_the_api_key_files_temporary_name_is_refused(tmp_path, target):
    path = tmp_path / "keys" / "api-keys.json"
    plant(path.with_name(".api-keys.json.tmp"), target)
    with pytest.raises(UnsafeFile, match="is a link"):
        keys_tool.save(path, [{"hash": "ab", "tenant": "t"}])
    assert not path.exists()


def test_a_home_that_is_a_link_or_that_others_may_write_is_refused(tmp_path):
    real = tmp_path / "real-home"
    real.mkdir(mode=0o700)
    linked = tmp_path / "linked-home"
    linked.symlink_to(real)
    with pytest.raises(UnsafeDirectory, match="linked-home is not a directory"):
        ClusterSecrets.create(linked / "secrets")
    assert not (real / "secrets").exists()
    open_home = tmp_path / "open-home"
    open_home.mkdir()
    os.chmod(open_home, 0o777)  # anyone could have left a secrets directory, or a cluster.key, there
    with pytest.raises(UnsafeDirectory, match="may be written by other users"):
        ClusterSecrets.create(open_home / "secrets")
    os.chmod(open_home, 0o1777)  # sticky: others may still add names
    with pytest.raises(UnsafeDirectory, match="may be written by other users"):
        ClusterSecrets.create(open_home / "secrets")
    open_parent = tmp_path / "open"
    open_parent.mkdir()
    os.chmod(open_parent, 0o777)
    with pytest.raises(UnsafeDirectory, match="without the sticky bit"):
        ClusterSecrets.create(open_parent / "home" / "secrets")
    made = ClusterSecrets.create(tmp_path / "home" / "secrets")
    assert stat.S_IMODE(os.stat(made.directory).st_mode) == stat.S_IMODE(os.stat(made.directory.parent).st_mode) == 0o700


def test_the_ssd_tier_refuses_a_directory_that_is_a_link_or_that_others_may_write(tmp_path):
    real = tmp_path / "ssd-real"
    real.mkdir(mode=0o700)
    (tmp_path / "ssd-link").symlink_to(real)
    with pytest.raises(UnsafeDirectory, match="ssd-link is not a directory"):
        SsdStore(str(tmp_path / "ssd-link"), 1 << 20)
    assert list(real.iterdir()) == []
    open_dir = tmp_path / "ssd-open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    with pytest.raises(UnsafeDirectory, match="may be written by other users"):
        SsdStore(str(open_dir), 1 << 20)
    with SsdStore(str(tmp_path / "ssd" / "node-a"), 1 << 20) as store:
        assert stat.S_IMODE(os.stat(store.path).st_mode) == 0o700


def test_a_file_of_this_users_own_is_opened_as_before(tmp_path):
    kv = torch.randn(2, 2, 1, 3, 4)
    handle = kvfiles.write(tmp_path, "n", "out-r1-a0.kv", kv)
    assert torch.equal(kvfiles.read(tmp_path, handle), kv)
    fd = security.open_own(tmp_path / "out-r1-a0.kv", os.O_WRONLY | os.O_TRUNC)
    os.close(fd)
    assert os.path.getsize(tmp_path / "out-r1-a0.kv") == 0  # truncated once known to be ours
    kept = KvHandle("n", "out-r1-a0.kv", handle.shape, handle.dtype, handle.checksum)
    with pytest.raises(kvfiles.KvChecksumError, match="does not hold"):
        kvfiles.read(tmp_path, kept)
