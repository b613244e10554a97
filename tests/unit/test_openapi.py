"""The gateway's OpenAPI document: valid OpenAPI 3.1, one operation per route, and request schemas
that accept exactly what `protocol.parse` accepts at every bound."""

from __future__ import annotations

from types import SimpleNamespace

import openapi_spec_validator
import orjson
from prometheus_client import Counter
import pytest
from jsonschema import Draft202012Validator

from services.gateway import openapi
from services.gateway.api import Api
from services.gateway.protocol import MAX_STOP_SEQUENCES, ApiError, parse

MODEL = "m"
DOC = openapi.document(MODEL, max_context=64, vocab_size=100, default_chat_max_tokens=8)


def request_schema(name: str) -> Draft202012Validator:
    return Draft202012Validator({"$ref": f"#/components/schemas/{name}"} | {"components": DOC["components"]})


def parse_accepts(body: dict, kind: str) -> bool:
    try:
        parse(orjson.loads(orjson.dumps(body)), kind, MODEL)
    except ApiError:
        return False
    return True


def test_the_document_is_valid_openapi_3():
    openapi_spec_validator.validate(DOC)
    assert DOC["openapi"].startswith("3.")


def test_the_document_names_every_route_the_app_registers():
    gateway = SimpleNamespace(served_model=MODEL, cfg=SimpleNamespace(max_body_bytes=4 << 20),
                              spoofed=Counter("spoofed", "the gateway's own counter", registry=None))
    routes = {(route.method, route.resource.canonical) for route in Api(gateway).app().router.routes()
              if route.method != "HEAD"}  # aiohttp adds HEAD to every GET
    documented = {(method.upper(), path) for path, item in DOC["paths"].items() for method in item}
    assert documented == routes


def test_every_error_status_answers_in_the_openai_shape():
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = DOC["paths"][path]["post"]["responses"]
        for status in ("400", "429", "503", "504", "default"):
            assert responses[status]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/Error"}
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
    assert DOC["components"]["schemas"]["ErrorInfo"]["required"] == ["message", "type", "param", "code"]


COMPLETION = {"model": MODEL, "prompt": "hi"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
# (fields added to both a completion and a chat body); each bound is probed on both of its sides
SHARED_CASES = [
    {}, {"model": "other"}, {"model": None},
    {"temperature": 0}, {"temperature": openapi.TEMPERATURE_MAX}, {"temperature": -1e-9},
    {"temperature": openapi.TEMPERATURE_MAX + 1e-9}, {"temperature": True}, {"temperature": "1"}, {"temperature": None},
    {"top_p": 1}, {"top_p": 1e-9}, {"top_p": 0}, {"top_p": 1 + 1e-9}, {"top_p": -0.5},
    {"n": 1}, {"n": 2}, {"n": 0}, {"n": None}, {"n": True},
    {"max_tokens": 1}, {"max_tokens": 0}, {"max_tokens": -3}, {"max_tokens": 1.5}, {"max_tokens": "3"}, {"max_tokens": None},
    {"seed": openapi.JSON_INT_MIN}, {"seed": openapi.JSON_INT_MAX}, {"seed": 1.5}, {"seed": False},
    {"stop": "x"}, {"stop": ""}, {"stop": []}, {"stop": ["x"] * MAX_STOP_SEQUENCES}, {"stop": ["x"] * (MAX_STOP_SEQUENCES + 1)},
    {"stop": ["x", ""]}, {"stop": [1]}, {"stop": None},
    {"stream": True}, {"stream": "yes"}, {"stream": 1},
    {"stream_options": {"include_usage": True}}, {"stream_options": []}, {"stream_options": None},
    {"ignore_eos": True}, {"ignore_eos": 0}, {"return_token_ids": False}, {"return_token_ids": "no"},
    {"unknown_field": [1, {"a": None}]},
    # what this server cannot do is refused, not ignored; the neutral values are accepted
    {"logit_bias": {}}, {"logit_bias": {"5": 1.0}}, {"logit_bias": None}, {"logit_bias": []},
    {"presence_penalty": 0}, {"presence_penalty": 0.5}, {"presence_penalty": None}, {"presence_penalty": "0"},
    {"frequency_penalty": 0.0}, {"frequency_penalty": -1},
]
COMPLETION_CASES = [
    {"prompt": "x"}, {"prompt": ""}, {"prompt": [1, 2]}, {"prompt": []}, {"prompt": ["x"]}, {"prompt": [[1, 2]]},
    {"prompt": ["a", "b"]}, {"prompt": [[]]}, {"prompt": [""]}, {"prompt": [1.5]}, {"prompt": [True]},
    {"prompt": None}, {"prompt": 5}, {"prompt": {"text": "x"}},
    {"logprobs": None}, {"logprobs": 0}, {"logprobs": 5}, {"echo": False}, {"echo": True}, {"best_of": 1},
    {"best_of": 2}, {"suffix": None}, {"suffix": "x"},
]
CHAT_CASES = [
    {"messages": []}, {"messages": None}, {"messages": "hi"}, {"messages": ["hi"]},
    *[{"messages": [{"role": role, "content": "x"}]} for role in openapi.ROLES],
    {"messages": [{"role": "tool", "content": "x"}]}, {"messages": [{"role": None, "content": "x"}]},
    {"messages": [{"role": "user", "content": ""}]}, {"messages": [{"role": "user", "content": ""}, {"role": "user", "content": "x"}]},
    {"messages": [{"role": "user"}]}, {"messages": [{"role": "user", "content": 5}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
    {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
    {"max_completion_tokens": 2}, {"max_completion_tokens": 0}, {"max_completion_tokens": 2.5},
    {"logprobs": False}, {"logprobs": True}, {"logprobs": None}, {"top_logprobs": 0}, {"top_logprobs": 3},
    {"response_format": {"type": "text"}}, {"response_format": {"type": "json_object"}}, {"response_format": "text"},
    {"tools": []}, {"tools": [{"type": "function", "function": {"name": "f"}}]}, {"tool_choice": "none"},
    {"tool_choice": "auto"}, {"tool_choice": "required"},
    {"tool_choice": {"type": "function", "function": {"name": "f"}}},
]


@pytest.mark.parametrize("kind,base,schema,extra", [
    *[("completion", COMPLETION, "CompletionRequest", case) for case in SHARED_CASES + COMPLETION_CASES],
    *[("chat", CHAT, "ChatCompletionRequest", case) for case in SHARED_CASES + CHAT_CASES],
], ids=lambda v: orjson.dumps(v).decode()[:60] if isinstance(v, dict) else str(v))
def test_the_request_schema_accepts_what_parse_accepts(kind, base, schema, extra):
    body = base | extra
    assert request_schema(schema).is_valid(body) == parse_accepts(body, kind)


def test_a_deeply_nested_role_is_refused_not_a_crash():
    """Found by the fuzzer: the error message quoted the role's repr, which overflows at ~1000 levels."""
    role: object = "user"
    for _ in range(2000):
        role = [role]
    with pytest.raises(ApiError) as err:
        parse({"model": MODEL, "messages": [{"role": role, "content": "x"}]}, "chat", MODEL)
    assert err.value.status == 400 and err.value.message.endswith("got an array")
