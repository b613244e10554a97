"""The gateway's OpenAPI 3.1 document, served at GET /openapi.json.

Pure: built from the served model's numbers (name, context, vocabulary) and the limits that
`protocol.parse` enforces, so the document states the bounds this gateway really refuses past.
What must stay true: a body the request schemas accept is one `protocol.parse` accepts, and the
reverse, except where a description says otherwise (tests/unit/test_openapi.py checks each bound
against `parse`). Fields that the OpenAI API has and this gateway ignores are allowed
(`additionalProperties`) and not listed. Where JSON Schema cannot say what `parse` does:
- an integer field refuses a number written with a fraction or exponent (`2.0`, `1e3`), which
  JSON Schema counts as an integer;
- `stream_options.include_usage` is read for its truth value, whatever its type;
- in a chat request, `max_tokens` is checked only for its type when `max_completion_tokens` is set.
"""

from __future__ import annotations

from typing import Any

from services.gateway.protocol import MAX_CACHE_SALT_CHARS, MAX_STOP_CHARS, MAX_STOP_SEQUENCES
from services.gateway.service import COMPLETION_DEFAULT_MAX_TOKENS

# NOTE: the gateway parses JSON with orjson, which reads integers in [-2**63, 2**64) and turns any
# other integer into a float, which an integer field refuses: that is the real range of `seed`.
JSON_INT_MIN = -(2**63)
JSON_INT_MAX = 2**64 - 1
ROLES = ["system", "developer", "user", "assistant"]  # developer is read as system
TEMPERATURE_MAX = 2.0
STREAM_FINISH = ("stop", "length", None)  # null until the last chunk
STREAM_DESCRIPTION = (
    "With stream=true: server-sent events, each `data: <JSON chunk>` then a blank line, ending with "
    "`data: [DONE]`. With stream_options.include_usage the last chunk before [DONE] has empty choices "
    "and the usage. A request that fails after the stream started ends with `data: {\"error\": {...}}` "
    "(its code is the HTTP-like status, 429 for a late rejection) and `data: [DONE]`."
)

Schema = dict[str, Any]


def document(served_model: str, max_context: int, vocab_size: int, default_chat_max_tokens: int) -> Schema:
    """The whole document for a gateway serving `served_model` (context `max_context` tokens)."""
    max_new = max_context - 1  # the prompt takes at least one token of the context
    components = {
        "CompletionRequest": _completion_request(served_model, max_new, vocab_size),
        "ChatCompletionRequest": _chat_request(served_model, max_new, default_chat_max_tokens),
        "Usage": _usage(),
        "Completion": _completion(),
        "ChatCompletion": _chat_completion(),
        "CompletionChunk": _completion_chunk(),
        "ChatCompletionChunk": _chat_completion_chunk(),
        "StreamError": _error(code={"type": "integer", "description": "The HTTP-like status."}),
        "ModelList": _model_list(),
        "Error": _error(),
    }
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
            "/metrics": {"get": _get_operation("metrics", "Prometheus metrics.", {"text/plain": {"schema": {"type": "string"}}})},
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


# --- requests ---------------------------------------------------------------------------

