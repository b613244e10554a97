"""The streamed handoff's pieces: slice geometry, the decode node's reservations (land, verify once,
complete, refuse what is incomplete or corrupt, expire), and pipeline slices through the transport."""

from __future__ import annotations

import socket
import time

import pytest
import torch

from common import kvfiles
from common.kv.blocks import KvLayout
from common.kv.slices import Coverage, SliceGeometry, meta
from common.transport import TransportError, Transports, checksum
from common.transport import tcp
from schemas.transfer import AcceptKv, CompleteKv, CompleteKvReply, RegionRef, WriteFrame
from services.messenger.handoff import HandoffRefused, Reservations
from services.prefill.handoff import StreamSink
from common.engine.layerwise import KvAssembly
from services.prefill.pipeline import SliceReceiver, region_of

SECRET = b"k" * 32
LAYOUT = KvLayout(num_layers=3, num_kv_heads=2, head_dim=4, block_tokens=4)


def make_kv(tokens: int) -> torch.Tensor:
    return torch.arange(3 * 2 * 2 * tokens * 4, dtype=torch.float32).view(3, 2, 2, tokens, 4)


def test_a_slice_is_two_runs_per_kv_head_and_its_pieces_are_views_of_the_tensor():
    g = SliceGeometry((3, 2, 2, 10, 4))
    assert g.nbytes == 3 * 2 * 2 * 10 * 4 * 4
    row = 16  # head_dim * 4 bytes
    # run (kv, h) of layer 1 starts ((1 * 2 + kv) * 2 + h) * 10 tokens in: 40, 50, 60, 70
    assert g.runs(1, 3, 2) == [((40 + 3) * row, 32), ((50 + 3) * row, 32), ((60 + 3) * row, 32), ((70 + 3) * row, 32)]
    kv = make_kv(10)
    flat = bytearray(g.nbytes)
    for layer in range(3):
        for offset, view in g.pieces(layer, 2, kv[layer, :, :, 2:7]):
            flat[offset:offset + view.nbytes] = view
    landed = torch.frombuffer(flat, dtype=torch.float32).view(3, 2, 2, 10, 4)
    assert torch.equal(landed[:, :, :, 2:7], kv[:, :, :, 2:7])
    with pytest.raises(ValueError):
        g.check(3, 0, 1)
    with pytest.raises(ValueError):
        g.check(0, 8, 3)


def test_coverage_needs_every_token_of_every_layer_in_the_right_place():
    g = SliceGeometry((2, 2, 1, 8, 4))
    c = Coverage(g)
    c.add(meta(0, 4, 4), g.runs(0, 4, 4))
    c.add(meta(0, 0, 4), g.runs(0, 0, 4))
    assert c.missing() == "layer 1 has tokens [0, 0) of 8"
    c.add(meta(1, 0, 8), g.runs(1, 0, 8))
    assert c.missing() == ""
    with pytest.raises(ValueError, match="not where"):
        c.add(meta(1, 0, 8), g.runs(0, 0, 8))


class Node:
    """A decode node's messenger side: its transports and reservations."""

    def __init__(self, shm_dir, idle_s: float = 60.0) -> None:
        self.transports = Transports("tcp", SECRET)
        self.transports.listen("127.0.0.1")
        self.landed_bytes: list[int] = []
        self.reservations = Reservations("node-d0", shm_dir, LAYOUT, 64, self.transports, idle_s,
                                         lambda src, n: self.landed_bytes.append(n))

    def accept(self, rid: str = "r1", tokens: int = 6, holder: str = "prefill-0:abc"):
        return self.reservations.accept(AcceptKv(rid, 0, tokens, holder, "decode-0", "node-p0"), "node-p0")


@pytest.fixture
def node(tmp_path):
    n = Node(tmp_path)
    yield n
    n.transports.close()


@pytest.fixture
def prefill():
    t = Transports("tcp", SECRET)
    yield t
    t.close()


def stream(prefill: Transports, region, kv: torch.Tensor, split: int):
    """As a prefill does: layer slices in two token ranges, layers out of order (prefix, then computed)."""
    ch = prefill.connect(region.endpoints)
    sink = StreamSink(ch, region, SliceGeometry(tuple(kv.shape)))
    for layer in (2, 0, 1):
        sink.write_layer(layer, 0, kv[layer, :, :, :split])
    for layer in range(3):
        sink.write_layer(layer, split, kv[layer, :, :, split:])
    return ch, sink


def test_a_streamed_kv_lands_whole_and_is_handed_over_verified(node, prefill, tmp_path):
    region = node.accept()
    assert region.nbytes == 6 * LAYOUT.bytes_per_token
    [tmp] = tmp_path.glob(".in-decode-0__r1-a0.kv.tmp")  # the reservation, in the node's shared memory
    kv = make_kv(6)
    ch, sink = stream(prefill, region, kv, 4)
    reply = CompleteKvReply.from_bytes(ch.call("complete", CompleteKv(region.region).to_bytes()))
    ch.close()
    assert reply.ok and reply.dest.verified and reply.dest.name == "in-decode-0__r1-a0.kv"
    assert not tmp.exists() and node.reservations.held == {}
    assert torch.equal(kvfiles.read(tmp_path, reply.dest), kv)
    assert sink.nbytes == node.landed_bytes[0] == kv.numel() * 4
    with pytest.raises(TransportError):  # the region is gone: nothing can write into the file now
        with prefill.connect(region.endpoints) as again:
            again.write(region, [(0, b"x")])
            again.call("complete", CompleteKv(region.region).to_bytes())


