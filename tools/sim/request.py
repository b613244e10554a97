"""A request as the simulator tracks it, and its conversion to a `RequestResult`."""

from __future__ import annotations

from tools.moonbus.traces.measures import OK, RequestResult


class SimRequest:
    """Mutable per-request state; slots keep 12k of them small and fast."""

    __slots__ = ("index", "arrival_s", "input_tokens", "output_tokens", "keys", "status", "error",
                 "prefill", "decode", "decision", "ready_s", "prefill_start_s", "cached_tokens",
                 "first_token_s", "end_s", "join_log", "join_steps", "target_steps", "chunks_left",
                 "runs", "kv_arrival_s", "max_tokens")

    def __init__(self, index: int, arrival_s: float, input_tokens: int, output_tokens: int, keys: list[int],
                 max_tokens: int = 0) -> None:
        self.index = index
        self.arrival_s = arrival_s
        self.input_tokens = input_tokens
        self.output_tokens = output_tokens  # tokens to produce, the first (from prefill) included
        self.max_tokens = max_tokens or output_tokens  # what its client allowed (the conductor sees this, not output_tokens)
        self.keys = keys  # chained block keys, one per trace hash id
        self.status = OK
        self.error = ""
        self.prefill = None  # the PrefillInstance (or coupled instance) chosen
        self.decode = None  # the DecodeBatch owner chosen
        self.decision = None  # policy Decision
        self.ready_s = arrival_s  # when its pulled prefix is in place
        self.prefill_start_s = 0.0  # when its prefill started (or will: a pull may still be landing)
        self.cached_tokens = 0
        self.first_token_s: float | None = None
        self.end_s: float | None = None
        self.join_log = 0  # index into its decode batch's segment log when it joined
        self.join_steps = 0  # the batch's step counter when it joined
        self.target_steps = 0  # step counter value at which its last token is out
        self.chunks_left = 0  # coupled + chunked prefill: prefill chunks still to run
        self.runs: list = []  # inter-token intervals as [seconds, count] runs
        self.kv_arrival_s = 0.0

    def result(self) -> RequestResult:
        from tools.moonbus.traces.measures import tbt_from_runs

        ttft = None if self.first_token_s is None else self.first_token_s - self.arrival_s
        produced = 0
        if self.status == OK:
            produced = self.output_tokens
        elif self.first_token_s is not None:
            produced = 1
        return RequestResult(self.index, self.status, self.arrival_s, self.input_tokens, produced, self.cached_tokens,
                             self.first_token_s, self.end_s, ttft, tbt_from_runs(self.runs) if self.runs else None,
                             self.runs, self.error)
