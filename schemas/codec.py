"""Encode wire dataclasses to JSON bytes and decode them back into typed objects, once, at the edge."""

from __future__ import annotations

import dataclasses
import types
import typing
from functools import cache
from typing import Any, TypeVar

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
        for name, hint in _field_hints(cls).items():
            if name in obj:
                kwargs[name] = _convert(hint, obj[name])
        try:
            return cls(**kwargs)
        except TypeError as exc:
            raise WireError(f"{cls.__name__}: {exc}") from exc


@cache
def _field_hints(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _convert(hint: Any, value: Any) -> Any:
    """Turn decoded JSON into the annotated type where it is a Wire type (possibly nested)."""
    if value is None:
        return None
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(hint):
            if arg is not type(None):
                return _convert(arg, value)
    if origin in (list, tuple):
        args = typing.get_args(hint)
        inner = args[0] if args else Any
        items = [_convert(inner, v) for v in value]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        _, inner = typing.get_args(hint)
        return {k: _convert(inner, v) for k, v in value.items()}
    if isinstance(hint, type) and issubclass(hint, Wire):
        return hint.from_dict(value)
    return value
