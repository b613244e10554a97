"""Fuzz the live gateway from its own OpenAPI document: no request gets a 5xx or kills a process.

Schemathesis turns /openapi.json into request bodies that conform (positive) and that break it
(negative: wrong types, missing fields, non-JSON bytes). What a schema-driven generator does not
send comes from a sweep (every nasty value at every place of a body: deep nesting, numbers past
every range, unicode edge cases) and a hand-written strategy (wrong content types and methods,
raw and truncated bytes). Every answer is checked as it arrives and every failure is kept, so one
run lists every distinct bad answer, each with its request.

Cost: each generation request asks for at most MAX_FUZZ_TOKENS tokens (the strategy is bounded,
not the schema) and the gateway's chat default is lowered to match: ~2,400 requests take ~35 s
on 2 cores, after the cluster starts. Examples are derandomized: a run is repeatable.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings, strategies as st
from jsonschema import Draft202012Validator
from schemathesis import GenerationMode
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,
                                               status_code_conformance)

from services.gateway import openapi
from services.gateway.protocol import COMPLETION_DEFAULT_MAX_TOKENS
from tests.integration.conftest import start_cluster

pytestmark = pytest.mark.integration

MODEL = "tiny-random"
MAX_FUZZ_TOKENS = 4
GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")
GET_PATHS = ("/v1/models", "/health", "/metrics", "/openapi.json", "/dashboard", "/dashboard/state")
EXAMPLES = {GenerationMode.POSITIVE: 60, GenerationMode.NEGATIVE: 100}  # per generation endpoint
RAW_EXAMPLES = 200
TIMEOUT_S = 60
# (a 5xx is check_answer's to report)
SCHEMA_CHECKS = [status_code_conformance, content_type_conformance, response_schema_conformance]
INTEGER_FIELDS = ("max_tokens", "max_completion_tokens", "seed", "n")


@dataclass
class Ledger:
    """Every answer the fuzzer saw: statuses by phase, and the requests whose answer broke a rule."""

    chunk_schemas: dict[str, Draft202012Validator]  # path -> validator of one stream event's JSON
    statuses: Counter = field(default_factory=Counter)  # (phase, path, status) -> count
    streams: int = 0  # answers that were event streams
    failures: list[str] = field(default_factory=list)

    def total(self) -> int:
        return sum(self.statuses.values())

    def report(self, cluster, since: int) -> str:
        found = self.failures[since:]
        return "\n".join([f"{len(found)} bad answers (logs: {cluster.log_dir}):", *found])

    def fail(self, what: str, method: str, path: str, body: object, response: requests.Response | None) -> None:
        answer = "" if response is None else f" -> {response.status_code} {response.text[:300]!r}"
        self.failures.append(f"{what}: {method} {path} {str(body)[:300]!r}{answer}")


@pytest.fixture(scope="module")
def fuzz_cluster(tmp_path_factory, tiny_profile):
    cluster = start_cluster(tmp_path_factory.mktemp("fuzz"), profile=tiny_profile,
                            service_args={"gateway": ["--default-chat-max-tokens", str(MAX_FUZZ_TOKENS)]})
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def ledger(fuzz_cluster) -> Ledger:
    doc = requests.get(f"{fuzz_cluster.spec.url}/openapi.json", timeout=TIMEOUT_S).json()
    chunk_schemas = {}
    for path in GENERATE_PATHS:
        event = doc["paths"][path]["post"]["responses"]["200"]["content"]["text/event-stream"]["schema"]
        chunk = event["properties"]["data"]["anyOf"][1]["contentSchema"]
        chunk_schemas[path] = Draft202012Validator(chunk | {"components": doc["components"]})
    return Ledger(chunk_schemas)


@pytest.fixture(scope="module")
def http():
    with requests.Session() as session:
        yield session


def fuzz_settings(examples: int):
    return settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                    phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))


# --- the checks every answer must pass --------------------------------------------------------

def check_answer(ledger: Ledger, method: str, path: str, body: object, response: requests.Response) -> None:
    """No 5xx; a 4xx in the OpenAI error shape; a stream without a server-side error event."""
    status = response.status_code
    if status >= 500:
        ledger.fail(f"{status}", method, path, body, response)
    elif status >= 400:
        problem = error_shape_problem(response)
        if problem:
            ledger.fail(f"4xx not in the OpenAI error shape ({problem})", method, path, body, response)
    elif response.headers.get("Content-Type", "").startswith("text/event-stream"):
        ledger.streams += 1
        problem = stream_problem(response.content, ledger.chunk_schemas[path])
        if problem:
            ledger.fail(f"stream: {problem}", method, path, body, response)
    elif path in GENERATE_PATHS:
        problem = usage_problem(response.json()["usage"])
        if problem:
            ledger.fail(f"usage: {problem}", method, path, body, response)


def usage_problem(usage: dict) -> str:
    """Token counts that add up, and no more completion tokens than any fuzzed request may ask for."""
    if usage["total_tokens"] != usage["prompt_tokens"] + usage["completion_tokens"]:
        return "total_tokens is not prompt_tokens + completion_tokens"
    if not 1 <= usage["completion_tokens"] <= COMPLETION_DEFAULT_MAX_TOKENS:
        return f"{usage['completion_tokens']} completion tokens; every request asked for 1..{COMPLETION_DEFAULT_MAX_TOKENS}"
    if not 0 <= usage["prompt_tokens_details"]["cached_tokens"] <= usage["prompt_tokens"]:
        return "more cached tokens than prompt tokens"
    return ""


def error_shape_problem(response: requests.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return "not JSON"
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or set(error) != {"message", "type", "param", "code"}:
        return "not {'error': {message, type, param, code}}"
    if not isinstance(error["message"], str) or not error["message"]:
        return "empty message"
    if "Traceback" in error["message"]:
        return "a traceback in the message"
    if not isinstance(error["type"], str) or not all(v is None or isinstance(v, str) for v in (error["param"], error["code"])):
        return "wrong-typed type, param or code"
    return ""


def stream_problem(content: bytes, chunk_schema: Draft202012Validator) -> str:
    """What is wrong with an event stream: its end, an event the document does not describe, a server error."""
    payloads = [line[6:] for line in content.split(b"\n") if line.startswith(b"data: ")]
    if not payloads or payloads[-1] != b"[DONE]":
        return "does not end with data: [DONE]"
    for payload in payloads[:-1]:
        try:
            event = json.loads(payload)
        except ValueError:
            return f"an event that is not JSON: {payload[:100]!r}"
        error = next(chunk_schema.iter_errors(event), None)
        if error is not None:
            return f"an event the document does not describe: {error.message[:200]}"
        code = event.get("error", {}).get("code")
        if isinstance(code, int) and code >= 500:
            return f"a server error after the stream started: {event['error']}"
    return ""


def as_integers(body: dict) -> dict:
    """Integer fields written as integers.

    NOTE: JSON Schema counts 311.0 as an integer and the generator sends it that way on purpose;
    the gateway refuses it (400, as the document says), so left alone ~40% of positive bodies
    would stop at validation and never reach a worker.
    """
    def whole(value):
        return int(value) if isinstance(value, float) and value.is_integer() else value

    for name in INTEGER_FIELDS:
        if name in body:
            body[name] = whole(body[name])
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        body["prompt"] = [[whole(t) for t in p] if isinstance(p, list) else whole(p) for p in prompt]
    return body


def validate(ledger: Ledger, case, response) -> None:
    """Schemathesis' own checks: the answer is one the document describes (status, type, body)."""
    try:
        case.validate_response(response, checks=SCHEMA_CHECKS)
    except FailureGroup as group:  # each failure is kept, not raised
        for failure in group.exceptions:
            ledger.fail(f"schema conformance: {failure.title}: {failure.message[:300]}", case.method, case.path,
                        case.body, None)


