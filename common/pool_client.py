"""A worker's client of its node's KV pool (the messenger): reuse cached prefixes, store new blocks.

Payloads never cross NATS: the messenger answers with slot numbers of the node's shared-memory
slab, and the worker reads or writes those slots in place. Every read is checked against the
block's checksum; a mismatch ends the usable prefix there (the rest is recomputed) and the
block is handed back as corrupt: the messenger drops it from the pool and the index, and reports it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import torch
from nats.aio.msg import Msg
from nats.errors import NoRespondersError, TimeoutError as NatsTimeout

from common import bus
from common.kv import blocks as kvblocks
from common.kv.blocks import KvLayout
from schemas import subjects
from schemas.codec import Wire
from schemas.pool import (
    CommitRequest, LookupReply, LookupRequest, PoolReply, PullRequest, ReleaseRequest, ReserveReply,
    ReserveRequest, SlotRef,
)
from common.kv.slab import DramSlab
from schemas.workers import WorkerInfo

log = logging.getLogger(__name__)


class PoolUnavailable(RuntimeError):
    """Raised when the node's messenger does not answer a pool request in time."""


@dataclass(frozen=True)
class Prefix:
    kv: torch.Tensor | None  # [L, 2, H, num_blocks * block_tokens, D], a private copy
    num_blocks: int
    corrupt: int = 0  # blocks dropped because their checksum failed


class PoolClient:
    def __init__(self, nc, node: str, layout: KvLayout, holder: str, timeout_s: float = 30.0) -> None:
        self.nc = nc
        self.node = node
        self.layout = layout
        self.timeout_s = timeout_s
        self.holder = holder  # "<instance>:<incarnation>": whose pins these are (schemas.pool)
        self._slab: DramSlab | None = None

    async def call(self, op: str, request: Wire, reply_type: type[Wire]) -> Wire:
        try:
            msg = await bus.request(self.nc, subjects.messenger_control(self.node, op), request.to_bytes(),
                                    timeout=self.timeout_s, attempt_s=bus.ATTEMPT_S)
        except (NoRespondersError, NatsTimeout) as exc:
            raise PoolUnavailable(f"the messenger of node {self.node} did not answer {op!r}: {exc!r}") from exc
        try:
            reply = reply_type.from_bytes(msg.data)
        except ValueError as exc:
            raise PoolUnavailable(f"messenger {op!r} answered something else: {exc}") from exc
        if getattr(reply, "error", ""):
            raise PoolUnavailable(f"messenger {op!r} failed: {reply.error}")
        return reply

    def slab(self, path: str) -> DramSlab:
        """The node's slab, attached once; a restarted messenger makes a new one (its name carries the
        messenger's epoch): then the old mapping is dropped, so the deleted file's memory is freed."""
        if self._slab is None or self._slab.path != path:
            self.drop_slab()
            self._slab = DramSlab.attach(path)
        return self._slab

    def drop_slab(self) -> None:
        old, self._slab = self._slab, None
        if old is not None:
            try:
                old.close()
            except BufferError:  # a view is still alive somewhere: the GC unmaps it later
                log.debug("old slab %s still has views; left to the GC", old.path)

    async def watch_messenger(self) -> None:
        """Drop the slab mapping as soon as the node's messenger restarts or leaves: a mapping of
        its deleted slab would keep that shared memory in use until the next pool call."""
        await bus.receive(self.nc, subjects.WORKER_HEARTBEAT_ALL, WorkerInfo, self.on_heartbeat, background=True)

    async def on_heartbeat(self, info: WorkerInfo, msg: Msg) -> None:
        if not subjects.speaks_for(msg.subject, info.role, info.instance_id) or info.role != "messenger" or info.node != self.node or self._slab is None:
            return
        if info.leaving or (info.incarnation and not self._slab.path.endswith(f"slab-{info.incarnation}")):
            log.info("the messenger of node %s restarted or left; dropping its old slab", self.node)
            self.drop_slab()

    async def load_prefix(self, request_id: str, keys: list[int]) -> Prefix:
        """Pin, copy out and unpin the longest prefix of `keys` this node holds."""
        if not keys:
            return Prefix(None, 0)
        reply: LookupReply = await self.call("lookup", LookupRequest(request_id, keys, self.holder), LookupReply)
        parts, corrupt = [], []
        try:
            if not reply.blocks:
                return Prefix(None, 0)
            slab = self.slab(reply.slab_path)
            parts, corrupt = await asyncio.to_thread(self._read, slab, reply.blocks)
        finally:
            if reply.blocks:  # unpin; a block that failed its checksum is dropped from the pool and the index
                await self.call("release", ReleaseRequest(request_id, [], self.holder, corrupt), PoolReply)
        if corrupt:
            log.error("request %s: block %016x failed its checksum on read; dropped, recomputing from there",
                      request_id, corrupt[0])
        kv = torch.cat(parts, dim=kvblocks.SEQ_AXIS) if parts else None
        return Prefix(kv, len(parts), len(corrupt))

    def _read(self, slab: DramSlab, refs: list[SlotRef]) -> tuple[list[torch.Tensor], list[int]]:
        """Copies of the blocks up to the first that fails its checksum (its key is returned)."""
        parts = []
        for ref in refs:
            view = slab.view(ref.slot)
            if kvblocks.checksum(view) != ref.checksum:
                return parts, [ref.key]
            parts.append(slab.tensor(ref.slot, self.layout).clone())
        return parts, []

    async def store(self, request_id: str, token_ids: list[int], kv: torch.Tensor, seed: int = 0,
                    first_block: int = 0) -> int:
        """Store the full blocks of `token_ids` from `first_block` on that the node lacks; `kv` holds
        those blocks' KV (from token first_block * block_tokens on). Returns how many were stored.
        `seed`: the request's key seed (its cache namespace; 0 = the common one)."""
        keys = kvblocks.block_keys(token_ids, self.layout.block_tokens, seed or kvblocks.DEFAULT_SEED)[first_block:]
        stored = 0
        # NOTE: reserved blocks stay pinned until written, so a prompt longer than the DRAM tier is
        # stored in rounds: each round's blocks, once committed, may be demoted by the next round.
        for _ in range(len(keys)):
            reply: ReserveReply = await self.call("reserve", ReserveRequest(request_id, keys, first_block, self.holder),
                                                  ReserveReply)
            try:
                if not reply.slots:
                    return stored
                written = await asyncio.to_thread(self._write, self.slab(reply.slab_path), reply.slots, keys, kv)
                await self.call("commit", CommitRequest(request_id, written, self.holder), PoolReply)
                stored += len(written)
            finally:
                await self.call("release", ReleaseRequest(request_id, [], self.holder), PoolReply)
        return stored

    def _write(self, slab: DramSlab, slots: list[SlotRef], keys: list[int], kv: torch.Tensor) -> list[SlotRef]:
        position = {key: i for i, key in enumerate(keys)}
        bt = self.layout.block_tokens
        written = []
        for ref in slots:
            i = position[ref.key]
            block = kv.narrow(kvblocks.SEQ_AXIS, i * bt, bt)
            target = slab.tensor(ref.slot, self.layout)
            target.copy_(block)
            written.append(SlotRef(ref.key, ref.slot, kvblocks.checksum(slab.view(ref.slot))))
        return written

    async def pull(self, request_id: str, source_node: str, keys: list[int], first_depth: int) -> PoolReply:
        """Have the node's messenger fetch blocks from `source_node` and keep them (replication)."""
        return await self.call("pull", PullRequest(request_id, source_node, keys, first_depth, self.holder), PoolReply)
