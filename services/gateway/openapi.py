"""The gateway's OpenAPI 3.1 document, served at GET /openapi.json.

Pure. The schemas are generated from the pydantic models of the requests (protocol.py) and the
responses (responses.py), as vLLM and SGLang generate theirs; this module adds the operations
(paths, statuses, headers, the event stream) and writes the served model's numbers (its name,
its context, its vocabulary, the chat endpoint's default max_tokens) into the generated schemas,
so the document states the bounds this gateway really refuses past. What must stay true: a body
the request schemas accept is one `protocol.parse` accepts, and the reverse, except where a
description says otherwise (tests/unit/test_openapi.py checks each bound against `parse`).
Where JSON Schema cannot say what `parse` does: an integer field refuses a number written with
a fraction or exponent (`2.0`, `1e3`), which JSON Schema counts as an integer.
"""

from __future__ import annotations

import copy
from functools import cache
from typing import Any

from pydantic.json_schema import models_json_schema

from services.gateway import responses
from services.gateway.protocol import (  # noqa: F401 (the bounds tests read from here)
    COMPLETION_DEFAULT_MAX_TOKENS,
    JSON_INT_MAX,
    JSON_INT_MIN,
    ROLES,
    TEMPERATURE_MAX,
    ChatCompletionRequest,
    CompletionRequest,
)

REF = "#/components/schemas/{model}"
REQUESTS = (CompletionRequest, ChatCompletionRequest)
RESPONSES = (responses.Completion, responses.ChatCompletion, responses.CompletionChunk, responses.ChatCompletionChunk,
             responses.ModelList, responses.Error, responses.StreamError)
STREAM_DESCRIPTION = (
    "With stream=true: server-sent events, each `data: <JSON chunk>` then a blank line, ending with "
    "`data: [DONE]`. With stream_options.include_usage the last chunk before [DONE] has empty choices "
    "and the usage. A request that fails after the stream started ends with `data: {\"error\": {...}}` "
    "(its code is the HTTP-like status, 429 for a late rejection) and `data: [DONE]`."
)

Schema = dict[str, Any]


def document(served_model: str, max_context: int, vocab_size: int, default_chat_max_tokens: int) -> Schema:
    """The whole document for a gateway serving `served_model` (context `max_context` tokens)."""
    components = _bound(copy.deepcopy(_generated()), served_model, max_context - 1, vocab_size, default_chat_max_tokens)
    return {
        "openapi": "3.1.0",
        "info": {"title": "moonbus gateway", "version": "0.1.0",
                 "description": f"OpenAI-compatible API serving {served_model!r} (context {max_context} tokens). "
                                "Integer fields must be written as integers: 2.0 is refused."},
        "paths": {
            "/v1/completions": {"post": _generate("createCompletion", "CompletionRequest", "Completion",
                                                  "CompletionChunk")},
            "/v1/chat/completions": {"post": _generate("createChatCompletion", "ChatCompletionRequest",
                                                       "ChatCompletion", "ChatCompletionChunk")},
            "/v1/models": {"get": _get_operation("listModels", "The served model.", _json(_ref("ModelList")))},
            "/health": {"get": _health()},
            "/metrics": {"get": _operator_only(_get_operation(
                "metrics", "Prometheus metrics (with API keys on, for an operator's key: every tenant's counts are in them).",
                {"text/plain": {"schema": {"type": "string"}}}))},
            "/openapi.json": {"get": _get_operation("openapi", "This document.", _json({"type": "object"}))},
            "/dashboard": {"get": _get_operation("dashboard", "The live status page (HTML; it polls /dashboard/state).",
                                                 {"text/html": {"schema": {"type": "string"}}})},
            "/dashboard/state": {"get": _get_operation("dashboardState", "What the status page shows, now.",
                                                       _json(_dashboard_state()))},
        },
        "components": {"schemas": components, "securitySchemes": {"apiKey": {
            "type": "http", "scheme": "bearer",
            "description": "A key from `moonbus keys add` (only when the gateway runs with --api-keys)."}}},
        "security": [{"apiKey": []}, {}],  # {}: an open gateway takes requests without a key
    }


@cache
def _generated() -> Schema:
    """Every model's JSON schema, by name (requests as they are validated, responses as they are sent)."""
    _, top = models_json_schema([(m, "validation") for m in REQUESTS] + [(m, "serialization") for m in RESPONSES],
                                ref_template=REF)
    return top["$defs"]


