"""workers (and the conductor, for failures) -> gateway: tokens and ends of requests."""

from __future__ import annotations

from typing import Annotated

import msgspec

from schemas.codec import NonNegative, Token, Wire

USAGE_TENANTS_MAX = 4096  # tenants one gateway's usage message may name
# [requests in flight, tokens booked in the last minute], never negative
UsagePair = Annotated[list[NonNegative], msgspec.Meta(min_length=2, max_length=2)]


class TokenChunk(Wire):
    request_id: Token
    index: int  # position of token_ids[0] among the completion's tokens
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" when this chunk ends the request
    error: str = ""  # non-empty: the request failed; error_status says how
    error_status: int = 0  # HTTP-like status: 429 rejected late, 500 internal, 503 instance lost
    cached_tokens: int = 0  # prompt tokens whose KV was reused (sent with the first token)
    source: str = ""  # instance that sent it
    retry_after_s: float = 0.0
    stage: str = ""  # where an error arose: "decode" for a late rejection, "transfer" (KV did not reach decode), "decode_lost"
    wasted_prefill_tokens: int = 0  # a late rejection threw away this much prefill work
    wasted_prefill_s: float = 0.0
    attempt: int = 0  # the attempt that produced it: chunks of an abandoned attempt are dropped
    retryable: bool = False  # an error of the cluster, not of the request: the gateway may resume it elsewhere


class Cancel(Wire):
    """gateway -> every worker (REQUEST_CANCEL): stop working on attempts <= `attempt` of a request."""

    request_id: Token
    attempt: int


class Probe(Wire):
    """gateway -> the instance that should hold an attempt of a request (worker_probe(instance)):
    do you hold it? A decode instance that does sends its tokens from `from_index` again, so a
    chunk lost to a broker outage is recovered; one that does not lets the gateway resume it."""

    request_id: Token
    attempt: int
    from_index: int


class ProbeReply(Wire):
    known: bool
    phase: str = ""  # "queued" | "prefill" | "handed_off" | "decode" | "finished"
    resent: int = 0  # tokens sent again


class TenantUsage(Wire):
    """gateway -> the other gateways (subjects.tenant_usage): what this gateway's tenants hold now,
    so that a tenant's limits hold across every replica (common/decide/tenancy.py)."""

    gateway_id: Token
    tenants: Annotated[dict[str, UsagePair], msgspec.Meta(max_length=USAGE_TENANTS_MAX)] = {}  # tenant -> its usage
