"""The OpenAI-compatible HTTP protocol: parse and validate bodies, build responses and errors.

Pure: no I/O. Validation errors are ApiError, answered as
{"error": {"message", "type", "param", "code"}} with the error's HTTP status.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from schemas.route import SamplingParams

MAX_STOP_SEQUENCES = 4
MAX_STOP_CHARS = 256  # each stop string
MAX_CACHE_SALT_CHARS = 256


class ApiError(Exception):
    """Raised for a request the API refuses; carries the HTTP status and OpenAI error fields."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type_: str | None = None, retry_after_s: float = 0.0,
                 detail: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.detail = detail or {}  # for the request's terminal event, not the client
        self.request_id = ""  # set once the request has an id: answered as the X-Request-Id header
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or _error_type(status)
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _error_type(status: int) -> str:
    if status == 429:
        return "rate_limit_exceeded"
    if status < 500:
        return "invalid_request_error"
    return "server_error"


@dataclass(frozen=True)
class GenerateRequest:
    """A validated completion or chat request, before tokenization."""

    kind: str  # "completion" | "chat"
    model: str
    prompt: str | list[int] | None  # completion: text or token ids
    messages: list[dict[str, str]] | None  # chat: [{"role", "content"}]
    max_tokens: int | None  # None: the endpoint's default
    temperature: float
    top_p: float
    seed: int | None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False  # extension (as in vLLM): generate max_tokens even past EOS
    return_token_ids: bool = False  # extension (as in vLLM): also return the completion's token ids
    cache_salt: str | None = None  # extension (as in vLLM): a cache namespace shared by whoever sends it

    def sampling(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_p, max_tokens, self.seed, self.ignore_eos)


def parse(body: Any, kind: str, served_model: str) -> GenerateRequest:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = _get(body, "model", str, required=True)
    if model != served_model:
        raise ApiError(400, f"the model {model!r} does not exist; this server serves {served_model!r}",
                       param="model", code="model_not_found")
    prompt = messages = None
    if kind == "completion":
        prompt = _parse_prompt(body)
    else:
        messages = _parse_messages(body)
    n = _get(body, "n", int, default=1)
    if n != 1:
        raise ApiError(400, "only n=1 is supported", param="n")
    max_tokens = _get(body, "max_tokens", int)
    if kind == "chat" and body.get("max_completion_tokens") is not None:
        max_tokens = _get(body, "max_completion_tokens", int)
    if max_tokens is not None and max_tokens <= 0:
        raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    temperature = _get(body, "temperature", float, default=1.0)
    if not 0.0 <= temperature <= 2.0:
        raise ApiError(400, f"temperature must be between 0 and 2, got {temperature}", param="temperature")
    top_p = _get(body, "top_p", float, default=1.0)
    if not 0.0 < top_p <= 1.0:
        raise ApiError(400, f"top_p must be in (0, 1], got {top_p}", param="top_p")
    stream_options = _get(body, "stream_options", dict) or {}
    return GenerateRequest(
        kind=kind,
        model=model,
        prompt=prompt,
        messages=messages,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=_get(body, "seed", int),
        stop=_parse_stop(body),
        stream=_get(body, "stream", bool, default=False),
        include_usage=bool(stream_options.get("include_usage", False)),
        ignore_eos=_get(body, "ignore_eos", bool, default=False),
        return_token_ids=_get(body, "return_token_ids", bool, default=False),
        cache_salt=_parse_cache_salt(body),
    )


def _parse_cache_salt(body: dict[str, Any]) -> str | None:
    salt = _get(body, "cache_salt", str)
    if salt is not None and not 0 < len(salt) <= MAX_CACHE_SALT_CHARS:
        raise ApiError(400, f"cache_salt must have 1 to {MAX_CACHE_SALT_CHARS} characters", param="cache_salt")
    return salt


def _get(body: dict[str, Any], name: str, kind: type, required: bool = False, default: Any = None) -> Any:
    value = body.get(name)
    if value is None:
        if required:
            raise ApiError(400, f"missing required field {name!r}", param=name)
        return default
    # bool is an int in Python; a JSON true is never a number here
    if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if kind is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if kind not in (int, float) and isinstance(value, kind):
        return value
    raise ApiError(400, f"field {name!r} must be {_type_name(kind)}, got {_json_type(value)}", param=name)


def _type_name(kind: type) -> str:
    return {str: "a string", int: "an integer", float: "a number", bool: "a boolean",
            dict: "an object", list: "an array"}[kind]


def _json_type(value: Any) -> str:
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string",
            list: "an array", dict: "an object"}.get(type(value), type(value).__name__)


def _shown(value: Any) -> str:
    """A client's value as an error message quotes it: a string (cut short), else only its JSON type.

    NOTE: never the repr of an array or object: a JSON value nested ~1000 deep overflows repr's recursion.
    """
    if isinstance(value, str):
        return repr(value if len(value) <= 40 else value[:40] + "...")
    return "null" if value is None else _json_type(value)


def _parse_prompt(body: dict[str, Any]) -> str | list[int]:
    prompt = body.get("prompt")
    if prompt is None:
        raise ApiError(400, "missing required field 'prompt'", param="prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "prompt must not be empty", param="prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    if isinstance(prompt, list) and not prompt:
        raise ApiError(400, "prompt must not be empty", param="prompt")
    if isinstance(prompt, list) and all(isinstance(p, (str, list)) for p in prompt):
        raise ApiError(400, "only one prompt per request is supported", param="prompt")
    raise ApiError(400, "prompt must be a string or an array of token ids", param="prompt")


def _parse_messages(body: dict[str, Any]) -> list[dict[str, str]]:
    messages = body.get("messages")
    if messages is None:
        raise ApiError(400, "missing required field 'messages'", param="messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty array", param="messages")
    out = []
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ApiError(400, f"{param} must be an object", param=param)
        role = message.get("role")
        if role not in ("system", "developer", "user", "assistant"):
            raise ApiError(400, f"{param}.role must be one of system, developer, user, assistant; got {_shown(role)}",
                           param=f"{param}.role")
        out.append({"role": "system" if role == "developer" else role, "content": _content_text(message.get("content"), param)})
    if all(not m["content"] for m in out):
        raise ApiError(400, "messages must not all be empty", param="messages")
    return out


def _content_text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": ...}]
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"{param}.content: only text parts are supported", param=f"{param}.content")
            parts.append(part["text"])
        return "".join(parts)
    raise ApiError(400, f"{param}.content must be a string or an array of text parts", param=f"{param}.content")


def _parse_stop(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, "stop must be a non-empty string or an array of non-empty strings", param="stop")
    if len(stop) > MAX_STOP_SEQUENCES:
        raise ApiError(400, f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed", param="stop")
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise ApiError(400, f"a stop sequence may have at most {MAX_STOP_CHARS} characters", param="stop")
    return stop


# --- responses ----------------------------------------------------------------------------

def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def full_response(req: GenerateRequest, request_id: str, created: int, text: str, finish_reason: str | None,
                  usage_: dict[str, Any], token_ids: list[int]) -> dict[str, Any]:
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
    obj = "text_completion" if req.kind == "completion" else "chat.completion.chunk"
    return {"id": request_id, "object": obj, "created": created, "model": req.model, "choices": [], "usage": usage_}


def models_list(served_model: str, created: int | None = None) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": served_model, "object": "model",
                                         "created": created or int(time.time()), "owned_by": "moonbus"}]}
