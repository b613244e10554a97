"""Wire types are msgspec Structs: encoded to JSON and decoded back into typed objects, once, at the edge.

Decoding checks every field against its annotation (a string where a string is due, an integer
that is not a boolean, no NaN or infinity, ...), and the annotated types below carry the checks
of fields that become NATS subjects or file names, so nothing received from the bus is used as a
subject or a path before it is validated. Checks that span several fields live in the type's
`__post_init__`, which msgspec runs after decoding too. A bad message is a `WireError`: the
service logs it and drops it.

NOTE: msgspec checks the annotated constraints (patterns, bounds) when it decodes or converts,
not when a service builds a message itself: what a service builds is checked where it is received.
"""

from __future__ import annotations

import re
from functools import cache
from typing import Annotated, Any, TypeVar

import msgspec

T = TypeVar("T", bound="Wire")


class WireError(ValueError):
    """Raised when bytes received from the bus cannot be decoded into the expected wire type."""


_ENCODER = msgspec.json.Encoder()


class Wire(msgspec.Struct, frozen=True):
    """Base of the frozen Structs that travel over NATS (and the transport's frames) as JSON."""

    def to_bytes(self) -> bytes:
        return _ENCODER.encode(self)

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)

    @classmethod
    def from_bytes(cls: type[T], data: bytes) -> T:
        try:
            return _decoder(cls).decode(data)
        except msgspec.DecodeError as exc:  # malformed JSON, or a ValidationError
            raise WireError(f"{cls.__name__}: {exc}") from None

    @classmethod
    def from_dict(cls: type[T], obj: Any) -> T:
        try:
            return msgspec.convert(obj, cls)
        except msgspec.ValidationError as exc:
            raise WireError(f"{cls.__name__}: {exc}") from None


@cache
def _decoder(cls: type) -> msgspec.json.Decoder:
    return msgspec.json.Decoder(cls)


# ids travel inside subjects (moonbus.events.request.<kind>.<id>) and file names ("<id>.kv")
_TOKEN = r"[A-Za-z0-9_-]{1,128}"
_SUBJECT = rf"{_TOKEN}(\.{_TOKEN}){{0,15}}"
_FILE_NAME = r"[A-Za-z0-9][A-Za-z0-9_-]{0,200}\.kv"
_HOLDER = rf"{_TOKEN}:{_TOKEN}"


def _matching(regex: str) -> msgspec.Meta:
    # NOTE: \Z, not $: msgspec searches the pattern, and $ also matches before a final newline
    return msgspec.Meta(pattern=rf"^(?:{regex})\Z")


# An id that becomes one token of a subject or part of a file name: letters, digits, '-', '_'.
Token = Annotated[str, _matching(_TOKEN)]
OptionalToken = Annotated[str, _matching(f"({_TOKEN})?")]  # "" = not set
# A subject to publish to (a reply subject): dot-separated tokens, no wildcards.
Subject = Annotated[str, _matching(_SUBJECT)]
# A request's KV file in a node's shared-memory directory: '<id>.kv', no path separators.
FileName = Annotated[str, _matching(_FILE_NAME)]
# A worker process's name in its pins: '<instance>:<incarnation>'; "" = the messenger itself.
Holder = Annotated[str, _matching(_HOLDER)]
OptionalHolder = Annotated[str, _matching(f"({_HOLDER})?")]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]


def check_token(name: str, value: str) -> None:
    """For a string that did not come in a wire type: raises WireError unless it is a `Token`."""
    if not isinstance(value, str) or not re.fullmatch(_TOKEN, value):
        raise WireError(f"{name} {value!r} must be 1-128 letters, digits, '-' or '_'")


def check_file_name(name: str, value: str) -> None:
    """For a string that did not come in a wire type: raises WireError unless it is a `FileName`."""
    if not isinstance(value, str) or not re.fullmatch(_FILE_NAME, value):
        raise WireError(f"{name} {value!r} is not a KV file name")
