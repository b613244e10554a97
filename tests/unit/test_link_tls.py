"""TLS on the KV links (`--link-cert`, `--link-ca`): members' bytes travel encrypted and
authenticated, a peer without a certificate of the cluster's link CA is refused, and a relay on
the path can neither read the KV nor rewrite it."""

from __future__ import annotations

import os
import socket
import threading

import pytest

from common import config
from common.security import SecretError, link_tls
from common.transport import TransportError, Transports
from tests.relay import pump
from tools.moonbus.cluster import certs

SECRET = b"s" * 32
MiB = 1 << 20


@pytest.fixture(scope="module")
def cluster_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("link-ca")


def tls_of(directory, name):
    return link_tls(certs.ensure_cert(directory, name), certs.ca_file(directory))


@pytest.fixture
def owner(cluster_dir):
    transports = Transports("tcp", SECRET, 10.0, tls=tls_of(cluster_dir, "owner"))
    transports.listen("127.0.0.1")
    memory = bytearray(4 * MiB)
    landed = []
    ref = transports.register("r1", memory, lambda meta, spans, error: landed.append(error))
    transports.handle("echo", lambda body, peer: body[::-1])
    yield transports, ref, memory, landed
    transports.close()


def test_members_write_read_and_call_through_tls(owner, cluster_dir):
    transports, ref, memory, landed = owner
    peer = Transports("tcp", SECRET, 10.0, tls=tls_of(cluster_dir, "peer"))
    big = os.urandom(3 * MiB + 5)
    with peer.connect(ref.endpoints) as ch:
        ch.write(ref, [(0, big)], {"layer": 0})
        assert ch.call("echo", b"abc") == b"cba"
        back = bytearray(len(big))
        ch.read(ref, [(0, back)])
    assert bytes(memory[:len(big)]) == big and back == big and landed == [None]


def test_the_issued_files_are_their_owners_alone(cluster_dir):
    certs.ensure_cert(cluster_dir, "someone")
    for path in cluster_dir.iterdir():
        assert path.stat().st_mode & 0o077 == 0, path


@pytest.mark.parametrize("who", ["plain", "other-ca"])
def test_a_peer_without_the_clusters_certificate_is_refused(owner, who, tmp_path):
    transports, ref, _, landed = owner
    refused = []
    transports.on_refused = lambda peer, why: refused.append(why)
    # it holds the cluster secret: TLS alone keeps it out
    stranger = Transports("tcp", SECRET, 5.0, tls=None if who == "plain" else tls_of(tmp_path, "stranger"))
    with pytest.raises(TransportError):
        with stranger.connect(ref.endpoints) as ch:
            ch.write(ref, [(0, b"x" * 100)])
            ch.call("echo", b"x")
    assert landed == []
    assert _eventually(lambda: refused), "the owner did not report the refusal"


def _eventually(check, timeout_s: float = 10.0) -> bool:
    done = threading.Event()
    for _ in range(int(timeout_s / 0.05)):
        if check():
            return True
        done.wait(0.05)
    return bool(check())


class Relay:
    """A man in the middle: forwards both ways, keeps what it saw, and may flip one byte on the
    way to the owner."""

    def __init__(self, target: str, flip_at: int | None = None) -> None:
        self.target = target.rsplit(":", 1)
        self.flip_at = flip_at
        self.seen = bytearray()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.locator = f"127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self.run, daemon=True).start()

    def run(self) -> None:
        client, _ = self.listener.accept()
        server = socket.create_connection((self.target[0], int(self.target[1])))
        threading.Thread(target=self.pipe, args=(server, client, False), daemon=True).start()
        self.pipe(client, server, True)

    def pipe(self, src: socket.socket, dst: socket.socket, to_owner: bool) -> None:
        pump(src, dst, self.towards_owner if to_owner else None)

    def towards_owner(self, data: bytes) -> bytes:
        start = len(self.seen)
        self.seen += data
        if self.flip_at is not None and start <= self.flip_at < len(self.seen):
            data = bytearray(data)
            data[self.flip_at - start] ^= 0x01
        return data