def _bound(schemas: Schema, model: str, max_new: int, vocab_size: int, default_chat_max_tokens: int) -> Schema:
    """The served model's numbers written into the generated schemas."""
    schemas["TokenIds"] |= {"maxItems": max_new, "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}}
    schemas["MaxTokens"]["maximum"] = max_new  # the prompt takes at least one token of the context
    for name, default in (("CompletionRequest", COMPLETION_DEFAULT_MAX_TOKENS),
                          ("ChatCompletionRequest", default_chat_max_tokens)):
        props = schemas[name]["properties"]
        props["model"]["enum"] = [model]
        for field in ("max_tokens", "max_completion_tokens"):
            if field in props:
                props[field]["default"] = default
    return schemas


# --- operations -------------------------------------------------------------------------

def _generate(operation_id: str, request: str, response: str, chunk: str) -> Schema:
    request_id = {"X-Request-Id": {"description": "The request's id (for `moonbus tap --request-id`).",
                                   "schema": {"type": "string"}}}
    ok = {"description": "The completion (stream=false) or its event stream (stream=true).",
          "headers": request_id,
          "content": _json(_ref(response)) | {"text/event-stream": {"schema": _event(chunk)}}}
    return {"operationId": operation_id,
            "requestBody": {"required": True, "content": _json(_ref(request))},
            "responses": {"200": ok} | _errors()}


def _event(chunk: str) -> Schema:
    """One server-sent event (as OpenAPI 3.1 tools read `schema` under text/event-stream)."""
    json_data = {"type": "string", "contentMediaType": "application/json",
                 "contentSchema": {"anyOf": [_ref(chunk), _ref("StreamError")]}}
    data = {"anyOf": [{"const": "[DONE]"}, json_data]}
    return {"type": "object", "required": ["data"], "properties": {"data": data}, "description": STREAM_DESCRIPTION}


def _errors() -> Schema:
    retry = {"Retry-After": {"description": "Seconds to wait before retrying.", "schema": {"type": "string"}}}
    error = _json(_ref("Error"))
    return {
        "400": {"description": "Bad input: malformed JSON, a missing or wrong-typed field, an unknown model, "
                               "an empty prompt, or a prompt or max_tokens beyond the context.", "content": error},
        "401": {"description": "No valid API key (when the cluster takes keys).", "content": error},
        "413": {"description": "The body is larger than the gateway's limit.", "content": error},
        "429": {"description": "Admission rejected the request, or its tenant is over a limit (requests in flight, "
                               "tokens per minute).", "headers": retry, "content": error},
        "503": {"description": "No instance is available.", "headers": retry, "content": error},
        "504": {"description": "The request made no progress for the stall timeout.", "content": error},
        "default": {"description": "Any other failure (404, 405, 413, ...), in the same shape.", "content": error},
    }


def _get_operation(operation_id: str, description: str, content: Schema) -> Schema:
    return {"operationId": operation_id, "responses": {"200": {"description": description, "content": content}}}


def _operator_only(operation: Schema) -> Schema:
    error = _json(_ref("Error"))
    operation["responses"] |= {
        "401": {"description": "No valid API key (when the cluster takes keys).", "content": error},
        "403": {"description": "The key is not an operator's (moonbus keys add --operator).", "content": error}}
    return operation


# NOTE: /health and /dashboard/state are not OpenAI's API and have no models: their schemas are written here

def _health() -> Schema:
    up = _object({"status": {"const": "ok"}, "model": {"type": "string"},
                  "instances": {"type": "object", "additionalProperties": {"type": "integer"}}})
    up["properties"] |= {  # with API keys on, for an operator's key only
                  "in_flight": {"type": "integer"},
                  "kv_layouts": {"type": "array", "items": {"type": "string"},
                                 "description": "The workers' KV layouts, e.g. 30x2x3x64 bfloat16."},
                  "dtypes": {"type": "array", "items": {"enum": ["bfloat16", "float32"]},
                             "description": "The workers' compute and KV dtypes."},
                  "decode_kv": {"type": "object", "description": "Each decode instance's KV room: its pool's bytes "
                                "(--kv-cache-bytes), the tokens it holds and those free.",
                                "additionalProperties": _object({"kv_cache_bytes": {"type": "integer"},
                                                                 "kv_tokens": {"type": "integer"},
                                                                 "kv_free_tokens": {"type": ["integer", "null"]}})}}
    down = {"type": "object", "required": ["status"], "properties": {"status": {"const": "unavailable"}}}
    return {"operationId": "health", "responses": {
        "200": {"description": "A prefill and a decode instance are up.", "content": _json(up)},
        "503": {"description": "The cluster cannot serve yet.", "content": _json(down)}}}


def _dashboard_state() -> Schema:
    """services/gateway/dashboard.py builds it; a conductor or messenger that did not answer is
    `available: false` with an `error`."""
    service = {"type": "object", "required": ["available"],
               "properties": {"available": {"type": "boolean"}, "error": {"type": "string"}}}
    listed = {"type": "array", "items": {"type": "object"}}
    outcomes = _object({"start": {"type": "integer", "description": "The wall-clock second of the first point."},
                        "window_s": {"type": "integer"},
                        "points": {"type": "object", "description": "outcome -> one count per second, oldest first",
                                   "additionalProperties": {"type": "array", "items": {"type": "integer"}}},
                        "totals": {"type": "object", "additionalProperties": {"type": "integer"}}})
    return _object({"now": {"type": "number"}, "gateway": {"type": "string"}, "model": {"type": "string"},
                    "conductor": service, "instances": listed | {"description": "Every live instance."},
                    "nodes": listed | {"description": "Each messenger node's KV pool tiers."},
                    "decisions": listed | {"description": "Recent routing decisions, newest first."},
                    "outcomes": outcomes})


def _object(props: Schema) -> Schema:
    return {"type": "object", "required": list(props), "properties": props}


def _json(schema: Schema) -> Schema:
    return {"application/json": {"schema": schema}}


def _ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}
