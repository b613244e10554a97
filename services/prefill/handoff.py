"""The sending end of the streamed handoff: each layer's KV goes to the decode node as it is computed.

Protocol (the receiving end and every way a reservation ends: services/messenger/handoff.py):

    open()      NATS accept to the decode node's messenger -> a region of its memory sized by the
                prompt's KV layout; a transport channel to it (the best backend both ends have)
    sink        a KvSink for LayerStreamer: each layer slice (the reused prefix's too) is written
                at its offsets in the region from views of the assembly (no copy), with its checksum
    complete()  the completion notice, after the last slice: the messenger checks that every slice
                landed and was verified, and answers the KvHandle the DecodeTask carries
    abort()     NATS abort (and the channel closed): the reservation is freed at once

When the decode instance is on this node (a coupled instance), no bytes need to move: the sink
writes the node-local file (FileSink) the decode reads, and complete() just names it.
Failures raise `HandoffFailed`; the caller decides what the request gets (compute.py:
before the first token it is dispatched again, after it the gateway resumes it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import torch
from nats.errors import NoRespondersError, TimeoutError as NatsTimeout

from common import bus, kvfiles
from common.kv.blocks import KvLayout
from common.kv.slices import SliceGeometry, meta
from common.transport import Channel, TransportError, Transports, TransportTurnedAway
from schemas import subjects
from schemas.codec import WireError
from schemas.prefill import PrefillTask
from schemas.transfer import AbortKv, AcceptKv, AcceptKvReply, CompleteKv, CompleteKvReply, KvHandle, RegionRef
from common.engine.layerwise import FileSink

log = logging.getLogger(__name__)
MESSENGER_RESTART_S = 5.0  # a decode node's messenger that is not there is asked again this long (a restart takes 1-3 s)
# pauses before each new try of a KV link whose listener turned it away during the handshake (a
# crowded door: strangers' connections pushed it out); all tries within the handoff's one timeout
CONNECT_RETRY_S = (0.05, 0.2, 0.5, 1.0)


class HandoffFailed(RuntimeError):
    """Raised when a request's KV cannot reach its decode node: no reservation (no messenger, no
    room), a connection that broke, a slice refused or corrupted, or a KV that did not land whole."""


class StreamSink:
    """A KvSink that writes each layer slice straight into the reserved region (streamer thread)."""

    def __init__(self, channel: Channel, region: RegionRef, geometry: SliceGeometry) -> None:
        self.channel = channel
        self.region = region
        self.geometry = geometry
        self.nbytes = 0
        self.last_write = 0.0  # perf_counter when the last slice was handed to the transport

    def write_layer(self, layer: int, start: int, kv: torch.Tensor) -> None:
        pieces = self.geometry.pieces(layer, start, kv)
        self.channel.write(self.region, pieces, meta(layer, start, kv.shape[2]))
        self.nbytes += sum(v.nbytes for _, v in pieces)
        self.last_write = time.perf_counter()

    def finish(self) -> None:
        pass  # the completion notice is sent by Handoff.complete, after the first token is out


class Handoff:
    """One request's KV on its way from this prefill instance to its decode node."""

    def __init__(self, nc, transports: Transports, task: PrefillTask, node: str, shm_dir, layout: KvLayout,
                 holder: str, timeout_s: float, cancelled: Callable[[], bool] = lambda: False) -> None:
        self.nc = nc
        self.cancelled = cancelled  # the request's attempt was called off: no new try of its link
        self.transports = transports
        self.task = task
        self.node = node
        self.shm_dir = shm_dir
        self.shape = layout.request_shape(len(task.prompt_token_ids))
        self.layout = layout
        self.holder = holder
        self.timeout_s = timeout_s
        self.local = task.decode_node == node
        self.transport = "local" if self.local else ""
        self.region: RegionRef | None = None
        self.aborted = False  # or completed: nothing left to free at the decode node
        self.channel: Channel | None = None
        self.sink: StreamSink | FileSink | None = None

    @property
    def nbytes(self) -> int:
        if isinstance(self.sink, StreamSink):
            return self.sink.nbytes
        return self.layout.itemsize * int(torch.Size(self.shape).numel())

    async def open(self) -> None:
        """Reserve the destination and connect to it (or open the node-local file)."""
        if self.local:
            self.sink = FileSink(self.shm_dir / kvfiles.outgoing_name(self.task.request_id, self.task.attempt), self.shape,
                                 self.layout.dtype)
            return
        t = self.task
        request = AcceptKv(t.request_id, t.attempt, len(t.prompt_token_ids), self.holder, t.decode_id, self.node)
        try:
            msg = await bus.request(self.nc, subjects.messenger_control(t.decode_node, "accept"), request.to_bytes(),
                                    timeout=self.timeout_s, absent_s=MESSENGER_RESTART_S, attempt_s=bus.ATTEMPT_S)
            reply = AcceptKvReply.from_bytes(msg.data)
        except (NoRespondersError, NatsTimeout, WireError) as exc:
            raise HandoffFailed(f"no reservation on node {t.decode_node}: its messenger did not answer: {exc!r}") from exc
        if not reply.ok or reply.region is None:
            raise HandoffFailed(f"node {t.decode_node} refused to reserve {len(t.prompt_token_ids)} tokens of KV: "
                                f"{reply.error}")
        self.region = reply.region
        try:
            self.channel = await self.connect(reply.region)
        except TransportError as exc:
            await self.abort()
            raise HandoffFailed(f"cannot reach the KV destination on node {t.decode_node}: {exc}") from exc
        self.transport = self.channel.transport
        self.sink = StreamSink(self.channel, reply.region, SliceGeometry(self.shape, self.layout.itemsize))

    async def connect(self, region: RegionRef) -> Channel:
        """A channel to the reserved region. A listener that turns the link away during the
        handshake is tried again after a pause (CONNECT_RETRY_S), while the handoff's timeout lasts
        and the attempt is not called off (a refusal of this prefill's secret looks the same, so it
        too is tried again, as often); any other failure (no one listens, a failed TLS, a silent
        peer) is final at once: the request moves on rather than waiting on a node that is gone."""
        deadline = time.monotonic() + self.timeout_s  # for the tries to begin: each channel keeps the whole timeout
        pauses = iter(CONNECT_RETRY_S)
        while True:
            try:
                return await asyncio.to_thread(self.transports.connect, region.endpoints, self.timeout_s)
            except TransportTurnedAway as exc:
                pause = next(pauses, None)
                if pause is None or self.cancelled() or time.monotonic() + pause >= deadline:
                    raise
                log.warning("request %s: the KV destination on node %s turned the link away (%s); trying again",
                            self.task.request_id, self.task.decode_node, exc)
                await asyncio.sleep(pause)

    def write_all(self, kv: torch.Tensor) -> None:
        """The whole KV at once, a layer per write (a pipeline's last stage; worker thread)."""
        for layer in range(kv.shape[0]):
            self.sink.write_layer(layer, 0, kv[layer])
        self.sink.finish()

    async def complete(self) -> KvHandle:
        """The completion notice: the KV is whole at the decode node; its handle there."""
        if self.local:
            return self.sink.handle(self.node)
        try:
            body = await asyncio.to_thread(self.channel.call, "complete", CompleteKv(self.region.region).to_bytes())
            reply = CompleteKvReply.from_bytes(body)
        except (TransportError, WireError) as exc:
            await self.abort()
            raise HandoffFailed(f"the KV did not reach node {self.task.decode_node} whole: {exc}") from exc
        finally:
            self._close()
        if not reply.ok or reply.dest is None:
            await self.abort()
            raise HandoffFailed(f"node {self.task.decode_node} refused the KV: {reply.error}")
        self.region, self.aborted = None, True  # it is a landed file now, the decode's to read
        return reply.dest

    async def abort(self) -> None:
        """Free the destination (best effort: its messenger's leases catch what this misses). Sent
        even without a region: the reservation may exist although its reply never came."""
        if self.local:
            if self.sink is not None:
                self.sink.discard()
            return
        self._close()
        if not self.aborted:
            self.aborted = True
            t = self.task
            await bus.publish(self.nc, subjects.messenger_control(t.decode_node, "abort"),
                              AbortKv(t.request_id, t.attempt, t.decode_id).to_bytes())

    def _close(self) -> None:
        if self.channel is not None:
            channel, self.channel = self.channel, None
            channel.close()
