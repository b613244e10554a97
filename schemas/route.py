"""gateway -> conductor: ask for a route (NATS request/reply on CONDUCTOR_ROUTE)."""

from __future__ import annotations

from schemas.codec import Subject, Token, Wire


class SamplingParams(Wire):
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    max_tokens: int = 16
    seed: int | None = None
    ignore_eos: bool = False
    expected_tokens: int = 0  # the client's hint of its output length (0: none); decode load is predicted from it
    top_k: int = 0  # sample among the k most likely tokens only (0: no cut)


class RouteRequest(Wire):
    """A request to route, or to route again (a resumed attempt after its instance was lost).

    A resumed attempt's prompt is the original prompt plus the `num_generated` completion tokens
    the client already has; `sampling.max_tokens` is what is left to generate.
    """

    request_id: Token
    prompt_token_ids: list[int]
    sampling: SamplingParams
    reply_subject: Subject  # where workers send TokenChunks for this request
    arrival_ts: float  # wall clock at the gateway, seconds
    attempt: int = 0  # 0, then +1 per migration or re-dispatch; workers tag every chunk with it
    num_generated: int = 0  # completion tokens already delivered (index and sampling step of the next)
    deadline_ts: float = 0.0  # wall clock after which the gateway stopped waiting: do not dispatch (0 = none)
    key_seed: int = 0  # seed of the request's block keys: its cache namespace (0 = the common one)
    avoid: list[Token] = []  # instances its failed attempts used: others first
    tenant: str = ""  # whose request (its API key's tenant; "" = an open gateway): in the routed event


class RouteReply(Wire):
    admitted: bool
    status: int = 200  # 429 rejected at arrival, 503 no instance available
    reason: str = ""
    retry_after_s: float = 0.0
    prefill_id: str = ""
    decode_id: str = ""
    predicted_ttft_s: float = 0.0  # the conductor's prediction of this attempt's prefill end (from its routing)
    senders: list[Token] = []  # every instance that may send this attempt's chunks (its prefill stages, its decode)
