"""Encode wire dataclasses to JSON bytes and decode them back into typed objects, once, at the edge.

Decoding checks every field against its annotation (a string where a string is due, an integer
that is not a boolean, ...), and the wire types whose fields become NATS subjects or file names
check those in `__post_init__` with the validators below, so nothing received from the bus is
used as a subject or a path before it is validated. A bad message is a `WireError`: the service
logs it and drops it.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from functools import cache
from typing import Any, Callable, TypeVar

import orjson

T = TypeVar("T", bound="Wire")


class WireError(ValueError):
    """Raised when bytes received from the bus cannot be decoded into the expected wire type."""


class Wire:
    """Mixin for frozen dataclasses that travel over NATS as JSON."""

    def to_bytes(self) -> bytes:
        return orjson.dumps(self)

    def to_dict(self) -> dict[str, Any]:
        return orjson.loads(orjson.dumps(self))

    @classmethod
    def from_bytes(cls: type[T], data: bytes) -> T:
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise WireError(f"{cls.__name__}: not JSON: {exc}") from exc
        return cls.from_dict(obj)

    @classmethod
    def from_dict(cls: type[T], obj: Any) -> T:
        if not isinstance(obj, dict):
            raise WireError(f"{cls.__name__}: expected an object, got {type(obj).__name__}")
        kwargs = {}
        for name, convert in _field_converters(cls):
            if name in obj:
                try:
                    kwargs[name] = convert(obj[name])
                except WireError as exc:
                    raise WireError(f"{cls.__name__}.{name}: {exc}") from None
        try:
            return cls(**kwargs)
        except TypeError as exc:
            raise WireError(f"{cls.__name__}: {exc}") from exc


# ids travel inside subjects (moonbus.events.request.<kind>.<id>) and file names ("<id>.kv")
_TOKEN = re.compile(r"[A-Za-z0-9_-]{1,128}")
_SUBJECT = re.compile(r"[A-Za-z0-9_-]{1,128}(\.[A-Za-z0-9_-]{1,128}){0,15}")
_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,200}\.kv")


def check_token(name: str, value: str) -> None:
    """An id that becomes one token of a subject or part of a file name: letters, digits, '-', '_'."""
    if not isinstance(value, str) or not _TOKEN.fullmatch(value):
        raise WireError(f"{name} {value!r} must be 1-128 letters, digits, '-' or '_'")


def check_subject(name: str, value: str) -> None:
    """A subject to publish to (a reply subject): dot-separated tokens, no wildcards."""
    if not isinstance(value, str) or not _SUBJECT.fullmatch(value):
        raise WireError(f"{name} {value!r} is not a valid NATS subject to publish to")


def check_file_name(name: str, value: str) -> None:
    """A request's KV file in a node's shared-memory directory: '<id>.kv', no path separators."""
    if not isinstance(value, str) or not _FILE_NAME.fullmatch(value):
        raise WireError(f"{name} {value!r} is not a KV file name")


@cache
def _field_converters(cls: type) -> tuple[tuple[str, Callable[[Any], Any]], ...]:
    hints = typing.get_type_hints(cls)
    return tuple((f.name, _converter(hints[f.name])) for f in dataclasses.fields(cls))


@cache
def _converter(hint: Any) -> Callable[[Any], Any]:
    """The function that converts and checks a decoded value for `hint`, built once per hint
    (reading the annotation on every message cost more than the rest of decoding)."""
    if hint is Any:
        return _same
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        inner = _converter(next(arg for arg in args if arg is not type(None)))
        if type(None) not in args:
            return inner
        return lambda value: None if value is None else inner(value)
    due = f"null where {_name(hint)} is due"
    wrong = f"expected {_name(hint)}, got "
    if origin in (list, tuple):
        args = typing.get_args(hint)
        item_hint = args[0] if args else Any
        item = _converter(item_hint)
        fast = item_hint in (int, str)  # NOTE: token ids and block keys: one type check per item, not a call
        as_tuple = origin is tuple

        def sequence(value: Any) -> Any:
            if value is None:
                raise WireError(due)
            if not isinstance(value, list):
                raise WireError(f"expected an array, got {type(value).__name__}")
            items = value if fast and all(type(v) is item_hint for v in value) else [item(v) for v in value]
            return tuple(items) if as_tuple else items
        return sequence
    if origin is dict:
        value_of = _converter(typing.get_args(hint)[1])

        def mapping(value: Any) -> Any:
            if value is None:
                raise WireError(due)
            if not isinstance(value, dict):
                raise WireError(f"expected an object, got {type(value).__name__}")
            return {k: value_of(v) for k, v in value.items()}
        return mapping
    if isinstance(hint, type) and issubclass(hint, Wire):
        def nested(value: Any) -> Any:
            if value is None:
                raise WireError(due)
            return hint.from_dict(value)
        return nested
    if hint is float:
        def real(value: Any) -> float:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
            raise WireError(due if value is None else wrong + type(value).__name__)
        return real
    if hint is int:
        def integer(value: Any) -> int:
            if isinstance(value, int) and not isinstance(value, bool):
                return value
            raise WireError(due if value is None else wrong + type(value).__name__)
        return integer
    if hint in (str, bool):
        def exact(value: Any) -> Any:
            if isinstance(value, hint):
                return value
            raise WireError(due if value is None else wrong + type(value).__name__)
        return exact

    def unchecked(value: Any) -> Any:  # a type without a check of its own
        if value is None:
            raise WireError(due)
        return value
    return unchecked


def _same(value: Any) -> Any:
    return value


def _name(hint: Any) -> str:
    return getattr(hint, "__name__", str(hint))
