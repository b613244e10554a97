"""The OpenAI-compatible requests: pydantic models, their validation, and errors in OpenAI's shape.

Pure: no I/O. `parse` validates a decoded JSON body with its endpoint's model (strict: no
string is read as a number, no boolean or 2.0 as an integer; null means "not set"; fields the
OpenAI API has and this gateway ignores are allowed) and returns the GenerateRequest the gateway
works with. The first problem found, in the order of FIELD_ORDER, is an ApiError answered as
{"error": {"message", "type", "param", "code"}} with its HTTP status, worded for a person.

What the API can ask for and this server cannot do (logprobs, tool calls, penalties, a logit
bias, a response format other than text, echo, best_of or n above 1, a suffix) is refused with a 400 (code
"unsupported_value") rather than silently ignored; each such field is typed so that the
generated document says which values are accepted (null, or the one that asks for nothing).
The OpenAPI document's request schemas are generated from these models (openapi.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError
from typing_extensions import TypeAliasType

from schemas.route import SamplingParams

COMPLETION_DEFAULT_MAX_TOKENS = 16  # as in the OpenAI API
MAX_STOP_SEQUENCES = 4
MAX_STOP_CHARS = 256  # each stop string
MAX_CACHE_SALT_CHARS = 256
TEMPERATURE_MAX = 2.0
# NOTE: the gateway parses JSON with orjson, which reads integers in [-2**63, 2**64) and turns any
# other integer into a float, which an integer field refuses: that is the real range of `seed`.
JSON_INT_MIN = -(2**63)
JSON_INT_MAX = 2**64 - 1
MAX_USER_CHARS = 256
ROLES = ("system", "developer", "user", "assistant")  # developer is read as system
# the order parse checks fields in: of several problems, the first in this order is answered
FIELD_ORDER = ("model", "prompt", "messages", "n", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
               "stream_options", "seed", "stop", "stream", "ignore_eos", "return_token_ids", "cache_salt",
               "user", "expected_output_tokens", "logprobs", "top_logprobs", "echo", "best_of", "suffix", "logit_bias",
               "presence_penalty", "frequency_penalty", "response_format", "tools", "tool_choice")
# what the OpenAI API can ask for and this server cannot do: refused (400), not ignored
UNSUPPORTED = {
    "logprobs": "logprobs are not supported by this server",
    "top_logprobs": "top_logprobs are not supported by this server (only 0)",
    "echo": "echo is not supported by this server",
    "best_of": "only best_of=1 is supported",
    "suffix": "suffix is not supported by this server",
    "logit_bias": "logit_bias is not supported by this server (only an empty object)",
    "presence_penalty": "presence_penalty is not supported by this server (only 0)",
    "frequency_penalty": "frequency_penalty is not supported by this server (only 0)",
    "response_format": 'only the response_format {"type": "text"} is supported',
    "tools": "tool calls are not supported by this server (tools must be empty)",
    "tool_choice": 'tool calls are not supported by this server (tool_choice may be "none" or "auto")',
}


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

    @property
    def terminal_kind(self) -> str:
        """The request's terminal event when it ends with this error: `rejected` for an overload
        (429: the client may retry), `failed` for anything else."""
        return "rejected" if self.status == 429 else "failed"


def _error_type(status: int) -> str:
    if status == 429:
        return "rate_limit_exceeded"
    if status < 500:
        return "invalid_request_error"
    return "server_error"


def _refuse(message: str, param: str, code: str | None = None) -> PydanticCustomError:
    """A validation problem worded by us: `parse` answers it as it is."""
    return PydanticCustomError("moonbus", "{message}", {"message": message, "param": param, "code": code})


# --- the request models --------------------------------------------------------------------

class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


class StreamOptions(_Strict):
    include_usage: bool | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ResponseFormat(_Strict):
    type: Literal["text"]


class Message(_Strict):
    role: Literal[ROLES]  # type: ignore[valid-type]
    content: str | list[TextPart]


Text = Annotated[str, Field(min_length=1)]
# NOTE: named types are their own entries in the document, where openapi.py writes the served
# model's bounds (the vocabulary, the context) into them
TokenIds = TypeAliasType("TokenIds", Annotated[list[int], Field(min_length=1)])
MaxTokens = TypeAliasType("MaxTokens", Annotated[int, Field(ge=1)])
StopText = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
Zero = Annotated[float, Field(ge=0, le=0)]  # a number only its neutral value is accepted for


def _one_prompt(value: Any) -> Any:
    """A batch of one prompt is that prompt; an empty one, or several, are refused."""
    if value is None:
        raise _refuse("missing required field 'prompt'", "prompt")
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if value == "" or value == []:
        raise _refuse("prompt must not be empty", "prompt")
    if isinstance(value, list) and len(value) > 1 and all(isinstance(p, (str, list)) for p in value):
        raise _refuse("only one prompt per request is supported", "prompt")
    return value


def _stop_list(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


Prompt = Annotated[str | list[int], BeforeValidator(
    _one_prompt, json_schema_input_type=Text | TokenIds | Annotated[list[Text | TokenIds], Field(min_length=1, max_length=1)])]
Stop = Annotated[list[StopText], Field(max_length=MAX_STOP_SEQUENCES), BeforeValidator(
    _stop_list, json_schema_input_type=StopText | Annotated[list[StopText], Field(max_length=MAX_STOP_SEQUENCES)])]


class _Generate(_Strict):
    """What both generation endpoints take. null means 'not set' for each optional field."""

    model: str
    n: Annotated[int, Field(ge=1, le=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=TEMPERATURE_MAX)] | None = Field(
        None, description="Default 1; 0 is greedy.")
    top_p: Annotated[float, Field(gt=0, le=1)] | None = Field(None, description="Default 1.")
    top_k: Annotated[int, Field(ge=-1, le=JSON_INT_MAX)] | None = Field(
        None, description="Extension (as in vLLM): sample among the k most likely tokens only; -1 or 0: all.")
    seed: Annotated[int, Field(ge=JSON_INT_MIN, le=JSON_INT_MAX)] | None = Field(
        None, description="Reproducible across processes: step i is seeded from (seed, i).")
    stop: Stop | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = Field(None, description="Extension (as in vLLM): generate max_tokens even past EOS.")
    return_token_ids: bool | None = Field(
        None, description="Extension (as in vLLM): also return the completion's token ids.")
    cache_salt: Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS)] | None = Field(
        None, description="Extension (as in vLLM): a cache namespace within the caller's tenant, shared by "
                          "that tenant's requests with the same salt, never by another tenant's.")
    user: Annotated[str, Field(max_length=MAX_USER_CHARS)] | None = Field(
        None, description="The end user on whose behalf the request is made (OpenAI's field): recorded in the "
                          "request's `received` event, so an operator can find a request by it in the audit log.")
    expected_output_tokens: Annotated[int, Field(ge=1, le=JSON_INT_MAX)] | None = Field(
        None, description="Extension: how many tokens the client expects the completion to have. A hint for "
                          "admission, which predicts each decode instance's load from every request's remaining "
                          "output (without a hint, from the lengths of recent completions); it limits nothing.")
    # not supported (UNSUPPORTED): accepted only as null or the value that asks for nothing
    logit_bias: Annotated[dict[str, float], Field(max_length=0)] | None = Field(None, description="Not supported.")
    presence_penalty: Zero | None = Field(None, description="Not supported: only 0.")
    frequency_penalty: Zero | None = Field(None, description="Not supported: only 0.")

    @field_validator("model")
    @classmethod
    def _served(cls, model: str, info: ValidationInfo) -> str:
        served = (info.context or {}).get("served_model")
        if served is not None and model != served:
            raise _refuse(f"the model {model!r} does not exist; this server serves {served!r}", "model",
                          "model_not_found")
        return model


_MAX_TOKENS_NOTE = "At most the context less the prompt's tokens (else 400)."


class CompletionRequest(_Generate):
    prompt: Prompt = Field(description="Text or token ids; an array of exactly one of them is a batch of one. "
                                       "The prompt plus max_tokens must fit in the context (else 400).")
    max_tokens: MaxTokens | None = Field(None, description=_MAX_TOKENS_NOTE)
    # not supported (UNSUPPORTED)
    logprobs: None = Field(None, description="Not supported.")
    echo: Literal[False] | None = Field(None, description="Not supported.")
    best_of: Annotated[int, Field(ge=1, le=1)] | None = Field(None, description="Only 1.")
    suffix: None = Field(None, description="Not supported.")


class ChatCompletionRequest(_Generate):
    messages: Annotated[list[Message], Field(min_length=1, json_schema_extra={
        "contains": {"properties": {"content": {"anyOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "contains": {"properties": {"text": {"minLength": 1}}}}]}}}})] = Field(
        description="At least one message has non-empty content.")
    max_tokens: MaxTokens | None = Field(None, description=_MAX_TOKENS_NOTE)
    max_completion_tokens: MaxTokens | None = Field(
        None, description=f"{_MAX_TOKENS_NOTE} Takes precedence over max_tokens when set.")
    # not supported (UNSUPPORTED)
    logprobs: Literal[False] | None = Field(None, description="Not supported.")
    top_logprobs: Annotated[int, Field(ge=0, le=0)] | None = Field(None, description="Not supported: only 0.")
    response_format: ResponseFormat | None = Field(None, description='Only {"type": "text"}.')
    tools: Annotated[list[Any], Field(max_length=0)] | None = Field(None, description="Tool calls are not supported.")
    tool_choice: Literal["none", "auto"] | None = Field(None, description="Tool calls are not supported.")

    @field_validator("messages")
    @classmethod
    def _not_all_empty(cls, messages: list[Message]) -> list[Message]:
        if all(not _content_text(m.content) for m in messages):
            raise _refuse("messages must not all be empty", "messages")
        return messages


REQUEST_MODELS: dict[str, type[_Generate]] = {"completion": CompletionRequest, "chat": ChatCompletionRequest}


# --- what the gateway works with -----------------------------------------------------------

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
    top_k: int = 0  # extension (as in vLLM): the k most likely tokens only (0: no cut)
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False  # extension (as in vLLM): generate max_tokens even past EOS
    return_token_ids: bool = False  # extension (as in vLLM): also return the completion's token ids
    cache_salt: str | None = None  # extension (as in vLLM): a cache namespace within its tenant's
    user: str = ""  # the client's end user (OpenAI's field): in the received event
    expected_output_tokens: int = 0  # extension: the client's hint of its output length (0: none)

    def sampling(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_p, max_tokens, self.seed, self.ignore_eos,
                              min(self.expected_output_tokens, max_tokens), max(self.top_k, 0))


def parse(body: Any, kind: str, served_model: str) -> GenerateRequest:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        req = REQUEST_MODELS[kind].model_validate(body, context={"served_model": served_model})
    except ValidationError as exc:
        raise _api_error(exc) from None
    chat = isinstance(req, ChatCompletionRequest)
    max_tokens = req.max_completion_tokens if chat and req.max_completion_tokens is not None else req.max_tokens
    return GenerateRequest(
        kind=kind,
        model=req.model,
        prompt=None if chat else req.prompt,
        messages=[{"role": "system" if m.role == "developer" else m.role, "content": _content_text(m.content)}
                  for m in req.messages] if chat else None,
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        seed=req.seed,
        stop=req.stop or [],
        stream=bool(req.stream),
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        ignore_eos=bool(req.ignore_eos),
        return_token_ids=bool(req.return_token_ids),
        cache_salt=req.cache_salt,
        user=req.user or "",
        expected_output_tokens=req.expected_output_tokens or 0,
    )


def _content_text(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


# --- pydantic's findings, worded as ours ---------------------------------------------------

_TYPE_NAMES = {"string_type": "a string", "int_type": "an integer", "float_type": "a number",
               "bool_type": "a boolean", "dict_type": "an object", "model_type": "an object",
               "model_attributes_type": "an object", "list_type": "an array"}
_REQUIRED = ("model", "prompt", "messages")


def _api_error(exc: ValidationError) -> ApiError:
    errors = exc.errors(include_url=False)
    first = min(errors, key=lambda e: FIELD_ORDER.index(e["loc"][0]) if e["loc"] and e["loc"][0] in FIELD_ORDER
                else len(FIELD_ORDER))
    message, param, code = _wording(first)
    return ApiError(400, message, param=param, code=code)


def _wording(e: dict[str, Any]) -> tuple[str, str | None, str | None]:
    """(message, param, code) of one pydantic error."""
    if e["type"] == "moonbus":
        return e["ctx"]["message"], e["ctx"]["param"], e["ctx"]["code"]
    loc, kind, value = e["loc"], e["type"], e.get("input")
    name = str(loc[0]) if loc else None
    if name in _REQUIRED and len(loc) == 1 and (kind == "missing" or value is None):
        return f"missing required field {name!r}", name, None
    if name == "prompt":
        return "prompt must be a string or an array of token ids", name, None
    if name == "messages":
        return _message_wording(loc, kind, value)
    if name == "stop":
        return _stop_wording(kind), name, None
    if len(loc) == 1 and kind in _TYPE_NAMES:
        return f"field {name!r} must be {_TYPE_NAMES[kind]}, got {_json_type(value)}", name, None
    if name in UNSUPPORTED:
        return UNSUPPORTED[name], name, "unsupported_value"
    if name in ("max_tokens", "max_completion_tokens"):
        return f"{name} must be at least 1, got {value}", name, None
    if name == "n":
        return "only n=1 is supported", name, "unsupported_value"
    if name == "temperature":
        return f"temperature must be between 0 and {TEMPERATURE_MAX:g}, got {float(value)}", name, None
    if name == "top_p":
        return f"top_p must be in (0, 1], got {float(value)}", name, None
    if name == "cache_salt":
        return f"cache_salt must have 1 to {MAX_CACHE_SALT_CHARS} characters", name, None
    path = ".".join(str(part) for part in loc)
    if kind in _TYPE_NAMES:
        return f"{path} must be {_TYPE_NAMES[kind]}, got {_json_type(value)}", name, None
    return f"{path}: {e['msg']}", name, None


def _message_wording(loc: tuple, kind: str, value: Any) -> tuple[str, str, None]:
    if len(loc) == 1:
        return "messages must be a non-empty array", "messages", None
    param = f"messages[{loc[1]}]"
    if len(loc) == 2:
        return f"{param} must be an object", param, None
    if loc[2] == "role":
        got = "null" if kind == "missing" else _shown(value)
        return f"{param}.role must be one of {', '.join(ROLES)}; got {got}", f"{param}.role", None
    # content: a string or text parts; an error inside the array (len(loc) > 4) is a bad part
    if len(loc) > 4 or (kind != "missing" and isinstance(value, list)):
        return f"{param}.content: only text parts are supported", f"{param}.content", None
    return f"{param}.content must be a string or an array of text parts", f"{param}.content", None


def _stop_wording(kind: str) -> str:
    if kind == "too_long":
        return f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed"
    if kind == "string_too_long":
        return f"a stop sequence may have at most {MAX_STOP_CHARS} characters"
    return "stop must be a non-empty string or an array of non-empty strings"


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
