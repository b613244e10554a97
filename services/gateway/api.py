"""HTTP routes of the gateway (aiohttp): the OpenAI-compatible API, /health, /metrics and /openapi.json."""

from __future__ import annotations

import asyncio
import logging
import math

import orjson
from aiohttp import web
from nats.aio.msg import Msg
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest

from common import metrics
from schemas.events import Event
from services.gateway import openapi, protocol, responses
from services.gateway.core import Gateway, Generation
from services.gateway.dashboard import Dashboard
from services.gateway.protocol import ApiError

log = logging.getLogger(__name__)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("moonbus_gateway_requests", "requests by endpoint and HTTP status",
                                ["endpoint", "status"], registry=self.registry)
        self.ttft = Histogram("moonbus_gateway_ttft_seconds", "time to first token",
                              buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60), registry=self.registry)
        self.ttft_over_predicted = Histogram(
            "moonbus_gateway_ttft_over_predicted", "actual TTFT / the conductor's prediction at routing (1 = exact; "
            "the gateway's own time before routing included)", buckets=metrics.RATIO_BUCKETS,
            registry=self.registry)
        self.tokens = Counter("moonbus_gateway_completion_tokens", "completion tokens sent", registry=self.registry)
        self.prompt_tokens = Counter("moonbus_prompt_tokens", "prompt tokens of this gateway's requests, by how "
                                     "prefill got their KV", ["source"], registry=self.registry)
        self.blocks_pulled = Counter("moonbus_kv_blocks_replicated", "KV blocks pulled from another node and kept "
                                     "(hot-block replication)", registry=self.registry)
        self.rejections = Counter("moonbus_rejections", "requests rejected, by stage", ["stage"], registry=self.registry)


