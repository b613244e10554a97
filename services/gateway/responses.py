"""The OpenAI-compatible responses: pydantic models of what the gateway sends, and its builders.

Pure: no I/O. The models are the contract: the OpenAPI document's response schemas are generated
from them (openapi.py). Each builder returns the JSON-ready dict of one response or stream event
in the shape of its model (errors are ApiError.body(), in the shape of `Error`).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field

from services.gateway.protocol import GenerateRequest

FinishReason = Literal["stop", "length"]


def _absent_when_none(value: Any) -> bool:
    return value is None


def _no_default(schema: dict[str, Any]) -> None:
    schema.pop("default", None)  # the field is absent, never null


def _optional(description: str = "") -> Any:
    """A field left out of the body when it is not set (token_ids without return_token_ids, ...)."""
    return Field(None, exclude_if=_absent_when_none, description=description or None, json_schema_extra=_no_default)


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(ge=0)


class Usage(BaseModel):
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    total_tokens: int = Field(ge=0)
    prompt_tokens_details: PromptTokensDetails


class CompletionChoice(BaseModel):
    index: Literal[0]
    text: str
    logprobs: None
    finish_reason: FinishReason
    token_ids: list[int] = _optional("Only with return_token_ids.")


class ChatMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: Literal[0]
    message: ChatMessage
    logprobs: None
    finish_reason: FinishReason
    token_ids: list[int] = _optional("Only with return_token_ids.")


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice] = Field(min_length=1, max_length=1)
    usage: Usage


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice] = Field(min_length=1, max_length=1)
    usage: Usage


class CompletionChunkChoice(BaseModel):
    index: Literal[0]
    text: str
    logprobs: None
    finish_reason: FinishReason | None  # null until the last chunk
    token_ids: list[int] = _optional("Only with return_token_ids.")


class ChatDelta(BaseModel):
    role: Literal["assistant"] = _optional("In the first chunk.")
    content: str = _optional()


class ChatChunkChoice(BaseModel):
    index: Literal[0]
    delta: ChatDelta
    logprobs: None
    finish_reason: FinishReason | None  # null until the last chunk
    token_ids: list[int] = _optional("Only with return_token_ids.")


class CompletionChunk(BaseModel):
    """One event of a stream; the usage chunk (stream_options.include_usage) has no choices."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice] = Field(max_length=1)
    usage: Usage = _optional("Only in the usage chunk.")


class ChatCompletionChunk(BaseModel):
    """One event of a stream; the usage chunk (stream_options.include_usage) has no choices."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice] = Field(max_length=1)
    usage: Usage = _optional("Only in the usage chunk.")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str = Field(min_length=1)
    type: str
    param: str | None
    code: str | None


class Error(BaseModel):
    """The OpenAI error shape; every failure of every route answers with it (ApiError.body())."""

    error: ErrorInfo


class StreamErrorInfo(BaseModel):
    message: str = Field(min_length=1)
    type: str
    param: str | None
    code: int = Field(description="The HTTP-like status.")


class StreamError(BaseModel):
    """A failure after the stream started: its last event before [DONE] (ApiError.body(), code: the status)."""

    error: StreamErrorInfo


# --- the bodies -----------------------------------------------------------------------------
# NOTE: plain dicts, not the models: a stream chunk is built per token, and building it through
# pydantic took 10-20 us against 1-2 us (tests/unit/test_gateway_protocol.py holds every builder
# to its model, so the document cannot drift from what is sent)

def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def full_response(req: GenerateRequest, request_id: str, created: int, text: str, finish_reason: str | None,
                  usage_: dict[str, Any], token_ids: list[int]) -> dict[str, Any]:
    """A `Completion` or a `ChatCompletion`."""
    if req.kind == "completion":
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason}
        obj = "chat.completion"
    if req.return_token_ids:
        choice["token_ids"] = token_ids
    return {"id": request_id, "object": obj, "created": created, "model": req.model,
            "choices": [choice], "usage": usage_}


def stream_chunk(req: GenerateRequest, request_id: str, created: int, text: str | None,
                 finish_reason: str | None, first: bool = False, token_ids: tuple[int, ...] = ()) -> dict[str, Any]:
    """A `CompletionChunk` or a `ChatCompletionChunk` with one choice."""
    if req.kind == "completion":
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    else:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
        if text:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    if req.return_token_ids:
        choice["token_ids"] = list(token_ids)
    return {"id": request_id, "object": obj, "created": created, "model": req.model, "choices": [choice]}


def usage_chunk(req: GenerateRequest, request_id: str, created: int, usage_: dict[str, Any]) -> dict[str, Any]:
    """The last chunk before [DONE] with stream_options.include_usage: no choices."""
    obj = "text_completion" if req.kind == "completion" else "chat.completion.chunk"
    return {"id": request_id, "object": obj, "created": created, "model": req.model, "choices": [], "usage": usage_}


def models_list(served_model: str, created: int | None = None) -> dict[str, Any]:
    """A `ModelList`."""
    return {"object": "list", "data": [{"id": served_model, "object": "model",
                                         "created": created or int(time.time()), "owned_by": "moonbus"}]}
