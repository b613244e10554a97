"""Block pulls between messengers (hot-block replication), over the point-to-point transports.

    puller (this node)                                      source node's messenger
    call "pin" PinBlocks(request, keys)   ----------------> lookup: the leading blocks it holds (SSD
                                                            hits promoted), pinned for this connection
                                          <---------------- PinReply(its slab region, key/slot/checksum, offsets)
    reserve DRAM slots here (in rounds, as a worker stores)
    read(slab region, [(offset, my slot)]) ---------------> one-sided: straight into the reserved slots
    verify each block's checksum (once, on arrival); commit the leading good ones
    call "unpin" UnpinBlocks(corrupt)     ----------------> pins released; a corrupt block is dropped
                                                            from the source's pool and reported
A connection that ends releases whatever it still pins (Peer.defer), so a puller that dies
leaks nothing at the source; a failed round releases the reservations it made here.

The source's slab is registered once, read-only, when the messenger starts. NodePool is
single-threaded: the pin and unpin handlers (connection threads) run their pool work on the
messenger's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time

from common.kv import blocks as kvblocks
from common.transport import Channel, Peer, Transports
from schemas.pool import PoolReply, PullRequest, SlotRef
from schemas.transfer import PinBlocks, PinReply, RegionRef, UnpinBlocks
from services.messenger.node_pool import NodePool

log = logging.getLogger(__name__)


class Pulls:
    def __init__(self, pool: NodePool, transports: Transports, own_holder: str, publish, loop: asyncio.AbstractEventLoop,
                 timeout_s: float) -> None:
        self.pool = pool
        self.transports = transports
        self.own_holder = own_holder  # the messenger's own pins ("<instance>:<epoch>")
        self.publish = publish  # list[PoolEvent] -> None (on the loop)
        self.loop = loop
        self.timeout_s = timeout_s
        self._slab_view = pool.slab.buffer()
        self.slab_ref: RegionRef = transports.register(f"slab{pool.epoch}", self._slab_view, writable=False)
        transports.handle("pin", self.serve_pin)
        transports.handle("unpin", self.serve_unpin)

    def close(self) -> None:
        self.transports.unregister(self.slab_ref.region)
        self._slab_view.release()

    # --- the source's side (connection threads) ----------------------------------------------------
    def _hold(self, peer: Peer, request_id: str) -> str:
        # NOTE: one pull of a request at a time per source (a request has one prefill at a time)
        return f"{self.own_holder}/{request_id}"

    def serve_pin(self, body: bytes, peer: Peer) -> bytes:
        req = PinBlocks.from_bytes(body)
        hold = self._hold(peer, req.request_id)
        found = self._on_loop(self._pin(hold, req.keys))
        holds = peer.state.setdefault("pull_holds", set())
        if not holds:
            peer.defer(lambda: [self._on_loop(self._release(h, [])) for h in list(holds)])
        holds.add(hold)
        offsets = [self.pool.slab.offset(ref.slot) for ref in found]
        return PinReply(self.slab_ref, found, offsets, self.pool.layout.block_nbytes).to_bytes()

    def serve_unpin(self, body: bytes, peer: Peer) -> bytes:
        req = UnpinBlocks.from_bytes(body)
        for key in req.corrupt:
            log.error("block %016x failed its checksum at %s after a pull; dropping it here", key, peer.name)
        holds = peer.state.get("pull_holds", set())
        while holds:
            self._on_loop(self._release(holds.pop(), req.corrupt))
        return b""

    def _on_loop(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(self.timeout_s)

    async def _pin(self, hold: str, keys: list[int]) -> list[SlotRef]:
        found, events = self.pool.lookup(hold, keys)
        self.publish(events)
        return found

    async def _release(self, hold: str, corrupt: list[int]) -> None:
        self.publish(self.pool.release(hold, corrupt))

    # --- the puller's side (the event loop) ----------------------------------------------------------
    async def pull(self, req: PullRequest, endpoints: dict[str, str]) -> tuple[PoolReply, str]:
        """Fetch the leading blocks of `req.keys` the source holds and keep them here."""
        started = time.perf_counter()
        channel = await asyncio.to_thread(self.transports.connect, endpoints)
        stored = 0
        try:
            pin = PinReply.from_bytes(await asyncio.to_thread(channel.call, "pin",
                                                              PinBlocks(req.request_id, req.keys).to_bytes()))
            if pin.blocks and (pin.region is None or pin.block_nbytes != self.pool.layout.block_nbytes):
                raise ValueError(f"the source's blocks are {pin.block_nbytes} bytes, ours {self.pool.layout.block_nbytes}")
            stored, corrupt = await self._land(channel, req, pin)
            await asyncio.to_thread(channel.call, "unpin", UnpinBlocks(corrupt).to_bytes())
        finally:
            channel.close()  # the source releases what this connection still pins
        nbytes = stored * self.pool.layout.block_nbytes
        return PoolReply(True, num_blocks=stored, nbytes=nbytes, seconds=time.perf_counter() - started,
                         transport=channel.transport), channel.transport

    async def _land(self, channel: Channel, req: PullRequest, pin: PinReply) -> tuple[int, list[int]]:
        """Reserve, read straight into the slots, verify, commit; returns (blocks stored, corrupt keys)."""
        where = {b.key: (b.checksum, off) for b, off in zip(pin.blocks, pin.offsets)}
        keys = [b.key for b in pin.blocks]
        hold = f"{self.own_holder}/{req.request_id}"
        stored, corrupt = 0, []
        try:
            for _ in range(len(keys)):  # in rounds, as a worker stores: reserved blocks stay pinned until written
                slots, events = self.pool.reserve(hold, keys, req.first_depth)
                self.publish(events)
                if not slots:
                    break
                good = await asyncio.to_thread(self._read, channel, pin.region, slots, where)
                written = [SlotRef(ref.key, ref.slot, where[ref.key][0]) for ref in slots[:good]]
                self.publish(self.pool.commit(hold, written))
                self.publish(self.pool.release(hold))
                stored += good
                if good < len(slots):
                    corrupt.append(slots[good].key)
                    log.error("request %s: block %016x failed its checksum on arrival; the pulled prefix ends there",
                              req.request_id, slots[good].key)
                    break
        finally:  # a failed round must not leave its reservations pinned
            self.publish(self.pool.release(hold))
        return stored, corrupt

    def _read(self, channel: Channel, region: RegionRef, slots: list[SlotRef], where) -> int:
        """Read the blocks into their slots (a worker thread); how many lead with good checksums."""
        views = [self.pool.slab.view(ref.slot) for ref in slots]
        try:
            channel.read(region, [(where[ref.key][1], v) for ref, v in zip(slots, views)])
            for i, (ref, view) in enumerate(zip(slots, views)):
                if kvblocks.checksum(view) != where[ref.key][0]:
                    return i
            return len(slots)
        finally:
            for view in views:  # NOTE: a view left alive would pin the slab's mapping
                view.release()
