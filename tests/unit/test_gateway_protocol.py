"""The gateway's pure parts: request validation and incremental detokenization with stop strings."""

from __future__ import annotations

import random

import pytest

from common import models
from services.gateway import responses
from services.gateway.detokenize import Detokenizer
from services.gateway.protocol import ApiError, parse


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return models.load_tokenizer(models.prepare(models.TINY_RANDOM, tmp_path_factory.mktemp("home")))


def test_parse_fills_defaults_and_keeps_extensions():
    req = parse({"model": "m", "prompt": "hi", "ignore_eos": True, "stop": "x"}, "completion", "m")
    assert (req.temperature, req.top_p, req.max_tokens, req.stop, req.ignore_eos) == (1.0, 1.0, None, ["x"], True)
    assert parse({"model": "m", "prompt": ["hi"]}, "completion", "m").prompt == "hi"  # a batch of one
    chat = parse({"model": "m", "messages": [{"role": "developer", "content": [{"type": "text", "text": "a"}]}],
                  "max_completion_tokens": 7}, "chat", "m")
    assert chat.messages == [{"role": "system", "content": "a"}] and chat.max_tokens == 7


@pytest.mark.parametrize("body,param", [
    ({"prompt": "hi"}, "model"),
    ({"model": "m", "prompt": "hi", "n": 2}, "n"),
    ({"model": "m", "prompt": ["a", "b"]}, "prompt"),
    ({"model": "m", "prompt": "hi", "max_tokens": 1.5}, "max_tokens"),
    ({"model": "m", "prompt": "hi", "seed": "1"}, "seed"),
    ({"model": "m", "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"model": "m", "prompt": "hi", "temperature": 3}, "temperature"),
])
def test_parse_rejects_with_the_offending_param(body, param):
    with pytest.raises(ApiError) as err:
        parse(body, "completion", "m")
    assert err.value.status == 400 and err.value.param == param
    assert err.value.body()["error"]["type"] == "invalid_request_error"


def test_detokenizer_holds_back_split_characters(tokenizer):
    ids = tokenizer("héllo 你好")["input_ids"]  # multi-byte characters span several byte tokens
    detok = Detokenizer(tokenizer, [])
    pieces = [detok.add([i]) for i in ids] + [detok.flush()]
    assert "".join(pieces) == "héllo 你好"
    assert all("\ufffd" not in p for p in pieces)


def test_detokenizer_stops_at_a_stop_string_split_across_tokens(tokenizer):
    detok = Detokenizer(tokenizer, ["STOP"])
    out = "".join(detok.add([i]) for i in tokenizer("abc STOP def")["input_ids"])
    assert out + detok.flush() == "abc " and detok.stopped


def test_detokenizer_releases_a_partial_stop_match_at_the_end(tokenizer):
    detok = Detokenizer(tokenizer, ["STOP"])
    out = "".join(detok.add([i]) for i in tokenizer("abc ST")["input_ids"])
    assert out == "abc "  # "ST" may begin the stop string: held back
    assert detok.flush() == "ST" and not detok.stopped


def test_detokenized_text_is_the_whole_decode_however_the_tokens_arrive(tokenizer):
    # random byte tokens: characters split across tokens and chunks, bytes that never make one
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 40))]
        detok, out, i = Detokenizer(tokenizer, []), [], 0
        while i < len(ids):
            n = rng.randint(1, 3)
            out.append(detok.add(ids[i:i + n]))
            i += n
        assert "".join(out) + detok.flush() == tokenizer.decode(ids, skip_special_tokens=True)


