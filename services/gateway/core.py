"""Gateway core: tokenize, ask the conductor for a route, and collect a request's tokens.

One subscription on gateway_tokens(instance_id) receives the TokenChunks of every request of
this gateway and drops each into its request's queue (request_id -> RequestState); each HTTP
handler awaits only its own queue.

Resuming (migration). The gateway is the one place that knows exactly which tokens the client
has, so it is the one that resumes a request when the cluster loses it: on a retryable error (an
instance died or left, a transfer failed), it routes the request again as a new attempt whose
prompt is the original prompt plus the tokens already streamed, with what is left of max_tokens.
The new prefill reuses whatever KV the pool still holds for that prefix, samples the next token
at the same step (seeded sampling stays reproducible) and numbers it where the stream stopped,
so the client sees one stream with no token lost or repeated. Chunks of an abandoned attempt are
dropped, and the workers are told to stop it. Limits: `max_migrations` resumptions after the
first token, `prefill_retries` re-dispatches before it; then the request fails with a clear error.

Lost messages. A broker outage can lose a chunk, a hand-off or a task (core NATS does not keep
messages for a subscriber that has not resubscribed yet). A request that makes no progress for
`probe_after_s`, and every request right after this gateway's connection comes back, probes the
instances its current attempt was routed to: a decode instance that holds it sends its tokens
again from where the client is; if neither instance holds it (twice in a row when the prefill
says it handed it off), the request was lost in transit and is resumed like a lost instance's.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from nats.aio.msg import Msg
from nats.errors import NoRespondersError, TimeoutError as NatsTimeout
from prometheus_client import Counter

from common import bus
from common.decide.retry import after_failure, excused, spent
from common.decide.route import RECOVERY_RETRY_S
from common.decide.tenancy import TenantLimits
from schemas import subjects
from schemas.codec import WireError
from schemas.route import RouteReply, RouteRequest
from schemas.tokens import Cancel, Probe, ProbeReply, TenantUsage, TokenChunk
from schemas.workers import StatusReply
from services.gateway.chat import TemplateError, chat_prompt_ids, control_strings
from services.gateway.config import GatewayConfig
from services.gateway.detokenize import Detokenizer
from services.gateway.protocol import COMPLETION_DEFAULT_MAX_TOKENS, ApiError, GenerateRequest
from services.gateway.tenants import OPEN, KeyBook, Tenant, cache_seed

log = logging.getLogger(__name__)

ROUTE_RETRY_S = 0.1  # with no conductor listening, a route is asked again this often until its deadline
USAGE_EVERY_S = 1.0  # a gateway tells the others its tenants' usage at least this often
SPOOFERS_LOGGED = 1_000  # senders of dropped chunks logged once each; beyond, only counted
ENDED_KEPT = 10_000  # ended requests whose late worker reports still count in this gateway's metrics


@dataclass(frozen=True)
class Heard:
    """A chunk and who sent it, by the subject it came on (which only the sender's credentials may
    publish on), never by what the chunk says of itself."""

    sender_kind: str  # "worker" | "conductor" (subjects.TOKEN_SENDERS)
    sender: str
    chunk: TokenChunk


@dataclass
class RequestState:
    chunks: asyncio.Queue[Heard | None] = field(default_factory=asyncio.Queue)  # None: probe now


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
    token_ids: list[int] = field(default_factory=list)  # completion tokens accepted, in order
    cached_tokens: int = 0
    finish_reason: str | None = None
    ttft_s: float | None = None
    ended: bool = False
    attempt: int = 0
    migrations: int = 0  # resumptions after the first token
    avoid: set[str] = field(default_factory=set)  # instances of its failed attempts
    redispatches: int = 0  # re-dispatches before it
    tenant: Tenant = field(default_factory=lambda: Tenant(OPEN, shared_cache=True))
    booking: list | None = None  # what it booked against its tenant's limits
    key_seed: int = 0  # its cache namespace (tenants.cache_seed)
    prefill_id: str = ""  # where the current attempt was routed
    decode_id: str = ""
    senders: frozenset[str] = frozenset()  # the instances that may send the current attempt's chunks
    predicted_ttft_s: float = 0.0  # the conductor's prediction for the current attempt (0: none)
    handed_off_unseen: int = 0  # probes in a row where prefill handed it off and decode did not know it
    found_gone: set[str] = field(default_factory=set)  # found gone, their failure counted: each excuses one more

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


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
        self.controls = control_strings(tokenizer)  # typed in a message, these stay text (chat.py)
        self.events = bus.EventPublisher.of(nc, "gateway", cfg)
        self.reply_subject = subjects.gateway_tokens(cfg.instance_id)
        self.states: dict[str, RequestState] = {}  # request_id -> RequestState
        self.ended: collections.OrderedDict[str, None] = collections.OrderedDict()  # the newest ENDED_KEPT ended here
        self.keys = KeyBook(cfg.api_keys)
        self.limits = TenantLimits(cfg.fair_share_floor)
        self.usage_shared_at, self.usage_changed = 0.0, False  # this gateway's tenants' usage, told the others
        # a prompt this many characters long cannot fit the context, whatever the tokenizer does
        self.max_prompt_chars = 32 * max_context
        # chunks from senders a request was not routed to (api.Metrics serves it on /metrics)
        self.spoofed = Counter("moonbus_gateway_spoofed_chunks", "token chunks dropped: their sender was not "
                               "routed the request (a worker), or sent tokens (a conductor)", ["sender_kind"],
                               registry=None)
        self.spoofers: set[str] = set()  # senders already logged (at most SPOOFERS_LOGGED)

    async def on_tokens(self, chunk: TokenChunk, msg: Msg) -> None:
        state = self.states.get(chunk.request_id)
        if state is not None:  # else: the request already ended (e.g. client went away)
            state.chunks.put_nowait(Heard(*subjects.sender_of(msg.subject), chunk))

    def refused(self, gen: Generation, heard: Heard) -> bool:
        """Whether a chunk came from someone the request's current attempt was not routed to (a
        worker may send only its own requests' tokens; a conductor only errors): dropped, counted."""
        chunk = heard.chunk
        if heard.sender_kind == "worker" and heard.sender in gen.senders:
            return False
        if heard.sender_kind == "conductor" and chunk.error and not chunk.token_ids:
            return False
        self.spoofed.labels(heard.sender_kind or "unknown").inc()
        if heard.sender not in self.spoofers and len(self.spoofers) < SPOOFERS_LOGGED:
            self.spoofers.add(heard.sender)
            log.warning("request %s: dropped a chunk from %s %r, which the request was not routed to",
                        gen.request_id, heard.sender_kind or "an unknown sender", heard.sender)
        return True

    # --- admission ------------------------------------------------------------------------
    def tokenize(self, req: GenerateRequest) -> list[int]:
        if req.messages is not None:
            try:
                return chat_prompt_ids(self.tokenizer, req.messages, self.controls)
            except TemplateError as exc:
                raise ApiError(400, f"the messages cannot be formatted with this model's chat template: {exc}",
                               param="messages") from None
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

    def authenticate(self, authorization: str | None) -> Tenant:
        """The caller's tenant, or 401 (in the OpenAI error shape)."""
        tenant = self.keys.tenant_of(authorization)
        if tenant is None:
            raise ApiError(401, "Incorrect API key provided. Send `Authorization: Bearer <key>` with a key of this "
                                "cluster (moonbus keys).", code="invalid_api_key", type_="invalid_request_error")
        return tenant

    async def start(self, req: GenerateRequest, tenant: Tenant | None = None) -> Generation:
        """Validate against the model, route, and return the admitted generation (or raise ApiError)."""
        tenant = tenant or Tenant(OPEN, shared_cache=True)
        arrival = time.time()
        chars = len(req.prompt) if isinstance(req.prompt, str) else sum(len(m["content"]) for m in req.messages or [])
        if chars > self.max_prompt_chars:
            raise ApiError(400, f"the prompt has {chars} characters; this model's context of {self.max_context} tokens "
                                f"cannot hold it", param="messages" if req.kind == "chat" else "prompt",
                           code="context_length_exceeded")
        if req.messages is not None and len(req.messages) > self.max_context:  # each takes a token at least
            raise ApiError(400, f"{len(req.messages)} messages cannot fit this model's context of {self.max_context} "
                                f"tokens", param="messages", code="context_length_exceeded")
        why, retry = self.limits.precheck(tenant, time.monotonic())
        if why:  # a tenant over its limits costs no tokenization
            raise ApiError(429, why, retry_after_s=retry, code="overloaded")
        prompt_ids = await asyncio.to_thread(self.tokenize, req)
        if not prompt_ids:
            raise ApiError(400, "the prompt is empty after tokenization", param="prompt")
        max_tokens = self.max_tokens_for(req, len(prompt_ids))
        rid = ("cmpl-" if req.kind == "completion" else "chatcmpl-") + uuid.uuid4().hex
        gen = Generation(rid, req, prompt_ids, max_tokens, arrival, RequestState(), tenant=tenant,
                         key_seed=cache_seed(tenant, req.cache_salt))
        await self.events.request("received", rid, endpoint=req.kind, prompt_tokens=len(prompt_ids),
                                  max_tokens=max_tokens, stream=req.stream, gateway=self.cfg.instance_id,
                                  tenant=tenant.name, **({"user": req.user} if req.user else {}))
        gen.booking, why, retry = self.limits.admit(tenant, len(prompt_ids) + max_tokens, time.monotonic())
        self.usage_changed |= gen.booking is not None
        if gen.booking is None:
            reply = RouteReply(False, 429, why, retry_after_s=retry)
        elif len(self.states) >= self.cfg.max_inflight:  # a backstop in front of the conductor's admission
            reply = RouteReply(False, 429, f"this gateway already holds {len(self.states)} requests", retry_after_s=1.0)
        else:
            self.states[rid] = gen.state
            try:
                reply = await self.route(gen)
            except BaseException:  # the client went away while the request was being routed
                self.states.pop(rid, None)
                await self.end(gen, "cancelled", reason="client went away")
                raise
        if not reply.admitted:
            self.states.pop(rid, None)
            self.release(gen)
            err = refused(reply.status, reply.reason, reply.retry_after_s)
            err.request_id = rid
            await self.events.request(err.terminal_kind, rid, status=reply.status, reason=reply.reason, stage="arrival")
            raise err
        return gen

    async def route(self, gen: Generation) -> RouteReply:
        """Ask a conductor to route the request's current attempt (a resumed one carries its tokens)."""
        done = len(gen.token_ids)
        request = RouteRequest(gen.request_id, gen.prompt_ids + gen.token_ids,
                               gen.request.sampling(gen.max_tokens - done), self.reply_subject, gen.arrival,
                               attempt=gen.attempt, num_generated=done,
                               deadline_ts=time.time() + self.cfg.route_timeout_s, key_seed=gen.key_seed,
                               avoid=sorted(gen.avoid), tenant=gen.tenant.name if gen.tenant else "")
        payload, deadline = request.to_bytes(), time.monotonic() + self.cfg.route_timeout_s
        while True:
            try:
                msg = await self.nc.request(subjects.CONDUCTOR_ROUTE, payload, timeout=max(0.001, deadline - time.monotonic()))
                reply = RouteReply.from_bytes(msg.data)
                gen.prefill_id, gen.decode_id, gen.handed_off_unseen = reply.prefill_id, reply.decode_id, 0
                gen.senders = frozenset(reply.senders or (reply.prefill_id, reply.decode_id))
                gen.predicted_ttft_s = reply.predicted_ttft_s
                return reply
            except NoRespondersError as exc:
                # no conductor listens (one restarting, say): nobody got it, so it is asked again until
                # the route's deadline, and a conductor back within it routes it
                if time.monotonic() + ROUTE_RETRY_S < deadline:
                    await asyncio.sleep(ROUTE_RETRY_S)
                    continue
                failure: Exception = exc
            except (NatsTimeout, WireError) as exc:
                failure = exc
            # the conductor may still dispatch it: the cancel makes the workers drop it and frees its load
            await self.cancel(gen)
            reason = "no conductor answered; the cluster is not ready" if not isinstance(failure, WireError) \
                else f"the conductor's answer was malformed: {failure}"
            return RouteReply(False, 503, reason, retry_after_s=1.0)

    async def cancel(self, gen: Generation) -> None:
        """Tell every worker (and the conductor) to drop attempts <= the current one."""
        await bus.publish(self.nc, subjects.REQUEST_CANCEL, Cancel(gen.request_id, gen.attempt).to_bytes())

    async def resume(self, gen: Generation, chunk: TokenChunk, gone: frozenset[str] = frozenset()) -> ApiError | None:
        """Route the request again after a retryable error; None once it is, else the error the
        caller fails it with. `gone`: the instances this gateway's probe found gone (no responder),
        the failure being its finding: a later failure on them is the same death, not counted again
        (common/decide/retry.py). How one that cannot be resumed ends: `_unresumed`."""
        started = bool(gen.token_ids)
        retry = after_failure(chunk.stage, started, gen.prefill_id, gen.decode_id)
        counted = not excused(retry, gen.found_gone)
        if counted and spent(retry, gen.migrations, gen.redispatches, self.cfg.max_migrations, self.cfg.prefill_retries):
            log.warning("request %s: not resumed again (%d migrations, %d re-dispatches): %s", gen.request_id,
                        gen.migrations, gen.redispatches, chunk.error)
            return _unresumed(started, chunk, chunk.stage or "worker", f"{chunk.error}; the request was resumed "
                              f"{gen.migrations + gen.redispatches} times, the most allowed (capacity lost, coming back)",
                              429, RECOVERY_RETRY_S)
        await self.cancel(gen)  # the abandoned attempt stops wherever it still runs
        gen.avoid |= retry.avoid
        gen.attempt += 1
        if not counted:  # its excuse is spent; a finding on an excused failure excuses nothing more
            gen.found_gone -= retry.avoid
        else:
            if retry.migrating:
                gen.migrations += 1
            else:
                gen.redispatches += 1
            gen.found_gone |= gone
        log.warning("request %s: resuming as attempt %d after %d tokens (%s%s)", gen.request_id, gen.attempt,
                    len(gen.token_ids), chunk.error, "" if counted else "; a death already counted")
        await self.events.request("migrated", gen.request_id, attempt=gen.attempt, reason=chunk.error,
                                  source=chunk.source, resumed_tokens=len(gen.token_ids), before_first_token=not started,
                                  counted=counted)
        deadline = time.monotonic() + self.cfg.migration_timeout_s
        while True:  # an instance may be restarting: keep asking for a while
            reply = await self.route(gen)
            if reply.admitted:
                return None
            if time.monotonic() + 1.0 > deadline:
                log.warning("request %s: could not be resumed: %s", gen.request_id, reply.reason)
                return _unresumed(started, chunk, "resume", f"{chunk.error}; it could not be resumed: {reply.reason}",
                                  reply.status, reply.retry_after_s)
            await asyncio.sleep(min(max(reply.retry_after_s, 0.2), 1.0))

    def probe_all(self) -> None:
        """After this gateway's connection came back: every request checks where it stands."""
        for state in self.states.values():
            state.chunks.put_nowait(None)

    async def held(self, gen: Generation) -> tuple[bool, frozenset[str]]:
        """Does an instance still hold the current attempt? (decode instances resend lost tokens)
        With the instances the probe found gone (no responder)."""
        if not self.nc.is_connected or not gen.decode_id:
            return True, frozenset()  # nothing can be told now; ask again later
        probe = Probe(gen.request_id, gen.attempt, len(gen.token_ids)).to_bytes()
        answers, gone = {}, set()
        for role, instance in (("decode", gen.decode_id), ("prefill", gen.prefill_id)):
            try:
                msg = await bus.request(self.nc, subjects.worker_probe(instance), probe, timeout=5.0, outage_s=5.0)
                answers[role] = ProbeReply.from_bytes(msg.data)
            except NatsTimeout:  # there, but too busy to answer: no reason to think it lost the request
                return True, frozenset()
            except NoRespondersError:  # gone (the conductor will say so too)
                answers[role] = ProbeReply(False)
                gone.add(instance)
            except WireError:  # nonsense
                answers[role] = ProbeReply(False)
            if answers[role].known and answers[role].phase != "handed_off":
                gen.handed_off_unseen = 0
                return True, frozenset(gone)
        if answers["prefill"].known:  # handed off, but the decode instance has not seen it (yet?)
            gen.handed_off_unseen += 1
            return gen.handed_off_unseen < 2, frozenset(gone)
        return False, frozenset(gone)

    # --- the stream of tokens -------------------------------------------------------------
    async def deltas(self, gen: Generation) -> AsyncIterator[Delta]:
        """Text as it becomes final; the last Delta carries finish_reason. Raises ApiError on failure."""
        detok = Detokenizer(self.tokenizer, gen.request.stop)
        pending: dict[int, TokenChunk] = {}  # index -> chunk of the current attempt that arrived early
        progress = time.monotonic()
        while True:
            try:
                async with asyncio.timeout(self.cfg.probe_after_s):
                    heard = await gen.state.chunks.get()
            except TimeoutError:
                heard = None
            if heard is None:  # quiet for a while, or the connection just came back: is it still held?
                if time.monotonic() - progress > self.cfg.stall_timeout_s:
                    raise ApiError(504, f"no progress from the cluster for {self.cfg.stall_timeout_s:.0f} s",
                                   code="timeout")
                held, gone = await self.held(gen)
                if not held:
                    lost = TokenChunk(gen.request_id, -1, [], error="the request was lost in transit",
                                      error_status=503, source=self.cfg.instance_id, attempt=gen.attempt,
                                      retryable=True, stage="transit")
                    failed = await self.resume(gen, lost, gone=gone)
                    if failed is not None:
                        raise failed
                    pending.clear()
                    progress = time.monotonic()
                continue
            chunk = heard.chunk
            if chunk.attempt != gen.attempt:
                continue  # from an abandoned attempt
            if self.refused(gen, heard):
                continue
            if chunk.error and chunk.retryable:
                failed = await self.resume(gen, chunk)
                if failed is not None:
                    raise failed
                pending.clear()
                continue
            if chunk.error:
                detail = {"stage": chunk.stage or "worker", "source": chunk.source}
                if chunk.stage == "decode":
                    detail |= {"wasted_prefill_tokens": chunk.wasted_prefill_tokens,
                               "wasted_prefill_s": chunk.wasted_prefill_s}
                prefix = "rejected" if chunk.error_status == 429 else "request failed"
                raise ApiError(chunk.error_status or 500, f"{prefix}: {chunk.error}", retry_after_s=chunk.retry_after_s,
                               code="overloaded" if chunk.error_status == 429 else "worker_failed", detail=detail)
            if chunk.index >= len(gen.token_ids):
                pending[chunk.index] = chunk
            while len(gen.token_ids) in pending:
                progress = time.monotonic()
                chunk = pending.pop(len(gen.token_ids))
                if gen.ttft_s is None:
                    gen.ttft_s = time.time() - gen.arrival
                    gen.cached_tokens = chunk.cached_tokens
                    await self.events.request("first_token", gen.request_id, ttft_s=round(gen.ttft_s, 6),
                                              predicted_ttft_s=gen.predicted_ttft_s, attempt=gen.attempt)
                # never past max_tokens, whatever a worker sends: the request's own bound
                room = gen.max_tokens - len(gen.token_ids)
                taken = chunk.token_ids[:room]
                finish = chunk.finish_reason if len(taken) == len(chunk.token_ids) else "length"
                if len(gen.token_ids) + len(taken) >= gen.max_tokens:
                    finish = finish or "length"
                gen.token_ids.extend(taken)
                text = detok.add(taken)
                ids = tuple(taken)
                if detok.stopped:
                    yield Delta(text, "stop", ids)
                    return
                if finish is not None:
                    yield Delta(text + detok.flush(), finish, ids)
                    return
                yield Delta(text, None, ids)

    async def end(self, gen: Generation, kind: str, **data) -> None:
        """Exactly one terminal event per request; stops its workers if it ended early."""
        if gen.ended:
            return
        gen.ended = True
        self.states.pop(gen.request_id, None)
        self.ended[gen.request_id] = None  # workers' reports of it may still be on their way
        while len(self.ended) > ENDED_KEPT:
            self.ended.popitem(last=False)
        self.release(gen)
        if kind != "completed" or gen.finish_reason == "stop":
            # the workers may still be generating (client gone, stop string, failure elsewhere)
            await self.cancel(gen)
        await self.events.request(kind, gen.request_id, prompt_tokens=len(gen.prompt_ids),
                                  completion_tokens=gen.completion_tokens, cached_tokens=gen.cached_tokens,
                                  ttft_s=gen.ttft_s, seconds=round(time.time() - gen.arrival, 6),
                                  attempts=gen.attempt + 1, migrations=gen.migrations, **data)

    def release(self, gen: Generation) -> None:
        """The request no longer counts against its tenant's limits (it used what it used)."""
        if gen.booking is not None:
            self.limits.release(gen.tenant, gen.booking, len(gen.prompt_ids) + gen.completion_tokens)
            gen.booking = None
            self.usage_changed = True

    async def share_usage(self) -> None:
        """Tell the other gateways what this one's tenants hold: at once after a change, else every
        second (they forget a gateway silent for TenantLimits.PEER_TTL_S)."""
        now = time.monotonic()
        if self.usage_changed or now - self.usage_shared_at >= USAGE_EVERY_S:
            self.usage_changed, self.usage_shared_at = False, now
            await bus.publish(self.nc, subjects.tenant_usage(self.cfg.instance_id),
                              TenantUsage(self.cfg.instance_id, self.limits.usage(now)).to_bytes())

    async def on_usage(self, usage: TenantUsage, msg: Msg) -> None:
        if usage.gateway_id != self.cfg.instance_id and subjects.speaks_for(msg.subject, usage.gateway_id):
            self.limits.heard(usage.gateway_id, usage.tenants, time.monotonic())

    async def cluster_status(self) -> StatusReply | None:
        try:
            msg = await self.nc.request(subjects.CONDUCTOR_STATUS, b"", timeout=1.0)
            return StatusReply.from_bytes(msg.data)
        except (NoRespondersError, NatsTimeout, WireError):
            return None


