"""Chunked pipeline parallelism across prefill instances: the KV stream between stages.

Chunk i of a long prompt runs on stage i mod X (schemas.prefill.PipelineSpec). Each stage
computes its chunks layer by layer into one KvAssembly (services/prefill/layerwise.py) and
streams every layer slice it computes to every other stage over TCP (`PeerSink`); a stage's
`SliceReceiver` lands the slices it gets into that request's assembly, so chunk i's layer l
starts as soon as chunk i-1's layer l is in place:

    stage 0   c0.L0 c0.L1 c0.L2 ...            c2.L0 c2.L1 ...
    stage 1         c1.L0 c1.L1 c1.L2 ...            c3.L0 ...
              (c1.L0 waits for c0.L0, c2.L0 for c1.L0, ...)

Frame: [4-byte length][KvSlice JSON][float32 payload]. Slices of one layer may arrive out of
token order from different peers; they are held until the slice before them is in place.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from typing import Callable

import torch

from schemas.prefill import PipelineSpec
from schemas.transfer import KvSlice
from services.messenger import link
from services.prefill.layerwise import KvAssembly

log = logging.getLogger(__name__)
_LEN = struct.Struct(">I")


class SliceReceiver:
    """The TCP listener of one prefill instance: peer stages' slices -> per-request assemblies.

    Nothing from the network is trusted: a peer proves it holds the cluster secret first
    (services/messenger/link.py), a slice must belong to a pipelined task this instance holds
    (`expect`, from the task on the bus: its length comes from there, not from the sender), and its
    layer and token range must fit that request's KV.
    """

    WAIT_FOR_TASK_S = 5.0  # a peer stage may start streaming a moment before our task arrives

    def __init__(self, new_assembly: Callable[[int], KvAssembly], secret: bytes | None = None) -> None:
        self.new_assembly = new_assembly  # total tokens -> an empty assembly for this model
        self.secret = secret
        self.expected: dict[str, int] = {}  # request_id -> prompt tokens, for pipelined tasks held here
        self.assemblies: dict[str, KvAssembly] = {}  # request_id -> its KV being assembled
        self.held: dict[tuple[str, int], dict[int, torch.Tensor]] = {}  # (request_id, layer) -> start -> slice

    def expect(self, request_id: str, total_tokens: int) -> None:
        self.expected[request_id] = total_tokens

    def assembly(self, request_id: str, total_tokens: int) -> KvAssembly:
        if request_id not in self.assemblies:
            self.assemblies[request_id] = self.new_assembly(total_tokens)
        return self.assemblies[request_id]

    def drop(self, request_id: str) -> None:
        self.expected.pop(request_id, None)
        self.assemblies.pop(request_id, None)
        for key in [k for k in self.held if k[0] == request_id]:
            del self.held[key]

    async def on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        try:
            await link.server_handshake(reader, writer, self.secret)
            while True:
                try:
                    header = await link.read_header(reader, KvSlice)
                except link.LinkError:
                    return  # the peer finished its stream
                kv = await self.checked_assembly(header)
                shape = (2, kv.kv.shape[2], header.num_tokens, kv.kv.shape[4])
                payload = await link.read_payload(reader, 4 * shape[0] * shape[1] * shape[2] * shape[3])
                self.deliver(header, torch.frombuffer(bytearray(payload), dtype=torch.float32).view(shape))
        except (link.LinkError, ValueError) as exc:  # refused, broken, or a slice that does not fit
            log.warning("pipeline stream from %s refused or broke: %s", peer, exc)
        finally:
            writer.close()

    async def checked_assembly(self, header: KvSlice) -> KvAssembly:
        waited = 0.0
        while header.request_id not in self.expected:
            if waited >= self.WAIT_FOR_TASK_S:
                raise ValueError(f"request {header.request_id} is not a pipelined task of this instance")
            await asyncio.sleep(0.05)
            waited += 0.05
        total = self.expected[header.request_id]
        kv = self.assembly(header.request_id, total)
        if not (0 <= header.layer < kv.kv.shape[0] and header.num_tokens > 0 and 0 <= header.start
                and header.start + header.num_tokens <= total):
            raise ValueError(f"slice layer {header.layer} tokens [{header.start}, {header.start + header.num_tokens}) "
                             f"does not fit request {header.request_id} ({total} tokens)")
        return kv

    def deliver(self, header: KvSlice, kv_slice: torch.Tensor) -> None:
        kv = self.assemblies[header.request_id]
        held = self.held.setdefault((header.request_id, header.layer), {})
        held[header.start] = kv_slice
        # NOTE: a slice lands only right after the one before it (the assembly's watermark)
        while kv.ready[header.layer] in held:
            piece = held.pop(kv.ready[header.layer])
            kv.write_layer(header.layer, kv.ready[header.layer], piece)


class PeerSink:
    """A KvSink that sends each slice to the peer stages that still need it (on the streamer thread).

    A slice of chunk i is needed by every stage that computes a later chunk (its attention reads
    it) and by the last stage (it hands the whole KV to decode).
    """

    def __init__(self, request_id: str, total_tokens: int, spec: PipelineSpec, stage: int, timeout_s: float,
                 secret: bytes | None = None) -> None:
        self.request_id = request_id
        self.total_tokens = total_tokens
        self.chunk_tokens = spec.chunk_tokens
        num_stages = len(spec.stages)
        self.peers: list[tuple[int, socket.socket]] = []  # (last chunk index the peer computes, its socket)
        for peer, addr in enumerate(spec.addrs):
            if peer == stage:
                continue
            last_chunk = max(i for i in range(num_chunks(total_tokens, spec.chunk_tokens)) if i % num_stages == peer)
            host, port = addr.rsplit(":", 1)
            sock = socket.create_connection((host, int(port)), timeout=timeout_s)
            try:
                link.client_handshake_blocking(sock, secret)
            except BaseException:
                sock.close()
                raise
            self.peers.append((last_chunk, sock))

    def write_layer(self, layer: int, start: int, kv: torch.Tensor) -> None:
        header = KvSlice(self.request_id, layer, start, kv.shape[2], self.total_tokens).to_bytes()
        payload = kv.contiguous().numpy().tobytes()
        chunk = start // self.chunk_tokens
        for last_chunk, sock in self.peers:
            if last_chunk > chunk:
                sock.sendall(_LEN.pack(len(header)) + header)
                sock.sendall(payload)

    def finish(self) -> None:
        for _, sock in self.peers:
            sock.close()


def num_chunks(num_tokens: int, chunk_tokens: int) -> int:
    return -(-num_tokens // chunk_tokens)


def my_chunks(num_tokens: int, chunk_tokens: int, stage: int, num_stages: int) -> list[tuple[int, int]]:
    """The [start, end) token ranges this stage computes: chunk i goes to stage i mod X."""
    bounds = [(a, min(a + chunk_tokens, num_tokens)) for a in range(0, num_tokens, chunk_tokens)]
    return [b for i, b in enumerate(bounds) if i % num_stages == stage]


def last_stage(num_tokens: int, chunk_tokens: int, num_stages: int) -> int:
    return PipelineSpec([""] * num_stages, [], chunk_tokens).last_stage(num_tokens)