OK = {"model": "m", "prompt": "hi", "max_tokens": 4}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("kind,body,message", [
    ("completion", {"prompt": "hi"}, "missing required field 'model'"),
    ("completion", {"model": None, "prompt": "hi"}, "missing required field 'model'"),
    ("completion", {"model": "m"}, "missing required field 'prompt'"),
    ("completion", OK | {"model": "gpt-9"}, "the model 'gpt-9' does not exist; this server serves 'm'"),
    ("completion", OK | {"model": "gpt-9", "prompt": ""}, "the model 'gpt-9' does not exist"),  # model comes first
    ("completion", OK | {"max_tokens": "10"}, "field 'max_tokens' must be an integer, got a string"),
    ("completion", OK | {"max_tokens": 0}, "max_tokens must be at least 1, got 0"),
    ("completion", OK | {"temperature": True}, "field 'temperature' must be a number, got a boolean"),
    ("completion", OK | {"temperature": 3}, "temperature must be between 0 and 2, got 3.0"),
    ("completion", OK | {"top_p": 0}, "top_p must be in (0, 1], got 0.0"),
    ("completion", OK | {"prompt": ""}, "prompt must not be empty"),
    ("completion", OK | {"prompt": [[]]}, "prompt must not be empty"),
    ("completion", OK | {"prompt": ["a", "b"]}, "only one prompt per request is supported"),
    ("completion", OK | {"prompt": [1.5]}, "prompt must be a string or an array of token ids"),
    ("completion", OK | {"stop": ["a", ""]}, "stop must be a non-empty string or an array of non-empty strings"),
    ("completion", OK | {"stop": ["a"] * 5}, "at most 4 stop sequences are allowed"),
    ("completion", OK | {"stop": "a" * 257}, "a stop sequence may have at most 256 characters"),
    ("completion", OK | {"stream_options": []}, "field 'stream_options' must be an object, got an array"),
    ("completion", OK | {"cache_salt": ""}, "cache_salt must have 1 to 256 characters"),
    ("chat", CHAT | {"messages": []}, "messages must be a non-empty array"),
    ("chat", CHAT | {"messages": "hi"}, "messages must be a non-empty array"),
    ("chat", CHAT | {"messages": ["hi"]}, "messages[0] must be an object"),
    ("chat", CHAT | {"messages": [{"role": "wizard", "content": "hi"}]},
     "messages[0].role must be one of system, developer, user, assistant; got 'wizard'"),
    ("chat", CHAT | {"messages": [{"content": "hi"}]}, "messages[0].role must be one of"),
    ("chat", CHAT | {"messages": [{"role": "user", "content": 5}]},
     "messages[0].content must be a string or an array of text parts"),
    ("chat", CHAT | {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content: only text parts are supported"),
    ("chat", CHAT | {"messages": [{"role": "user", "content": ""}]}, "messages must not all be empty"),
    ("chat", CHAT | {"stream": "yes"}, "field 'stream' must be a boolean, got a string"),
])
def test_parse_words_each_problem_for_a_person(kind, body, message):
    with pytest.raises(ApiError) as err:
        parse(body, kind, "m")
    assert err.value.status == 400 and err.value.message.startswith(message), err.value.message


def test_error_bodies_have_the_documented_shape():
    err = ApiError(429, "rejected", retry_after_s=1.0)
    assert responses.Error.model_validate(err.body()).model_dump() == err.body()
    streamed = err.body() | {"error": err.body()["error"] | {"code": err.status}}
    assert responses.StreamError.model_validate(streamed).error.code == 429


@pytest.mark.parametrize("kind,body", [("completion", {"model": "m", "prompt": "hi"}), ("chat", CHAT)])
@pytest.mark.parametrize("return_token_ids", [False, True])
def test_every_body_sent_is_what_its_model_says(kind, body, return_token_ids):
    # the builders are plain dicts (fast); the models are the contract the document is generated from
    req = parse(body | {"return_token_ids": return_token_ids}, kind, "m")
    usage = responses.usage(2, 3, 1)
    full = (responses.Completion if kind == "completion" else responses.ChatCompletion,
            responses.full_response(req, "r", 7, "yo", "length", usage, [5, 6, 7]))
    chunk_model = responses.CompletionChunk if kind == "completion" else responses.ChatCompletionChunk
    chunks = [(chunk_model, responses.stream_chunk(req, "r", 7, text, finish, first, (5,)))
              for text, finish, first in [("", None, True), ("a", None, False), (None, None, False), ("", "stop", False)]]
    chunks.append((chunk_model, responses.usage_chunk(req, "r", 7, usage)))
    for model, sent in [full, *chunks, (responses.ModelList, responses.models_list("m"))]:
        assert model.model_validate(sent).model_dump(mode="json") == sent
    assert ("token_ids" in full[1]["choices"][0]) == return_token_ids
    assert "usage" not in chunks[0][1] and chunks[-1][1]["choices"] == []


@pytest.mark.parametrize("kind,body,message", [
    ("chat", CHAT | {"logprobs": True}, "logprobs are not supported by this server"),
    ("chat", CHAT | {"top_logprobs": 2}, "top_logprobs are not supported by this server"),
    ("chat", CHAT | {"tools": [{"type": "function", "function": {"name": "get_weather"}}]},
     "tool calls are not supported by this server"),
    ("chat", CHAT | {"tool_choice": "required"}, "tool calls are not supported by this server"),
    ("chat", CHAT | {"response_format": {"type": "json_schema"}}, 'only the response_format {"type": "text"}'),
    ("chat", CHAT | {"presence_penalty": 0.6}, "presence_penalty is not supported by this server"),
    ("completion", OK | {"frequency_penalty": -0.5}, "frequency_penalty is not supported by this server"),
    ("completion", OK | {"logit_bias": {"50256": -100}}, "logit_bias is not supported by this server"),
    ("completion", OK | {"logprobs": 1}, "logprobs are not supported by this server"),
    ("completion", OK | {"echo": True}, "echo is not supported by this server"),
    ("completion", OK | {"best_of": 3}, "only best_of=1 is supported"),
    ("completion", OK | {"n": 2}, "only n=1 is supported"),
    ("chat", CHAT | {"n": 3}, "only n=1 is supported"),
    ("completion", OK | {"suffix": "}"}, "suffix is not supported by this server"),
])
def test_what_this_server_cannot_do_is_refused_not_ignored(kind, body, message):
    """A client asking for logprobs, tool calls or penalties gets a 400 that names the field, not an
    answer that silently lacks what it asked for."""
    with pytest.raises(ApiError) as err:
        parse(body, kind, "m")
    assert err.value.status == 400 and err.value.message.startswith(message), err.value.message
    (asked,) = set(body) - set(CHAT) - set(OK)
    assert err.value.code == "unsupported_value" and err.value.param == asked


@pytest.mark.parametrize("kind,body", [
    ("chat", CHAT | {"logprobs": False, "top_logprobs": 0, "tools": [], "tool_choice": "none",
                     "response_format": {"type": "text"}, "presence_penalty": 0, "frequency_penalty": 0.0,
                     "logit_bias": {}}),
    ("completion", OK | {"logprobs": None, "echo": False, "best_of": 1, "suffix": None, "logit_bias": None}),
])
def test_the_neutral_values_of_what_is_not_supported_are_accepted(kind, body):
    """SDKs and frameworks send these defaults with every request."""
    assert parse(body, kind, "m").model == "m"