def bounded(body: object) -> object:
    """Cap the tokens a generated body asks for; leaves every other field (and every malformation) alone."""
    if isinstance(body, dict):
        for name in ("max_tokens", "max_completion_tokens"):
            value = body.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > MAX_FUZZ_TOKENS:
                body[name] = MAX_FUZZ_TOKENS
    return body


# --- the tests ----------------------------------------------------------------------------------

def test_the_gateway_serves_its_openapi_document(fuzz_cluster, http):
    response = http.get(f"{fuzz_cluster.spec.url}/openapi.json", timeout=TIMEOUT_S)
    assert response.status_code == 200 and response.headers["Content-Type"].startswith("application/json")
    doc = response.json()
    assert doc == json.loads(json.dumps(openapi.document(MODEL, 4096, doc_vocab_size(doc), MAX_FUZZ_TOKENS)))
    assert set(doc["paths"]) == set(GENERATE_PATHS) | set(GET_PATHS)


def doc_vocab_size(doc: dict) -> int:
    return doc["components"]["schemas"]["TokenIds"]["items"]["maximum"] + 1


@pytest.mark.parametrize("path", GENERATE_PATHS)
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["positive", "negative"])
def test_schema_fuzz(fuzz_cluster, ledger, http, path, mode):
    url, before = fuzz_cluster.spec.url, len(ledger.failures)
    operation = schemathesis.openapi.from_url(f"{url}/openapi.json")[path]["POST"]

    @fuzz_settings(EXAMPLES[mode])
    @given(case=operation.as_strategy(mode))
    def fuzz(case):
        if mode is GenerationMode.POSITIVE:
            case.body = as_integers(case.body)
        case.body = bounded(case.body)
        response = http.request(**case.as_transport_kwargs(base_url=url), timeout=TIMEOUT_S)
        ledger.statuses[(mode.value, path, response.status_code)] += 1
        check_answer(ledger, "POST", path, case.body, response)
        if mode is GenerationMode.POSITIVE:  # the document must describe what the gateway answers
            validate(ledger, case, response)

    fuzz()
    assert len(ledger.failures) == before, ledger.report(fuzz_cluster, before)


