"""A landed KV file is checked again as the decode reads it: the messenger lands the KV streamed by a
prefill over the transport (services/messenger/handoff.py), and the decode engine loads it into a
request's blocks (common/engine/batch.py load_file, as services/decode/join.py does). A file that
changed after it landed, or a link put in its place, is refused, never decoded."""

from __future__ import annotations

import os

import pytest
import torch

from common import kvfiles, models
from common.engine.batch import BatchEngine
from common.engine.llama import Llama
from common.kv.blocks import KvLayout
from common.kv.slices import SliceGeometry
from common.security import UnsafeFile
from common.transport import Transports
from schemas.route import SamplingParams
from schemas.transfer import AcceptKv, CompleteKv, CompleteKvReply, KvHandle
from services.messenger.handoff import Reservations
from services.prefill.handoff import StreamSink

SECRET = b"k" * 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
TOKENS = 20


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model = models.load_model(models.prepare(models.TINY_RANDOM, tmp_path_factory.mktemp("home")), "float32")
    return BatchEngine(Llama.from_hf(model), max_batch=4, kv_budget_tokens=1_000)


@pytest.fixture
def land(engine, tmp_path):
    """Streams a KV to the decode node as a prefill does, and returns the handle its messenger answers."""
    layout = KvLayout(engine.num_layers, engine.num_kv_heads, engine.head_dim, 16)
    decode_node, prefill = Transports("tcp", SECRET), Transports("tcp", SECRET)
    decode_node.listen("127.0.0.1")
    reservations = Reservations("node-d0", tmp_path, layout, 64, decode_node, 60.0)

    def landed(rid: str, kv: torch.Tensor) -> KvHandle:
        region = reservations.accept(AcceptKv(rid, 0, kv.shape[3], "prefill-0:abc", "decode-0", "node-p0"), "node-p0")
        with prefill.connect(region.endpoints) as ch:
            sink = StreamSink(ch, region, SliceGeometry(tuple(kv.shape)))
            for layer in reversed(range(kv.shape[0])):  # out of order, in two token ranges, as a prefill may
                sink.write_layer(layer, 0, kv[layer, :, :, :8])
            for layer in range(kv.shape[0]):
                sink.write_layer(layer, 8, kv[layer, :, :, 8:])
            reply = CompleteKvReply.from_bytes(ch.call("complete", CompleteKv(region.region).to_bytes()))
        assert reply.ok, reply.error
        return reply.dest

    yield landed
    prefill.close()
    decode_node.close()


def load(engine: BatchEngine, shm_dir, handle: KvHandle, rid: str):
    """As the decode's way in does: room reserved, then the landed file read into it (and removed)."""
    engine.reserve(rid, engine.tokens_needed(TOKENS, GREEDY, 1), TOKENS)
    try:
        return engine.load_file(rid, shm_dir, handle, GREEDY, 1, remove=True)
    finally:
        engine.remove(rid)


def make_kv(engine: BatchEngine) -> torch.Tensor:
    return torch.randn(engine.num_layers, 2, engine.num_kv_heads, TOKENS, engine.head_dim)


def test_a_landed_file_is_loaded_by_the_decode_with_the_checksum_its_messenger_took(engine, land, tmp_path):
    kv = make_kv(engine)
    handle = land("r1", kv)
    assert handle.checksum == kvfiles.checksum(kvfiles.as_array(kv))  # the whole file's, taken as its layers landed
    assert load(engine, tmp_path, handle, "r1").kv_len == TOKENS
    assert not (tmp_path / handle.name).exists()


def test_a_landed_file_changed_after_it_landed_is_refused_by_the_decode(engine, land, tmp_path):
    handle = land("r2", make_kv(engine))
    assert handle.verified  # its slices were checked on arrival: the decode checks the file anyway
    path = tmp_path / handle.name
    with open(path, "r+b") as f:  # one value of the last layer, after the messenger's check
        f.seek(path.stat().st_size - 4)
        f.write(b"\x00\x00\x80\x7f")
    with pytest.raises(kvfiles.KvChecksumError, match="checksum mismatch: the file is not what was written or landed"):
        load(engine, tmp_path, handle, "r2")
    assert not path.exists()  # read and removed, as the decode does with a file it is done with


def test_a_link_put_in_place_of_a_landed_file_is_refused_by_the_decode(engine, land, tmp_path):
    handle = land("r3", make_kv(engine))
    path = tmp_path / handle.name
    os.rename(path, tmp_path / "kept-elsewhere")
    path.symlink_to(tmp_path / "kept-elsewhere")  # the same bytes, but not the file that landed
    with pytest.raises(UnsafeFile, match=f"{handle.name} is a link"):
        load(engine, tmp_path, handle, "r3")
    assert (tmp_path / "kept-elsewhere").exists()  # only the link was removed