def _completion_request(model: str, max_new: int, vocab_size: int) -> Schema:
    token_ids = {"type": "array", "minItems": 1, "maxItems": max_new,
                 "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}}
    text = {"type": "string", "minLength": 1}
    prompt = {"anyOf": [text, token_ids,
                        {"type": "array", "minItems": 1, "maxItems": 1, "items": {"anyOf": [text, token_ids]}}],
              "description": "Text or token ids; an array of exactly one of them is a batch of one. "
                             "The prompt plus max_tokens must fit in the context (else 400)."}
    return _request(model, required=["model", "prompt"], props={
        "prompt": prompt,
        "max_tokens": _max_tokens(max_new, COMPLETION_DEFAULT_MAX_TOKENS),
    })


def _chat_request(model: str, max_new: int, default_max_tokens: int) -> Schema:
    text_part = {"type": "object", "required": ["type", "text"],
                 "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
    content = {"anyOf": [{"type": "string"}, {"type": "array", "items": text_part}]}
    message = {"type": "object", "required": ["role", "content"],
               "properties": {"role": {"enum": ROLES}, "content": content}}
    non_empty = {"properties": {"content": {"anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "contains": {"properties": {"text": {"minLength": 1}}}}]}}}
    messages = {"type": "array", "minItems": 1, "items": message, "contains": non_empty,
                "description": "At least one message has non-empty content."}
    return _request(model, required=["model", "messages"], props={
        "messages": messages,
        "max_tokens": _max_tokens(max_new, default_max_tokens),
        "max_completion_tokens": _max_tokens(max_new, default_max_tokens, "Takes precedence over max_tokens when set."),
    })


def _request(model: str, required: list[str], props: Schema) -> Schema:
    """The fields both generation endpoints share, plus `props`. null means 'not set' for each optional field."""
    stop_text = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}
    shared = {
        "model": {"type": "string", "enum": [model]},
        "n": _nullable({"type": "integer", "enum": [1]}),
        "temperature": _nullable({"type": "number", "minimum": 0, "maximum": TEMPERATURE_MAX,
                                  "default": 1.0, "description": "0 is greedy."}),
        "top_p": _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 1, "default": 1.0}),
        "seed": _nullable({"type": "integer", "minimum": JSON_INT_MIN, "maximum": JSON_INT_MAX,
                           "description": "Reproducible across processes: step i is seeded from (seed, i)."}),
        "stop": _nullable({"anyOf": [stop_text, {"type": "array", "maxItems": MAX_STOP_SEQUENCES, "items": stop_text}]}),
        "stream": _nullable({"type": "boolean", "default": False}),
        "stream_options": _nullable({"type": "object",
                                     "properties": {"include_usage": {"type": "boolean", "default": False}}}),
        "ignore_eos": _nullable({"type": "boolean", "default": False,
                                 "description": "Extension (as in vLLM): generate max_tokens even past EOS."}),
        "return_token_ids": _nullable({"type": "boolean", "default": False,
                                       "description": "Extension (as in vLLM): also return the completion's token ids."}),
        "cache_salt": _nullable({"type": "string", "minLength": 1, "maxLength": MAX_CACHE_SALT_CHARS,
                                 "description": "Extension (as in vLLM): a cache namespace shared by whoever sends "
                                                "the same salt; without it, a tenant's cache is its own."}),
    }
    return {"type": "object", "required": required, "properties": shared | props}


def _max_tokens(max_new: int, default: int, note: str = "") -> Schema:
    return _nullable({"type": "integer", "minimum": 1, "maximum": max_new, "default": default,
                      "description": f"At most the context less the prompt's tokens (else 400). {note}".strip()})


def _nullable(schema: Schema) -> Schema:
    """`schema` or null: the gateway reads null as 'not set'."""
    if "anyOf" in schema:
        return schema | {"anyOf": [*schema["anyOf"], {"type": "null"}]}
    out = schema | {"type": [schema["type"], "null"]}
    if "enum" in schema:
        out["enum"] = [*schema["enum"], None]
    return out


# --- responses --------------------------------------------------------------------------

def _usage() -> Schema:
    count = {"type": "integer", "minimum": 0}
    return _object({"prompt_tokens": count, "completion_tokens": count, "total_tokens": count,
                    "prompt_tokens_details": _object({"cached_tokens": count})})


def _choices(choice: Schema) -> Schema:
    return {"type": "array", "minItems": 1, "maxItems": 1, "items": choice}


def _choice(finish_reasons: tuple[str | None, ...] = ("stop", "length"), **props: Schema) -> Schema:
    finish = {"enum": list(finish_reasons)}
    choice = _object({"index": {"const": 0}, "logprobs": {"type": "null"}, "finish_reason": finish, **props})
    choice["properties"]["token_ids"] = {"type": "array", "items": {"type": "integer"},
                                         "description": "Only with return_token_ids."}
    return choice


def _response(obj: str, choice: Schema) -> Schema:
    return _object({"id": {"type": "string"}, "object": {"const": obj}, "created": {"type": "integer"},
                    "model": {"type": "string"}, "choices": _choices(choice), "usage": _ref("Usage")})


def _completion() -> Schema:
    return _response("text_completion", _choice(text={"type": "string"}))


def _chat_completion() -> Schema:
    message = _object({"role": {"const": "assistant"}, "content": {"type": "string"}})
    return _response("chat.completion", _choice(message=message))


def _chunk(obj: str, choice: Schema) -> Schema:
    """One event of a stream; the usage chunk (stream_options.include_usage) has no choices."""
    chunk = _response(obj, choice)
    chunk["properties"]["choices"] = {"type": "array", "maxItems": 1, "items": choice}
    chunk["required"].remove("usage")
    return chunk


def _completion_chunk() -> Schema:
    return _chunk("text_completion", _choice(STREAM_FINISH, text={"type": "string"}))


def _chat_completion_chunk() -> Schema:
    delta = {"type": "object", "properties": {"role": {"const": "assistant"}, "content": {"type": "string"}}}
    return _chunk("chat.completion.chunk", _choice(STREAM_FINISH, delta=delta))


def _model_list() -> Schema:
    model = _object({"id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
                     "owned_by": {"type": "string"}})
    return _object({"object": {"const": "list"}, "data": {"type": "array", "items": model}})


def _error(code: Schema | None = None) -> Schema:
    """The OpenAI error shape; every failure of every route answers with it (code: a string or null)."""
    inner = _object({"message": {"type": "string", "minLength": 1}, "type": {"type": "string"},
                     "param": {"type": ["string", "null"]}, "code": code or {"type": ["string", "null"]}})
    return _object({"error": inner})


def _object(props: Schema) -> Schema:
    return {"type": "object", "required": list(props), "properties": props}


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


def _health() -> Schema:
    up = _object({"status": {"const": "ok"}, "model": {"type": "string"},
                  "instances": {"type": "object", "additionalProperties": {"type": "integer"}},
                  "in_flight": {"type": "integer"}})
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


def _json(schema: Schema) -> Schema:
    return {"application/json": {"schema": schema}}


def _ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}
