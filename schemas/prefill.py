"""conductor -> prefill: one prefill task (published on prefill_tasks(instance_id))."""

from __future__ import annotations

from dataclasses import dataclass

from schemas.codec import Wire
from schemas.route import SamplingParams


@dataclass(frozen=True)
class PullSpec(Wire):
    """Blocks the prefill instance fetches from another node before it computes (and keeps)."""

    source_node: str
    first_block: int  # index of the first block to fetch in the prompt's block keys
    num_blocks: int


@dataclass(frozen=True)
class PrefillTask(Wire):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    reply_subject: str
    decode_id: str  # where the KV and the rest of the generation go
    decode_node: str
    arrival_ts: float
    pull: PullSpec | None = None
