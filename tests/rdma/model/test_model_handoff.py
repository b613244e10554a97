"""Greedy output with the KV handed off over rdma: prefill and decode nodes on rxe0 in the guest,
the conductor, cache index and gateway on the host (tests/integration/test_rdma_vm.py starts them).

    in the guest                                         on the host (reached at 10.0.2.2)
    node-p0: messenger + prefill   --transport rdma      nats-server, conductor, cache index,
    node-d0: messenger + decode    --transport rdma      gateway (MOONBUS_RDMA_GATEWAY_URL)

Each prompt is sent to the host's gateway; its tokens must equal transformers' generate() run here,
on the same (emulated) CPU, and its KV must have gone node-p0 -> node-d0 streamed over rdma (the
request's kv_transferred event). The model is tiny-random, built once on the host into the shared
tree (MOONBUS_RDMA_MODEL_DIR): the same weights on both sides.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from nats.js.api import ConsumerConfig, DeliverPolicy

from common import bus
from schemas import subjects

NATS_URL = os.environ.get("MOONBUS_RDMA_NATS_URL", "")
GATEWAY_URL = os.environ.get("MOONBUS_RDMA_GATEWAY_URL", "")
MODEL_DIR = os.environ.get("MOONBUS_RDMA_MODEL_DIR", "")
BLOCK_TOKENS = 16
READY_S = 900.0  # two processes importing torch under emulation, side by side: about 5 minutes
REQUEST_S = 300.0
PROMPTS = ["The quick brown fox jumps over the lazy dog. " * 6, "Soft-RoCE moves bytes one-sidedly. " * 9]
MAX_TOKENS = 8


def start(tmp: Path, name: str, kind: str, node: str, *args: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", f"services.{kind}", "--nats-url", NATS_URL, "--instance-id", name,
            "--home", str(tmp / "home"), "--node", node, "--shm-dir", f"/dev/shm/moonbus-vm/{node}",
            "--model", MODEL_DIR, "--block-tokens", str(BLOCK_TOKENS), *args]
    log = open(tmp / f"{name}.log", "wb")
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    if not (NATS_URL and GATEWAY_URL and MODEL_DIR):
        pytest.skip("the host's services are not given (MOONBUS_RDMA_NATS_URL, _GATEWAY_URL, _MODEL_DIR)")
    tmp = tmp_path_factory.mktemp("nodes")
    node_flags = ["--transport", "rdma", "--transfer-host", "127.0.0.1", "--dram-bytes", str(64 << 20)]  # the guest's /dev/shm is small
    procs = {
        "messenger-p0": start(tmp, "messenger-p0", "messenger", "node-p0", *node_flags, "--ssd-bytes", "0"),
        "messenger-d0": start(tmp, "messenger-d0", "messenger", "node-d0", *node_flags, "--ssd-bytes", "0"),
        "prefill-0": start(tmp, "prefill-0", "prefill", "node-p0", "--threads", "1", "--transport", "rdma"),
        "decode-0": start(tmp, "decode-0", "decode", "node-d0", "--threads", "1", "--admission", "none"),
    }
    try:
        deadline = time.monotonic() + READY_S
        while True:
            dead = {name: p.returncode for name, p in procs.items() if p.poll() is not None}
            assert not dead, f"exited: {dead}; logs: {logs(tmp)}"
            instances = health().get("instances", {})
            if instances.get("prefill", 0) >= 1 and instances.get("decode", 0) >= 1 and instances.get("messenger", 0) >= 2:
                break
            assert time.monotonic() < deadline, f"not ready after {READY_S:.0f} s: {instances}; logs: {logs(tmp)}"
            time.sleep(2)
        yield tmp
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.terminate()  # our own children, by pid
        for p in procs.values():
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
        print(logs(tmp))


def health() -> dict:
    try:
        with urllib.request.urlopen(f"{GATEWAY_URL}/health", timeout=5) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return json.loads(err.read() or b"{}")
    except (OSError, ValueError):
        return {}


def logs(tmp: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(tmp.glob("*.log")))


def complete(prompt: str) -> tuple[dict, str]:
    body = {"model": Path(MODEL_DIR).name, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    req = urllib.request.Request(f"{GATEWAY_URL}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=REQUEST_S) as resp:
        return json.loads(resp.read()), resp.headers["X-Request-Id"]


def reference(prompts: list[str]) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy tokens) of transformers' generate() in this process, EOS taken as a token."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    config = copy.deepcopy(model.generation_config)
    config.max_new_tokens, config.do_sample, config.eos_token_id = MAX_TOKENS, False, []
    out = []
    for prompt in prompts:
        ids = tokenizer(prompt)["input_ids"]
        with torch.inference_mode():
            tokens = model.generate(torch.tensor([ids]), generation_config=config,
                                    attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        out.append((ids, tokens[0, len(ids):].tolist()))
    return out


async def transferred(request_ids: list[str]) -> dict[str, dict]:
    """Each request's kv_transferred event, from the stream on the host."""
    nc = await bus.connect(NATS_URL, "rdma-model-test")
    try:
        js = nc.jetstream()
        found = {}
        for rid in request_ids:
            sub = await js.subscribe(subjects.request_event("kv_transferred", rid), ordered_consumer=True,
                                     config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL))
            try:
                msg = await sub.next_msg(timeout=30)
                found[rid] = json.loads(msg.data)
            finally:
                await sub.unsubscribe()
        return found
    finally:
        await nc.drain()


def test_greedy_output_with_the_kv_handed_off_over_rdma_equals_generate(nodes):
    expected = reference(PROMPTS)
    request_ids = []
    for prompt, (ids, tokens) in zip(PROMPTS, expected):
        out, request_id = complete(prompt)
        assert out["usage"]["prompt_tokens"] == len(ids)
        assert out["choices"][0]["token_ids"] == tokens, (prompt, out)
        request_ids.append(request_id)
    events = asyncio.run(transferred(request_ids))
    for rid in request_ids:
        data = events[rid]["data"]
        assert data["transport"] == "rdma" and data["streamed"], data
        assert (data["src_node"], data["dest_node"]) == ("node-p0", "node-d0"), data
        assert data["bytes"] > 0
