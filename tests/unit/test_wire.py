"""Wire types check what they decode: types, and every field that becomes a subject or a path."""

import pytest

from common.worker import Cancellations
from schemas.codec import WireError
from schemas.decode import DecodeTask
from schemas.pool import LookupRequest, ReleaseRequest
from schemas.prefill import PrefillTask
from schemas.route import RouteRequest, SamplingParams
from schemas.tokens import Cancel, TokenChunk
from schemas.transfer import CallFrame, KvHandle, WriteFrame
from schemas.workers import WorkerInfo

HANDLE = {"node": "node-d0", "name": "in-cmpl-1-a0.kv", "shape": [4, 2, 2, 8, 16], "dtype": "float32", "checksum": 7}


def route(**fields) -> dict:
    return {"request_id": "cmpl-1", "prompt_token_ids": [1, 2], "sampling": {}, "reply_subject": "moonbus.tokens.gw",
            "arrival_ts": 1.0} | fields


def test_a_well_formed_message_round_trips():
    request = RouteRequest.from_dict(route(attempt=2, num_generated=5))
    assert request == RouteRequest.from_bytes(request.to_bytes())
    assert (request.attempt, request.num_generated, request.sampling) == (2, 5, SamplingParams())


@pytest.mark.parametrize("fields, where", [
    ({"request_id": "a.b"}, "request_id"),
    ({"request_id": "../../x"}, "request_id"),
    ({"request_id": 5}, "request_id"),
    ({"reply_subject": "moonbus.>"}, "reply_subject"),
    ({"reply_subject": ""}, "reply_subject"),
    ({"prompt_token_ids": [1, "2"]}, "prompt_token_ids"),
    ({"prompt_token_ids": [True]}, "prompt_token_ids"),
    ({"sampling": {"max_tokens": "many"}}, "max_tokens"),
    ({"arrival_ts": None}, "arrival_ts"),
])
def test_bad_fields_are_wire_errors(fields, where):
    with pytest.raises(WireError, match=where):
        RouteRequest.from_dict(route(**fields))


@pytest.mark.parametrize("name", ["/../../../../tmp/x", "../x.kv", ".hidden.kv", "x.kv/y", "x.txt", "a b.kv"])
def test_a_kv_file_name_cannot_leave_its_directory(name):
    with pytest.raises(WireError):
        KvHandle.from_dict(HANDLE | {"name": name})


def test_a_kv_handle_must_describe_a_float32_request_kv():
    assert KvHandle.from_dict(HANDLE).num_tokens == 8
    with pytest.raises(ValueError):
        KvHandle.from_dict(HANDLE | {"shape": [4, 2, 8]})


def test_ids_that_become_subjects_are_checked_everywhere():
    with pytest.raises(WireError):
        WorkerInfo.from_dict({"instance_id": "d*", "role": "decode", "node": "n"})
    with pytest.raises(WireError):
        WorkerInfo.from_dict({"instance_id": "d0", "role": "decode", "node": "n.1"})
    with pytest.raises(WireError):
        WorkerInfo.from_dict({"instance_id": "d0", "role": "wizard", "node": "n"})
    with pytest.raises(WireError):
        TokenChunk.from_dict({"request_id": "x y", "index": 0, "token_ids": []})
    with pytest.raises(WireError):
        PrefillTask.from_dict(route() | {"decode_id": "d.0", "decode_node": "n"})
    with pytest.raises(WireError):
        DecodeTask.from_dict(route() | {"first_token": 1, "kv": HANDLE | {"node": "n>"}})
    with pytest.raises(WireError):
        LookupRequest.from_dict({"request_id": "r", "keys": [1], "holder": "decode-0"})  # no incarnation
    assert ReleaseRequest.from_dict({"request_id": "r", "keys": [], "holder": "d0:ab12", "corrupt": [3]}).hold_key == "d0:ab12/r"


@pytest.mark.parametrize("data", [
    b'{"request_id": "cmpl-1\\n", "attempt": 0}',  # a newline would end a NATS protocol line
    b'{"request_id": "cmpl-1", "attempt": NaN}',
    b'{"request_id": "cmpl-1", "attempt": 1.0}',
    b'{"request_id": "cmpl-1"',
    b'["cmpl-1", 0]',
])
def test_bytes_that_are_not_a_well_formed_message_are_wire_errors(data):
    with pytest.raises(WireError, match="Cancel"):
        Cancel.from_bytes(data)


def test_transport_frames_are_bounded():
    piece = [0, 4096]
    assert WriteFrame.from_dict({"region": "r", "pieces": [piece], "group": "g", "parts": 2}).parts == 2
    for bad in ({"pieces": [[0, -1]]}, {"pieces": [[0, 1, 2]]}, {"pieces": [piece] * 4097},
                {"group": "g", "parts": 17}, {"group": "g", "parts": 0}, {"parts": 2}, {"group": "a.b"}):
        with pytest.raises(WireError):
            WriteFrame.from_dict({"region": "r", "pieces": [piece]} | bad)
    assert CallFrame.from_dict({"op": "pin", "nbytes": 1 << 20}).nbytes == 1 << 20
    with pytest.raises(WireError):
        CallFrame.from_dict({"op": "pin", "nbytes": (1 << 20) + 1})
    with pytest.raises(WireError):
        CallFrame.from_dict({"op": "../pin", "nbytes": 0})


def test_cancellations_cover_an_attempt_and_the_ones_before_it():
    book = Cancellations(limit=2)
    book.add("a", 1)
    assert book.covers("a", 0) and book.covers("a", 1) and not book.covers("a", 2)
    book.add("a", 0)  # an older cancel arriving late changes nothing
    assert book.covers("a", 1)
    book.add("b", 0)
    book.add("c", 0)  # bounded: the oldest id is forgotten
    assert not book.covers("a", 0) and book.covers("c", 0)