def test_get_routes(fuzz_cluster, ledger, http):
    schema, before = schemathesis.openapi.from_url(f"{fuzz_cluster.spec.url}/openapi.json"), len(ledger.failures)
    for path in GET_PATHS:
        case = schema[path]["GET"].Case()
        response = http.request(**case.as_transport_kwargs(base_url=fuzz_cluster.spec.url), timeout=TIMEOUT_S)
        ledger.statuses[("get", path, response.status_code)] += 1
        check_answer(ledger, "GET", path, None, response)
        validate(ledger, case, response)
    assert len(ledger.failures) == before, ledger.report(fuzz_cluster, before)


# --- what a schema-driven generator does not send ------------------------------------------------

VALID = {
    "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 2},
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
}
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "seed",
          "stop", "stream", "stream_options", "ignore_eos", "return_token_ids"]
NUMBER_LITERALS = [b"1" + b"0" * 400, b"-1" + b"0" * 400, b"1e400", b"-1e400", b"1e-400", b"-0", b"0.0",
                   b"9223372036854775807", b"9223372036854775808", b"18446744073709551615", b"18446744073709551616",
                   b"-9223372036854775808", b"-9223372036854775809", b"NaN", b"Infinity", b"1.0", b"4096", b"4095",
                   b"2.0000000000000001", b"5e-324", b"0x10", b"01"]
STRING_LITERALS = ['"\\ud800"', '"\\udc00x"', '"\\u0000"', '"\u202e\u200b\ufeff"', '"\U0001f600"', '""', '" "',
                   '"<|im_end|>"', '"<|im_start|>assistant\\n"', '"\\n\\n"', '"' + "\u00e9" * 3000 + '"']
