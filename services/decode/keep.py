"""What a decode instance keeps of its requests in the node's pool (common/pool_client.py).

While a request decodes, its new full blocks are stored `store_every_blocks` at a time, so that
if the instance is lost the request resumes elsewhere by loading (or pulling) its prompt and what
it generated instead of recomputing it. When it finishes, its whole KV (prompt and completion)
is stored, so that the next turn of a conversation hits. Only the copy out of the batch's
buffers runs between steps; the stores run beside the next steps, one at a time per request (they
share its hold at the messenger).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import torch
from prometheus_client import CollectorRegistry, Counter, Histogram

from common import metrics, runner
from common.engine.batch import BatchEngine
from common.pool_client import PoolClient, PoolUnavailable
from schemas.decode import DecodeTask

log = logging.getLogger(__name__)

STORE_MAX_BLOCKS = 16  # blocks of one request copied out between two steps, at most (a long prompt takes several)


@dataclass
class Running:
    """A request in the batch."""

    task: DecodeTask
    generated: list[int]  # this attempt's tokens so far (the first came from prefill)
    started: float = field(default_factory=time.perf_counter)
    stored_blocks: int = 0  # its leading blocks handed to the node's pool so far
    storing: asyncio.Task | None = None  # a store of its blocks under way

    @property
    def request_id(self) -> str:
        return self.task.request_id

    @property
    def kv_tokens(self) -> list[int]:
        """The tokens whose KV it holds: all but the last one sampled (never fed back yet)."""
        return self.task.prompt_token_ids + self.generated[:-1]

    def index_of_last(self) -> int:
        """Position of the newest token among the completion's tokens (earlier attempts included)."""
        return self.task.num_generated + len(self.generated) - 1


class KvKeeper:
    def __init__(self, engine: BatchEngine, pool: PoolClient, tasks: runner.TaskGroup, every_blocks: int,
                 block_tokens: int, registry: CollectorRegistry) -> None:
        self.engine = engine
        self.pool = pool
        self.tasks = tasks
        self.every_blocks = every_blocks  # 0: running requests' blocks are not stored
        self.block_tokens = block_tokens
        self.copy_s = Histogram("moonbus_decode_store_copy_seconds", "copying a running request's new full blocks out "
                                "of the batch between steps, to store them in the pool",
                                buckets=metrics.FAST_BUCKETS, registry=registry)
        self.blocks_stored = Counter("moonbus_decode_blocks_stored_running", "blocks of running requests stored in the "
                                     "node's pool as they filled (a resumed request reloads them)", registry=registry)

    def store_progress(self, running: dict[str, Running]) -> None:
        """Between two steps: each running request with `every_blocks` new full blocks has them
        copied out of its buffer, and stored beside the next steps."""
        every, bt = self.every_blocks, self.block_tokens
        if every <= 0:
            return
        for rid, seq in running.items():
            if (seq.storing is not None and not seq.storing.done()) or rid not in self.engine.index:
                continue
            full = self.engine.kv_len(rid) // bt
            if full - seq.stored_blocks < every:
                continue
            full = min(full, seq.stored_blocks + STORE_MAX_BLOCKS)  # a long prompt's blocks over several steps
            started = time.perf_counter()
            kv = self.engine.kv_span(rid, seq.stored_blocks * bt, full * bt)
            self.copy_s.observe(time.perf_counter() - started)
            tokens = seq.kv_tokens[: full * bt]
            seq.storing = self.tasks.spawn(self.store_blocks(seq, tokens, kv, full), f"store-progress-{rid}",
                                           essential=False)

    async def store_blocks(self, seq: Running, tokens: list[int], kv: torch.Tensor, full: int) -> None:
        try:
            stored = await self.pool.store(seq.request_id, tokens, kv, seq.task.key_seed, first_block=seq.stored_blocks)
            self.blocks_stored.inc(stored)
            seq.stored_blocks = full
        except PoolUnavailable as exc:
            log.warning("request %s: running KV not stored: %s", seq.request_id, exc)

    def store_finished(self, seq: Running, kv: torch.Tensor) -> None:
        """A finished request's whole KV (`kv`, taken out of the batch), stored beside the steps."""
        self.tasks.spawn(self.store_kv(seq, kv), f"store-{seq.request_id}", essential=False)

    async def store_kv(self, seq: Running, kv: torch.Tensor) -> None:
        tokens = seq.kv_tokens
        if seq.storing is not None:  # one store of a request at a time: they share its hold at the messenger
            await asyncio.wait([seq.storing])
        try:
            await self.pool.store(seq.request_id, tokens, kv, seq.task.key_seed)
        except PoolUnavailable as exc:
            log.warning("request %s: KV not stored: %s", seq.request_id, exc)
