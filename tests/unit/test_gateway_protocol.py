"""The gateway's pure parts: request validation and incremental detokenization with stop strings."""

from __future__ import annotations

import pytest

from common import models
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