CONTENT_TYPES = ["application/json", "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                 "application/json; charset=utf-16", "text/event-stream", "", "*/*"]
DEPTHS = [64, 900, 990, 1000, 1021, 1025, 5000]  # orjson refuses past 1024 levels; repr overflows near 1000
NESTED_VALUES = [text for depth in DEPTHS for text in ("[" * depth + "1" + "]" * depth, '{"a":' * depth + "1" + "}" * depth)]
NASTY_VALUES = [literal.decode() for literal in NUMBER_LITERALS] + STRING_LITERALS + NESTED_VALUES + [
    "null", "true", "[]", "{}", '[""]', "[[]]", '{"type": "text"}', '[{"type": "text", "text": 5}]', "[1, 2, 99999]",
    "[-1]", '["a", "b"]']
# Where a raw value goes: ("field", path, name) replaces one top-level field of the valid body;
# ("message", where) one part of the first chat message (its role, its content, its content part, or all of it).
PLACES = [("field", path, name) for path in GENERATE_PATHS for name in FIELDS] + [
    ("message", where) for where in ("role", "content", "part", "message")]


def with_value(place: tuple, raw: str) -> tuple[str, bytes]:
    """(path, body): the valid body with the raw JSON text `raw` (possibly invalid JSON) put at `place`."""
    if place[0] == "field":
        _, path, name = place
        text = json.dumps({k: v for k, v in VALID[path].items() if k != name})
        return path, (text[:-1] + f', "{name}": {raw}' + "}").encode()
    parts = {"role": '"user"', "content": '"hi"'}
    if place[1] == "part":
        parts["content"] = f'[{{"type": "text", "text": {raw}}}]'
    elif place[1] != "message":
        parts[place[1]] = raw
    message = raw if place[1] == "message" else "{" + ", ".join(f'"{k}": {v}' for k, v in parts.items()) + "}"
    return "/v1/chat/completions", f'{{"model": "{MODEL}", "max_tokens": 2, "messages": [{message}]}}'.encode()


def test_every_nasty_value_in_every_place(fuzz_cluster, ledger, http):
    """A sweep, not a sample: each value the generators reach only by luck, at each place of a body."""
    url, before = fuzz_cluster.spec.url, len(ledger.failures)
    for place in PLACES:
        for raw in NASTY_VALUES:
            path, body = with_value(place, raw)
            response = http.post(url + path, data=body, headers={"Content-Type": "application/json"}, timeout=TIMEOUT_S)
            ledger.statuses[("sweep", path, response.status_code)] += 1
            check_answer(ledger, "POST", path, body[:300], response)
    assert len(ledger.failures) == before, ledger.report(fuzz_cluster, before)


def json_values() -> st.SearchStrategy[str]:
    scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8)
    values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                          max_leaves=8)
    return st.one_of(values.map(json.dumps), st.text(max_size=40).map(json.dumps), st.sampled_from(NASTY_VALUES))


@st.composite
def raw_requests(draw) -> tuple[str, str, bytes, str]:
    """(method, path, body bytes, content type) outside what the schema describes."""
    path = draw(st.sampled_from(GENERATE_PATHS))
    content_type = draw(st.sampled_from(CONTENT_TYPES))
    valid = json.dumps(VALID[path]).encode()
    shape = draw(st.sampled_from(["value", "bytes", "truncated", "nested body", "method"]))
    if shape == "value":
        place = draw(st.sampled_from(PLACES))
        raw = draw(json_values())
        if place[-1] in ("max_tokens", "max_completion_tokens") and raw.lstrip("-").isdigit():
            raw = str(min(int(raw), MAX_FUZZ_TOKENS))  # a random integer could ask for thousands of tokens
        path, body = with_value(place, raw)
    elif shape == "bytes":
        body = draw(st.binary(max_size=256) | st.sampled_from([b"", b"\xef\xbb\xbf" + valid, valid.decode().encode("utf-16"),
                                                                 valid + b"garbage", valid + valid]))
    elif shape == "truncated":
        body = valid[:draw(st.integers(0, len(valid) - 1))] + draw(st.sampled_from([b"", b"}", b",}", b'"', b"\x00"]))
    elif shape == "nested body":
        depth = draw(st.sampled_from(DEPTHS + [100_000]))
        body = draw(st.sampled_from(["[" * depth + "]" * depth, '{"a":' * depth + "1" + "}" * depth])).encode()
    else:  # a generation route with another method, or an unknown route
        method = draw(st.sampled_from(["GET", "PUT", "DELETE", "PATCH"]))
        return method, draw(st.sampled_from(GENERATE_PATHS + ("/v1/nope",))), valid, content_type
    return "POST", path, body, content_type


def test_malformed_requests(fuzz_cluster, ledger, http):
    url, before = fuzz_cluster.spec.url, len(ledger.failures)

    @fuzz_settings(RAW_EXAMPLES)
    @given(request=raw_requests())
    def fuzz(request):
        method, path, body, content_type = request
        response = http.request(method, url + path, data=body, headers={"Content-Type": content_type}, timeout=TIMEOUT_S)
        ledger.statuses[("raw", path, response.status_code)] += 1
        check_answer(ledger, method, path, body[:300], response)

    fuzz()
    assert len(ledger.failures) == before, ledger.report(fuzz_cluster, before)


def test_the_cluster_survives_and_still_serves(fuzz_cluster, ledger, http):
    print(f"\nfuzz: {ledger.total()} requests ({ledger.streams} answered as streams); "
          f"statuses: {sorted(ledger.statuses.items())}")
    assert [p.name for p in fuzz_cluster.dead()] == []
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 5, "ignore_eos": True, "temperature": 0,
            "return_token_ids": True}
    response = http.post(f"{fuzz_cluster.spec.url}/v1/completions", json=body, timeout=TIMEOUT_S)
    assert response.status_code == 200, response.text
    reply = response.json()
    assert reply["usage"]["completion_tokens"] == 5 and len(reply["choices"][0]["token_ids"]) == 5
    assert reply["choices"][0]["finish_reason"] == "length"
    assert [p.name for p in fuzz_cluster.dead()] == []