def test_a_relay_on_the_path_sees_no_kv_and_cannot_rewrite_it(owner, cluster_dir):
    transports, ref, memory, landed = owner
    peer = Transports("tcp", SECRET, 10.0, tls=tls_of(cluster_dir, "peer"))
    secret_kv = b"tenant prompt KV " * 4096
    relay = Relay(ref.endpoints["tcp"])
    with peer.connect({"tcp": relay.locator}) as ch:
        ch.write(ref, [(0, secret_kv)])
        ch.call("echo", b"")
    assert bytes(memory[:len(secret_kv)]) == secret_kv
    assert b"tenant prompt KV" not in relay.seen  # encrypted on the wire

    tamper = Relay(ref.endpoints["tcp"], flip_at=len(relay.seen) // 2)  # a byte inside the KV's records
    with pytest.raises(TransportError):
        with peer.connect({"tcp": tamper.locator}) as ch:
            ch.write(ref, [(0, secret_kv)])
            ch.call("echo", b"")
    assert landed.count(None) == 1  # the tampered write never landed as a good one


def test_tls_needs_both_files_and_no_rdma(cluster_dir):
    with pytest.raises(SecretError):
        link_tls(certs.cert_file(cluster_dir, "owner"), "")
    with pytest.raises(ValueError, match="both"):
        config.check_transport("tcp", 1, 2, link_cert="x")
    with pytest.raises(ValueError, match="rdma"):
        config.check_transport("rdma", 1, 2, link_cert="x", link_ca="y")


def test_a_listener_given_the_clusters_addresses_closes_any_other_at_once():
    """--link-peers: a connection from outside the listed networks is closed before it reads a
    byte or takes a handshake's place; a member's (the listed address) is served."""
    owner = Transports("tcp", SECRET, 10.0, allow="127.0.0.1/32")
    owner.listen("127.0.0.1")
    owner.register("r1", bytearray(64))
    owner.handle("echo", lambda body, peer: body[::-1])
    refused = []
    owner.on_refused = lambda peer, why: refused.append((peer, why))
    host, port = owner.endpoints["tcp"].rsplit(":", 1)
    try:
        strangers = []
        for _ in range(100):  # more than every handshake place: none is taken
            s = socket.socket()
            s.bind(("127.0.0.2", 0))  # another address of this host, not the cluster's
            s.connect((host, int(port)))
            strangers.append(s)
        for s in strangers:
            s.settimeout(10)
            assert s.recv(1) == b""  # closed on it, nothing sent
            s.close()
        assert _eventually(lambda: len(refused) == 100)
        assert all(peer.startswith("127.0.0.2:") and "--link-peers" in why for peer, why in refused)
        assert owner.backends["tcp"].refused == {"stranger": 100}
        member = Transports("tcp", SECRET, 10.0)
        with member.connect(owner.endpoints) as ch:
            assert ch.call("echo", b"ab") == b"ba"
    finally:
        owner.close()


def test_link_peers_must_be_addresses_or_networks():
    with pytest.raises(ValueError, match="CIDR"):
        config.check_transport("tcp", 1, 2, link_peers="10.0.0.0/8,node-a")
    config.check_transport("tcp", 1, 2, link_peers="10.0.0.0/8, 127.0.0.1, ::1")


def test_auto_link_peers_are_the_networks_this_host_is_on(tmp_path):
    """moonbus up and compose give the KV links `--link-peers auto`: this host's own networks
    (loopback, a compose network, the LAN segment), so no one beyond a router takes a handshake's
    place, and every local cluster's processes still reach each other."""
    from common.transport import admitted, networks
    from tools.moonbus.cluster.processes import Cluster, ClusterSpec

    auto = networks("auto")
    assert admitted("127.0.0.1", auto) and admitted("::1", auto) and admitted("::ffff:127.0.0.1", auto)
    assert not admitted("203.0.113.9", auto)  # TEST-NET-3: no host's own network
    assert networks("auto, 203.0.113.0/24")[-1].compressed == "203.0.113.0/24"
    args = Cluster(ClusterSpec(home=tmp_path, auth=False)).transport_args()
    assert args[args.index("--link-peers") + 1] == "auto"
