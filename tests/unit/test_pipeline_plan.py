"""Chunked pipeline parallelism: which instances share a prompt, and which chunks each computes."""

from __future__ import annotations

from common.decide.policy import ClusterSnapshot, Decision, PrefillCandidate, PullPlan, pipeline_stages
from services.prefill.pipeline import last_stage, my_chunks, num_chunks


def make_decision(prefill_id="p1", prefix_blocks=0, pull=None) -> Decision:
    return Decision("r", "kvcache-centric", prefill_id, "n-" + prefill_id, "d0", "nd", prefix_blocks, pull,
                    1.0, 0.0, 1.0, 0.0, 0.01, 0, None, "", (), ())


def make_snapshot(queues: dict[str, float]) -> ClusterSnapshot:
    return ClusterSnapshot(0.0, tuple(PrefillCandidate(i, "n-" + i, q) for i, q in queues.items()), ())


def test_long_prompt_without_reuse_goes_to_the_chosen_and_least_loaded_instances_in_id_order():
    snapshot = make_snapshot({"p0": 3.0, "p1": 0.0, "p2": 1.0, "p3": 0.5})
    assert pipeline_stages(make_decision("p1"), snapshot, 3, 5000, 1024) == ("p1", "p2", "p3")


def test_no_pipeline_for_short_prompts_reuse_pulls_or_too_few_instances():
    snapshot = make_snapshot({"p0": 0.0, "p1": 0.0})
    assert pipeline_stages(make_decision(), snapshot, 2, 1024, 1024) is None  # one chunk
    assert pipeline_stages(make_decision(prefix_blocks=4), snapshot, 2, 5000, 1024) is None
    assert pipeline_stages(make_decision(pull=PullPlan("n9", 0, 4, 100)), snapshot, 2, 5000, 1024) is None
    assert pipeline_stages(make_decision(), snapshot, 3, 5000, 1024) is None
    assert pipeline_stages(make_decision(), snapshot, 1, 5000, 1024) is None


def test_chunks_alternate_between_stages_and_the_last_one_hands_off():
    assert num_chunks(700, 128) == 6
    assert my_chunks(700, 128, 0, 2) == [(0, 128), (256, 384), (512, 640)]
    assert my_chunks(700, 128, 1, 2) == [(128, 256), (384, 512), (640, 700)]
    assert last_stage(700, 128, 2) == 1 and last_stage(600, 128, 2) == 0 and last_stage(700, 128, 4) == 1