def _unresumed(started: bool, chunk: TokenChunk, stage: str, why: str, status: int, retry_after_s: float) -> ApiError:
    """How a request that could not be resumed after `chunk`'s failure ends. A stream that has
    begun ends with its error event. One before its first token gets `status`: 429 with
    Retry-After when its limits are spent (its instances died under it, one after another: lost
    capacity, as the conductor answers a new request while the only instance of a kind restarts)
    or when no instance had room for it again; 503 only when no instance of a kind exists."""
    detail = {"stage": stage, "source": chunk.source}
    if started:
        return ApiError(chunk.error_status or 503, f"request failed: {why}", code="worker_failed", detail=detail)
    return refused(status, f"{'rejected' if status == 429 else 'request failed'}: {why}", retry_after_s, detail)


def refused(status: int, message: str, retry_after_s: float, detail: dict[str, str] | None = None) -> ApiError:
    """The error for a request no instance took, as a conductor's reply or a spent resume says:
    429 (no room, capacity lost) with Retry-After, 400 for a request that fits no instance, 503 when
    no instance of a kind exists (its terminal event: ApiError.terminal_kind)."""
    code = {429: "overloaded", 400: "request_too_large"}.get(status, "unavailable")
    return ApiError(status, message, retry_after_s=retry_after_s if status != 400 else 0.0, code=code,
                    param="max_tokens" if status == 400 else None, detail=detail)