def json_response(body: dict, status: int = 200, headers: dict | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json", headers=headers)


def error_response(err: ApiError) -> web.Response:
    headers = {"Retry-After": str(max(1, math.ceil(err.retry_after_s)))} if err.status in (429, 503) else {}
    if err.request_id:
        headers["X-Request-Id"] = err.request_id
    return json_response(err.body(), err.status, headers)


@web.middleware
async def errors_middleware(request: web.Request, handler):
    """Every failure answers in the OpenAI error shape; never a traceback."""
    try:
        return await handler(request)
    except ApiError as err:
        return error_response(err)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(ApiError(exc.status, exc.reason or "error"))
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("unhandled error on %s", request.path)
        return error_response(ApiError(500, "internal error; see the gateway log"))


class Api:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.metrics = Metrics()
        self.metrics.registry.register(gateway.spoofed)
        self.dashboard = Dashboard(gateway)  # GET /dashboard: the live status page and its collectors

    def app(self) -> web.Application:
        app = web.Application(middlewares=[errors_middleware], client_max_size=self.gateway.cfg.max_body_bytes)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_page)
        app.router.add_get("/openapi.json", self.openapi_document)
        self.dashboard.add_routes(app)
        return app

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.generate(request, "completion")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self.generate(request, "chat")

    async def generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        try:
            tenant = self.gateway.authenticate(request.headers.get("Authorization"))
            raw = await request.read()
        except ApiError as err:
            self.metrics.requests.labels(kind, str(err.status)).inc()
            raise
        except web.HTTPRequestEntityTooLarge:
            self.metrics.requests.labels(kind, "413").inc()
            raise ApiError(413, f"the request body is larger than {self.gateway.cfg.max_body_bytes} bytes",
                           code="request_too_large")
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            self.metrics.requests.labels(kind, "400").inc()
            raise ApiError(400, f"the request body is not valid JSON: {exc}")
        try:
            req = protocol.parse(body, kind, self.gateway.served_model)
            gen = await self.gateway.start(req, tenant)
        except ApiError as err:
            self.metrics.requests.labels(kind, str(err.status)).inc()
            if err.status == 429:
                self.metrics.rejections.labels("arrival").inc()
                self.dashboard.record("rejected_arrival", tenant.name)
            elif err.status >= 500:
                self.dashboard.record("failed", tenant.name)
            raise
        if req.stream:
            return await self.stream(request, gen)
        return await self.collect(gen)

    async def collect(self, gen: Generation) -> web.Response:
        parts, token_ids = [], []
        try:
            async for delta in self.gateway.deltas(gen):
                parts.append(delta.text)
                token_ids.extend(delta.token_ids)
                gen.finish_reason = delta.finish_reason or gen.finish_reason
        except ApiError as err:
            await self.end_with_error(gen, err)
            err.request_id = gen.request_id
            raise
        except BaseException:
            await self.gateway.end(gen, "cancelled", reason="client went away")
            raise
        await self.finish_ok(gen)
        usage = responses.usage(len(gen.prompt_ids), gen.completion_tokens, gen.cached_tokens)
        return json_response(responses.full_response(gen.request, gen.request_id, gen.created, "".join(parts),
                                                    gen.finish_reason, usage, token_ids), headers={"X-Request-Id": gen.request_id})

    async def stream(self, request: web.Request, gen: Generation) -> web.StreamResponse:
        """Server-sent events, begun with the first token: a request turned away before it (its
        prefill could not start in time, its decode instance refused it late, no instance could
        take it) gets a plain HTTP error, a 429 with Retry-After for an overload, as a request
        refused at arrival does, not a 200 stream that ends in an error event (which an OpenAI
        SDK raises as a broken stream). A failure after the first token ends the stream with an
        error event: the status line went out with that token. Every chunk carries the request
        id (`id`), so a client needs no header for it."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               "X-Request-Id": gen.request_id})
        req = gen.request
        try:
            first = True
            async for delta in self.gateway.deltas(gen):
                gen.finish_reason = delta.finish_reason or gen.finish_reason
                if delta.text or delta.finish_reason or first or (req.return_token_ids and delta.token_ids):
                    if not response.prepared:
                        await response.prepare(request)
                    chunk = responses.stream_chunk(req, gen.request_id, gen.created, delta.text, delta.finish_reason,
                                                  first, delta.token_ids)
                    await send_event(response, chunk)
                    first = False
            if not response.prepared:
                await response.prepare(request)
            if req.include_usage:
                usage = responses.usage(len(gen.prompt_ids), gen.completion_tokens, gen.cached_tokens)
                await send_event(response, responses.usage_chunk(req, gen.request_id, gen.created, usage))
            await response.write(b"data: [DONE]\n\n")
        except ApiError as err:
            await self.end_with_error(gen, err)
            if not response.prepared:  # nothing sent yet: the error is the answer
                err.request_id = gen.request_id
                raise
            await send_event(response, err.body() | {"error": err.body()["error"] | {"code": err.status}})
            await response.write(b"data: [DONE]\n\n")
            return response
        except BaseException:
            await self.gateway.end(gen, "cancelled", reason="client went away")
            raise
        await self.finish_ok(gen)
        await response.write_eof()
        return response

    async def on_request_event(self, event: Event, msg: Msg) -> None:
        """Replication and reuse, as the workers report them, for this gateway's requests."""
        # NOTE: events are stored and relayed after the fact, often after the request ended here
        if event.request_id not in self.gateway.states and event.request_id not in self.gateway.ended:
            return
        if event.kind == "prefilled":
            self.metrics.prompt_tokens.labels("cached").inc(event.data.get("cached_tokens", 0))
            self.metrics.prompt_tokens.labels("computed").inc(event.data.get("computed_tokens", 0))
        elif event.kind == "kv_pulled":
            self.metrics.blocks_pulled.inc(event.data.get("blocks", 0))

    async def end_with_error(self, gen: Generation, err: ApiError) -> None:
        kind = err.terminal_kind
        if kind == "rejected":
            self.metrics.rejections.labels(err.detail.get("stage", "decode")).inc()
        self.dashboard.record("rejected_late" if kind == "rejected" else "failed", gen.tenant.name)
        await self.gateway.end(gen, kind, status=err.status, reason=err.message, **err.detail)
        self.metrics.requests.labels(gen.request.kind, str(err.status)).inc()

    async def finish_ok(self, gen: Generation) -> None:
        await self.gateway.end(gen, "completed", finish_reason=gen.finish_reason)
        self.metrics.requests.labels(gen.request.kind, "200").inc()
        self.dashboard.record("completed", gen.tenant.name)
        self.metrics.tokens.inc(gen.completion_tokens)
        if gen.ttft_s is not None:
            self.metrics.ttft.observe(gen.ttft_s)
            if gen.predicted_ttft_s > 0 and gen.attempt == 0:  # the conductor's error (queue and prefill at routing)
                self.metrics.ttft_over_predicted.observe(gen.ttft_s / gen.predicted_ttft_s)
                self.dashboard.record_ttft(gen.ttft_s, gen.predicted_ttft_s)

    async def models(self, request: web.Request) -> web.Response:
        self.gateway.authenticate(request.headers.get("Authorization"))
        return json_response(responses.models_list(self.gateway.served_model))

    def operator(self, request: web.Request) -> bool:
        """Whether the caller may read the cluster's operational state: anyone on an open gateway;
        with API keys on, an operator's key only (moonbus keys add --operator)."""
        if self.gateway.keys.open:
            return True
        tenant = self.gateway.keys.tenant_of(request.headers.get("Authorization"))
        return tenant is not None and tenant.operator

    async def health(self, request: web.Request) -> web.Response:
        """Readiness for anyone (a load balancer's check): the status, the model and the instances
        per role; the rest (requests in flight, KV layouts and room) for an operator only."""
        status = await self.gateway.cluster_status()
        if status is None:
            return json_response({"status": "unavailable", "reason": "no conductor answered"}, 503)
        roles: dict[str, int] = {}
        for worker in status.workers:
            roles[worker.role] = roles.get(worker.role, 0) + 1
        ready = roles.get("prefill", 0) > 0 and roles.get("decode", 0) > 0
        # the KV layouts the workers run ("30x2x3x64 bfloat16": the dtype is the last word)
        layouts = sorted({w.layout.kv for w in status.workers if w.layout is not None and w.layout.kv})
        # each decode instance's KV room: its pool's bytes, the tokens they hold, the tokens free
        kv = {w.instance_id: {"kv_cache_bytes": w.decode.kv_cache_bytes,
                              "kv_tokens": w.decode.kv_used_tokens + (w.decode.kv_free_tokens or 0),
                              "kv_free_tokens": w.decode.kv_free_tokens}
              for w in status.workers if w.decode is not None}
        body = {"status": "ok" if ready else "unavailable", "model": self.gateway.served_model,
                "instances": roles, "in_flight": status.in_flight, "kv_layouts": layouts,
                "dtypes": sorted({layout.rsplit(" ", 1)[-1] for layout in layouts}), "decode_kv": kv}
        if not self.operator(request):
            body = {key: body[key] for key in ("status", "model", "instances")}
        return json_response(body, 200 if ready else 503)

    async def openapi_document(self, request: web.Request) -> web.Response:
        gw = self.gateway
        return json_response(openapi.document(gw.served_model, gw.max_context, gw.vocab_size, gw.cfg.default_chat_max_tokens))

    async def metrics_page(self, request: web.Request) -> web.Response:
        """Prometheus metrics; with API keys on, for an operator's key only (they count every tenant's
        requests and tokens): Prometheus sends it as `authorization: {credentials: KEY}`."""
        if not self.operator(request):
            self.gateway.authenticate(request.headers.get("Authorization"))  # 401 without a key of this cluster
            raise ApiError(403, "/metrics is for an operator's key (moonbus keys add --operator): it counts every "
                                "tenant's requests", code="forbidden", type_="invalid_request_error")
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def send_event(response: web.StreamResponse, payload: dict) -> None:
    await response.write(b"data: " + orjson.dumps(payload) + b"\n\n")