def test_an_incomplete_kv_is_refused_and_its_reservation_freed(node, prefill, tmp_path):
    region = node.accept()
    kv = make_kv(6)
    with prefill.connect(region.endpoints) as ch:
        sink = StreamSink(ch, region, SliceGeometry(tuple(kv.shape)))
        for layer in (0, 1):
            sink.write_layer(layer, 0, kv[layer])
        with pytest.raises(TransportError, match="layer 2 has tokens"):
            ch.call("complete", CompleteKv(region.region).to_bytes())
    assert node.reservations.held == {} and list(tmp_path.iterdir()) == []


def test_a_corrupted_slice_fails_the_completion_with_a_clear_error(node, tmp_path):
    region = node.accept(tokens=4)
    g = SliceGeometry(LAYOUT.request_shape(4))
    runs = g.runs(0, 0, 4)
    payload = [bytes(range(n % 256)) * (n // 256 + 1) for _, n in runs]
    payload = [p[:n] for p, (_, n) in zip(payload, runs)]
    host, port = region.endpoints["tcp"].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        tcp.client_handshake(sock, SECRET)
        body = bytearray(b"".join(payload))
        good = checksum([bytes(body)])
        body[3] ^= 0xFF  # flipped in flight, after the sender hashed it
        header = WriteFrame(region.region, [list(r) for r in runs], meta(0, 0, 4)).to_bytes()
        sock.sendall(tcp.frame(tcp.OP_WRITE, header) + bytes(body) + tcp._SUM.pack(good))
        complete = CompleteKv(region.region).to_bytes()
        sock.sendall(tcp.frame(tcp.OP_CALL, b'{"op": "complete", "nbytes": %d}' % len(complete)) + complete)
        reply = tcp.read_header(sock)
    assert b"checksum" in reply and b'"ok":false' in reply
    node.reservations.drop(region.region, "the prefill aborts")  # as its abort does
    assert list(tmp_path.iterdir()) == []


def test_a_slice_written_where_another_lives_is_refused(node, prefill):
    region = node.accept(tokens=4)
    g = SliceGeometry(LAYOUT.request_shape(4))
    with prefill.connect(region.endpoints) as ch:
        kv = make_kv(4)
        pieces = g.pieces(1, 0, kv[1])
        ch.write(region, pieces, meta(0, 0, 4))  # layer 1's bytes, claimed as layer 0
        with pytest.raises(TransportError, match="not where"):
            ch.call("complete", CompleteKv(region.region).to_bytes())


def test_an_abort_frees_a_reservation_whose_reply_was_lost_and_refuses_a_late_accept(node, tmp_path):
    node.accept("r1")  # reserved; say its reply never reached the prefill
    assert node.reservations.abort("r1", 0, "decode-0")
    assert node.reservations.held == {} and list(tmp_path.iterdir()) == []
    assert not node.reservations.abort("r2", 0, "decode-0")  # overtakes its accept...
    with pytest.raises(HandoffRefused, match="aborted"):
        node.accept("r2")  # ...which is then refused
    assert list(tmp_path.iterdir()) == []


def test_reservations_expire_when_idle_or_when_their_prefill_or_decode_is_gone(tmp_path):
    node = Node(tmp_path)  # idle for far longer than the checks below take
    try:
        a = node.accept("r1", holder="prefill-0:aaa")
        b = node.accept("r2", holder="prefill-1:bbb")
        assert node.reservations.expired({"prefill-0:aaa", "prefill-1:bbb"}, {"decode-0"}) == []
        assert [r for r, _ in node.reservations.expired({"prefill-0:aaa"}, {"decode-0"})] == [b.region]
        assert {r for r, _ in node.reservations.expired(None, set())} == {a.region, b.region}
        node.reservations.idle_s = 0.05
        time.sleep(0.1)  # idle past idle_s now: the sleep outlasts it, and came after their last write
        expired = node.reservations.expired(None, None)
        assert {r for r, _ in expired} == {a.region, b.region} and "no write" in expired[0][1]
        for region, why in expired:
            node.reservations.drop(region, why)
        assert list(tmp_path.iterdir()) == [] and node.reservations.held == {}
        with pytest.raises(HandoffRefused):
            node.accept("r3", tokens=65)  # beyond the model's context
    finally:
        node.transports.close()


def test_pipeline_slices_land_in_the_peer_assembly_and_raise_its_watermark_in_order(prefill):
    stage = Transports("tcp", SECRET)
    stage.listen("127.0.0.1")
    receiver = SliceReceiver(lambda n: KvAssembly(3, 2, n, 4), stage)
    try:
        receiver.expect("req-1", 8)
        kv = make_kv(8)
        g = SliceGeometry((3, 2, 2, 8, 4))
        ref = RegionRef(region_of("req-1"), g.nbytes, stage.endpoints)
        with prefill.connect(stage.endpoints) as ch:
            ch.write(ref, g.pieces(0, 4, kv[0, :, :, 4:]), meta(0, 4, 4))  # early: held above the watermark
            ch.call("sync")
            assembly = receiver.assemblies["req-1"]
            assert assembly.ready[0] == 0
            ch.write(ref, g.pieces(0, 0, kv[0, :, :, :4]), meta(0, 0, 4))
            ch.call("sync")
            assert assembly.ready[0] == 8
            assert torch.equal(assembly.kv[0], kv[0])
            ch.write(ref, g.pieces(1, 0, kv[1, :, :, :4]), meta(1, 0, 2))  # claims the wrong length
            with pytest.raises(TransportError, match="not where"):
                ch.call("sync")
        receiver.drop("req-1")
        assert region_of("req-1") not in stage.regions
    finally:
        stage.close()
