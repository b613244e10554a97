"""conductor -> prefill: one prefill task (published on prefill_tasks(instance_id))."""

from __future__ import annotations

from schemas.codec import Subject, Token, Wire
from schemas.route import SamplingParams


class PullSpec(Wire):
    """Blocks the prefill instance fetches from another node before it computes (and keeps)."""

    source_node: Token
    first_block: int  # index of the first block to fetch in the prompt's block keys
    num_blocks: int


class PipelineSpec(Wire):
    """Chunked pipeline parallelism: chunk i of the prompt is computed by stages[i % len(stages)].

    Every stage streams each layer of each chunk it computes to every other stage (addrs: their
    KV stream listeners); the stage that computes the last chunk produces the first token and
    hands the whole KV to decode.
    """

    stages: list[str]  # prefill instance ids, in stage order
    addrs: list[str]  # host:port of each stage's KV stream listener
    chunk_tokens: int

    def last_stage(self, num_tokens: int) -> int:
        """The stage that computes the last chunk: it samples the first token and hands off."""
        return (-(-num_tokens // self.chunk_tokens) - 1) % len(self.stages)


class PrefillTask(Wire):
    request_id: Token
    prompt_token_ids: list[int]
    sampling: SamplingParams
    reply_subject: Subject
    decode_id: Token  # where the KV and the rest of the generation go
    decode_node: Token
    arrival_ts: float
    pull: PullSpec | None = None
    pipeline: PipelineSpec | None = None
    stage: int = 0  # this instance's index in pipeline.stages
    attempt: int = 0  # see RouteRequest
    num_generated: int = 0  # completion tokens the client has: the first token sampled here is number num_generated
    predicted_s: float = 0.0  # the conductor's prediction of this task's work (prefill + transfer)
    key_seed: int = 0  # see schemas.route.RouteRequest
    # wall clock (arrival_ts's) by which its first token is due; a prefill that cannot start in time
    # for it is rejected instead of begun (common.decide.admission.late_start). 0: none
    ttft_deadline_ts: float = 0.0
    tenant: str = ""  # see schemas.route.RouteRequest: the prefill queue serves tenants in turn
