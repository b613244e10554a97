"""prefill -> decode: continue a request whose KV has landed on the decode node."""

from __future__ import annotations

from schemas.codec import Subject, Token, Wire
from schemas.route import SamplingParams
from schemas.transfer import KvHandle


class DecodeTask(Wire):
    request_id: Token
    prompt_token_ids: list[int]
    first_token: int  # sampled by prefill, already sent to the gateway
    sampling: SamplingParams
    reply_subject: Subject
    kv: KvHandle  # on the decode instance's node
    arrival_ts: float
    cached_tokens: int = 0  # prompt tokens prefill reused rather than computed
    prefill_s: float = 0.0  # what a late rejection wastes
    attempt: int = 0  # see schemas.route.RouteRequest
    num_generated: int = 0  # completion tokens the client had before this attempt's first token
    key_seed: int = 0  # see schemas.route.RouteRequest
    tenant: str = ""  # see schemas.route.RouteRequest: waiting for KV room, one tenant's does not block another's
