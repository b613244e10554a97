"""Chunked pipeline parallelism across prefill instances: the KV stream between stages.

Chunk i of a long prompt runs on stage i mod X (schemas.prefill.PipelineSpec). Each stage
computes its chunks layer by layer into one KvAssembly (common/engine/layerwise.py) and
streams every layer slice it computes to the other stages that need it (`PeerSink`), through
the point-to-point transports (common/transport): a one-sided write of the slice straight into
the peer's assembly, which that stage registered as a region when its task arrived
(`SliceReceiver`); the landed slice raises the assembly's watermark, so chunk i's layer l starts
as soon as chunk i-1's layer l is in place:

    stage 0   c0.L0 c0.L1 c0.L2 ...            c2.L0 c2.L1 ...
    stage 1         c1.L0 c1.L1 c1.L2 ...            c3.L0 ...
              (c1.L0 waits for c0.L0, c2.L0 for c1.L0, ...)

Slices of one layer may land out of token order from different peers; the watermark rises over
them once the slice before them is in place. A slice carries its checksum, verified on arrival.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

import torch
import xxhash

from common import kvfiles
from common.kv.slices import SliceGeometry, from_meta, meta
from common.transport import Channel, TransportError, Transports
from schemas.prefill import PipelineSpec
from schemas.transfer import RegionRef
from common.engine.layerwise import KvAssembly

log = logging.getLogger(__name__)


def region_of(request_id: str) -> str:
    """The region a stage registers for a pipelined request (every stage derives the same id)."""
    return "pl" + xxhash.xxh3_64_hexdigest(request_id.encode())


class SliceReceiver:
    """The pipeline listener of one prefill instance: peer stages write into per-request assemblies.

    Nothing from the network is trusted: a peer proves it holds the cluster secret first (the
    transport's handshake), a slice must land in the region of a pipelined task this instance
    holds (`expect`, from the task on the bus: its length comes from there, not from the sender),
    within its bounds, exactly where its layer and token range live, and with a good checksum.
    """

    WAIT_FOR_TASK_S = 5.0  # a peer stage may start streaming a moment before our task arrives

    def __init__(self, new_assembly: Callable[[int], KvAssembly], transports: Transports | None = None) -> None:
        self.new_assembly = new_assembly  # total tokens -> an empty assembly for this model
        self.transports = transports  # None: this instance does not listen (no pipelining)
        self.assemblies: dict[str, KvAssembly] = {}  # request_id -> its KV being assembled
        self.pending: dict[tuple[str, int], dict[int, int]] = {}  # (request_id, layer) -> start -> end, landed early
        self._lock = threading.Lock()
        if transports is not None:
            transports.region_grace_s = self.WAIT_FOR_TASK_S
            transports.handle("sync", lambda body, peer: b"")  # a sender's last call: did every slice land?

    def expect(self, request_id: str, total_tokens: int) -> None:
        """A pipelined task arrived: its assembly, registered for the other stages to write into."""
        kv = self.assembly(request_id, total_tokens)
        if self.transports is not None:
            self.transports.unregister(region_of(request_id))  # an earlier attempt's
            self.transports.register(region_of(request_id), memoryview(kvfiles.as_array(kv.kv)).cast("B"),
                                     lambda m, pieces, error: self.landed(request_id, m, pieces, error))

    def assembly(self, request_id: str, total_tokens: int) -> KvAssembly:
        with self._lock:
            if request_id not in self.assemblies:
                self.assemblies[request_id] = self.new_assembly(total_tokens)
            return self.assemblies[request_id]

    def drop(self, request_id: str) -> None:
        if self.transports is not None:
            self.transports.unregister(region_of(request_id))  # waits for writes in flight on it
        with self._lock:
            self.assemblies.pop(request_id, None)
            for key in [k for k in self.pending if k[0] == request_id]:
                del self.pending[key]

    def landed(self, request_id: str, m: dict, pieces: list[tuple[int, int]], error: str | None) -> None:
        """A peer's write into this request's assembly (a connection thread)."""
        kv = self.assemblies.get(request_id)
        if kv is None:
            return
        if error:  # corrupt or out of bounds: this stage cannot finish; fail fast rather than time out
            kv.fail(TransportError(f"a pipeline slice of request {request_id} failed: {error}"))
            return
        layer, start, n = from_meta(m)
        geometry = SliceGeometry(kv.kv.shape, kv.kv.element_size())
        geometry.check(layer, start, n)
        if [tuple(p) for p in pieces] != geometry.runs(layer, start, n) or start < kv.ready[layer]:
            raise ValueError(f"slice {m} is not where that slice lives, or overwrites tokens already in place")
        with self._lock:
            held = self.pending.setdefault((request_id, layer), {})
            held[start] = start + n
            # NOTE: the watermark rises only over slices that follow the one in place
            while kv.ready[layer] in held:
                kv.mark(layer, kv.ready[layer], held.pop(kv.ready[layer]))


class PeerSink:
    """A KvSink that writes each slice into the peer stages that still need it (on the streamer thread).

    A slice of chunk i is needed by every stage that computes a later chunk (its attention reads
    it) and by the last stage (it hands the whole KV to decode).
    """

    def __init__(self, request_id: str, total_tokens: int, spec: PipelineSpec, stage: int, transports: Transports,
                 timeout_s: float, shape: tuple[int, ...], itemsize: int = 4) -> None:
        self.request_id = request_id
        self.chunk_tokens = spec.chunk_tokens
        self.geometry = SliceGeometry(shape, itemsize)
        num_stages = len(spec.stages)
        self.peers: list[tuple[int, Channel, RegionRef]] = []  # (last chunk index the peer computes, channel, region)
        try:
            for peer, addr in enumerate(spec.addrs):
                if peer == stage:
                    continue
                last_chunk = max(i for i in range(num_chunks(total_tokens, spec.chunk_tokens)) if i % num_stages == peer)
                channel = transports.connect({"tcp": addr}, timeout_s)
                self.peers.append((last_chunk, channel, RegionRef(region_of(request_id), self.geometry.nbytes, {"tcp": addr})))
        except BaseException:
            self.close()
            raise

    def write_layer(self, layer: int, start: int, kv: torch.Tensor) -> None:
        pieces = self.geometry.pieces(layer, start, kv)
        chunk = start // self.chunk_tokens
        for last_chunk, channel, region in self.peers:
            if last_chunk > chunk:
                channel.write(region, pieces, meta(layer, start, kv.shape[2]))

    def finish(self) -> None:
        """Every slice is out: one call per peer confirms they landed (or raises why not)."""
        try:
            for _, channel, _ in self.peers:
                channel.call("sync")
        finally:
            self.close()

    def close(self) -> None:
        for _, channel, _ in self.peers:
            channel.close()
        self.peers = []


def num_chunks(num_tokens: int, chunk_tokens: int) -> int:
    return -(-num_tokens // chunk_tokens)


def my_chunks(num_tokens: int, chunk_tokens: int, stage: int, num_stages: int) -> list[tuple[int, int]]:
    """The [start, end) token ranges this stage computes: chunk i goes to stage i mod X."""
    bounds = [(a, min(a + chunk_tokens, num_tokens)) for a in range(0, num_tokens, chunk_tokens)]
    return [b for i, b in enumerate(bounds) if i % num_stages == stage]


def last_stage(num_tokens: int, chunk_tokens: int, num_stages: int) -> int:
    return PipelineSpec([""] * num_stages, [], chunk_tokens).last_stage(num_tokens)
