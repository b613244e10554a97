"""Gateway core: tokenize, ask the conductor for a route, and collect a request's tokens.

One subscription on gateway_tokens(instance_id) receives the TokenChunks of every request of
this gateway and drops each into its request's queue (request_id -> RequestState); each HTTP
handler awaits only its own queue.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from nats.aio.msg import Msg
from nats.errors import NoRespondersError, TimeoutError as NatsTimeout

from common import bus
from schemas import subjects
from schemas.route import RouteReply, RouteRequest
from schemas.tokens import TokenChunk
from schemas.workers import StatusReply
from services.gateway.config import GatewayConfig
from services.gateway.detokenize import Detokenizer
from services.gateway.protocol import ApiError, GenerateRequest

log = logging.getLogger(__name__)

COMPLETION_DEFAULT_MAX_TOKENS = 16  # as in the OpenAI API


@dataclass
class RequestState:
    chunks: asyncio.Queue[TokenChunk] = field(default_factory=asyncio.Queue)


@dataclass
class Generation:
    """One admitted request, as the HTTP handler sees it."""

    request_id: str
    request: GenerateRequest
    prompt_ids: list[int]
    max_tokens: int
    arrival: float  # time.time() at the gateway
    state: RequestState
    created: int = field(default_factory=lambda: int(time.time()))
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    ttft_s: float | None = None
    ended: bool = False


@dataclass(frozen=True)
class Delta:
    text: str  # may be empty: text can be held back while its tokens are known
    finish_reason: str | None = None
    token_ids: tuple[int, ...] = ()


class Gateway:
    def __init__(self, cfg: GatewayConfig, nc, tokenizer, served_model: str, max_context: int) -> None:
        self.cfg = cfg
        self.nc = nc
        self.tokenizer = tokenizer
        self.served_model = served_model
        self.max_context = max_context
        self.vocab_size = len(tokenizer)
        self.events = bus.EventPublisher(nc, "gateway", cfg.instance_id)
        self.reply_subject = subjects.gateway_tokens(cfg.instance_id)
        self.states: dict[str, RequestState] = {}  # request_id -> RequestState

    async def on_tokens(self, msg: Msg) -> None:
        try:
            chunk = TokenChunk.from_bytes(msg.data)
        except ValueError:
            log.exception("dropping malformed token chunk")
            return
        state = self.states.get(chunk.request_id)
        if state is not None:  # else: the request already ended (e.g. client went away)
            state.chunks.put_nowait(chunk)

    # --- admission ------------------------------------------------------------------------
    def tokenize(self, req: GenerateRequest) -> list[int]:
        if req.messages is not None:
            encoded = self.tokenizer.apply_chat_template(req.messages, add_generation_prompt=True, tokenize=True, return_dict=True)
            return list(encoded["input_ids"])
        if isinstance(req.prompt, list):
            bad = [t for t in req.prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise ApiError(400, f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})", param="prompt")
            return list(req.prompt)
        return list(self.tokenizer(req.prompt)["input_ids"])

    def max_tokens_for(self, req: GenerateRequest, num_prompt: int) -> int:
        room = self.max_context - num_prompt
        if room < 1:
            raise ApiError(400, f"the prompt is {num_prompt} tokens; this model's context is {self.max_context} tokens",
                           param="messages" if req.kind == "chat" else "prompt", code="context_length_exceeded")
        if req.max_tokens is None:
            default = COMPLETION_DEFAULT_MAX_TOKENS if req.kind == "completion" else self.cfg.default_chat_max_tokens
            return min(default, room)
        if req.max_tokens > room:
            raise ApiError(400, f"max_tokens {req.max_tokens} plus the prompt's {num_prompt} tokens exceed this model's "
                                f"context of {self.max_context} tokens", param="max_tokens", code="context_length_exceeded")
        return req.max_tokens

    async def start(self, req: GenerateRequest) -> Generation:
        """Validate against the model, route, and return the admitted generation (or raise ApiError)."""
        arrival = time.time()
        prompt_ids = await asyncio.to_thread(self.tokenize, req)
        if not prompt_ids:
            raise ApiError(400, "the prompt is empty after tokenization", param="prompt")
        max_tokens = self.max_tokens_for(req, len(prompt_ids))
        rid = ("cmpl-" if req.kind == "completion" else "chatcmpl-") + uuid.uuid4().hex
        gen = Generation(rid, req, prompt_ids, max_tokens, arrival, RequestState())
        self.states[rid] = gen.state
        await self.events.request("received", rid, endpoint=req.kind, prompt_tokens=len(prompt_ids),
                                  max_tokens=max_tokens, stream=req.stream, gateway=self.cfg.instance_id)
        try:
            reply = await self.route(gen)
        except BaseException:
            self.states.pop(rid, None)
            raise
        if not reply.admitted:
            self.states.pop(rid, None)
            kind = "rejected" if reply.status == 429 else "failed"
            await self.events.request(kind, rid, status=reply.status, reason=reply.reason, stage="arrival")
            err = ApiError(reply.status, reply.reason, retry_after_s=reply.retry_after_s,
                           code="overloaded" if reply.status == 429 else "unavailable")
            err.request_id = rid
            raise err
        return gen

    async def route(self, gen: Generation) -> RouteReply:
        request = RouteRequest(gen.request_id, gen.prompt_ids, gen.request.sampling(gen.max_tokens),
                               self.reply_subject, gen.arrival)
        try:
            msg = await self.nc.request(subjects.CONDUCTOR_ROUTE, request.to_bytes(), timeout=self.cfg.route_timeout_s)
        except (NoRespondersError, NatsTimeout):
            return RouteReply(False, 503, "no conductor answered; the cluster is not ready", retry_after_s=1.0)
        return RouteReply.from_bytes(msg.data)

    # --- the stream of tokens -------------------------------------------------------------
    async def deltas(self, gen: Generation) -> AsyncIterator[Delta]:
        """Text as it becomes final; the last Delta carries finish_reason. Raises ApiError on failure."""
        detok = Detokenizer(self.tokenizer, gen.request.stop)
        pending: dict[int, TokenChunk] = {}  # index -> chunk that arrived early
        expected = 0
        while True:
            try:
                chunk = await asyncio.wait_for(gen.state.chunks.get(), self.cfg.stall_timeout_s)
            except asyncio.TimeoutError:
                raise ApiError(504, f"no progress from the cluster for {self.cfg.stall_timeout_s:.0f} s", code="timeout")
            if chunk.error:
                detail = {"stage": chunk.stage or "worker", "source": chunk.source}
                if chunk.stage == "decode":
                    detail |= {"wasted_prefill_tokens": chunk.wasted_prefill_tokens,
                               "wasted_prefill_s": chunk.wasted_prefill_s}
                prefix = "rejected" if chunk.error_status == 429 else "request failed"
                raise ApiError(chunk.error_status or 500, f"{prefix}: {chunk.error}", retry_after_s=chunk.retry_after_s,
                               code="overloaded" if chunk.error_status == 429 else "worker_failed", detail=detail)
            pending[chunk.index] = chunk
            while expected in pending:
                chunk = pending.pop(expected)
                expected += len(chunk.token_ids)
                if gen.ttft_s is None:
                    gen.ttft_s = time.time() - gen.arrival
                    gen.cached_tokens = chunk.cached_tokens
                    await self.events.request("first_token", gen.request_id, ttft_s=round(gen.ttft_s, 6))
                gen.completion_tokens += len(chunk.token_ids)
                text = detok.add(chunk.token_ids)
                ids = tuple(chunk.token_ids)
                if detok.stopped:
                    yield Delta(text, "stop", ids)
                    return
                if chunk.finish_reason is not None:
                    yield Delta(text + detok.flush(), chunk.finish_reason, ids)
                    return
                yield Delta(text, None, ids)

    async def end(self, gen: Generation, kind: str, **data) -> None:
        """Exactly one terminal event per request; stops its workers if it ended early."""
        if gen.ended:
            return
        gen.ended = True
        self.states.pop(gen.request_id, None)
        if kind != "completed" or gen.finish_reason == "stop":
            # the workers may still be generating (client gone, stop string, failure elsewhere)
            await self.nc.publish(subjects.REQUEST_CANCEL, gen.request_id.encode())
        await self.events.request(kind, gen.request_id, prompt_tokens=len(gen.prompt_ids),
                                  completion_tokens=gen.completion_tokens, cached_tokens=gen.cached_tokens,
                                  ttft_s=gen.ttft_s, seconds=round(time.time() - gen.arrival, 6), **data)

    async def cluster_status(self) -> StatusReply | None:
        try:
            msg = await self.nc.request(subjects.CONDUCTOR_STATUS, b"", timeout=1.0)
        except (NoRespondersError, NatsTimeout):
            return None
        return StatusReply.from_bytes(msg.data)


async def serve(cfg: GatewayConfig, stop: asyncio.Event) -> None:
    from aiohttp import web

    from common import models
    from services.gateway.api import Api

    ref = models.prepare(cfg.model, cfg.home)
    tokenizer = await asyncio.to_thread(models.load_tokenizer, ref)
    shape = models.read_shape(ref)
    nc = await bus.connect(cfg.nats_url, cfg.instance_id)
    gateway = Gateway(cfg, nc, tokenizer, ref.name, shape.max_context)
    await nc.subscribe(gateway.reply_subject, cb=gateway.on_tokens)
    api = Api(gateway)
    for kind in ("prefilled", "kv_pulled"):
        await nc.subscribe(subjects.request_event(kind, "*"), cb=api.on_request_event)
    runner = web.AppRunner(api.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port)
    await site.start()
    log.info("gateway %s serving %s on http://%s:%d", cfg.instance_id, ref.name, cfg.host, cfg.port)
    await stop.wait()
    await runner.cleanup()
    await bus.shutdown(nc)
