"""gateway -> conductor: ask for a route (NATS request/reply on CONDUCTOR_ROUTE)."""

from __future__ import annotations

from dataclasses import dataclass

from schemas.codec import Wire


@dataclass(frozen=True)
class SamplingParams(Wire):
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    max_tokens: int = 16
    seed: int | None = None
    ignore_eos: bool = False


@dataclass(frozen=True)
class RouteRequest(Wire):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    reply_subject: str  # where workers send TokenChunks for this request
    arrival_ts: float  # wall clock at the gateway, seconds


@dataclass(frozen=True)
class RouteReply(Wire):
    admitted: bool
    status: int = 200  # 429 rejected at arrival, 503 no instance available
    reason: str = ""
    retry_after_s: float = 0.0
    prefill_id: str = ""
    decode_id: str = ""
