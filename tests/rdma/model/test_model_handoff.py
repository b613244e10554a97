"""Greedy output with the KV handed off over rdma: prefill and decode nodes on rxe0 in the guest,
the conductor, cache index and gateway on the host (tests/integration/test_rdma_vm.py starts them).

    in the guest                                         on the host (reached at 10.0.2.2)
    node-p0: messenger + prefill   --transport rdma      nats-server, conductor, cache index,
    node-d0: messenger + decode    --transport rdma      gateway (MOONBUS_RDMA_GATEWAY_URL)

Each prompt is sent to the host's gateway; its tokens must equal those of transformers' generate()
run on the host in float32, up to a near-tie (tests/greedy.py; MOONBUS_RDMA_EXPECTED: [[prompt,
prompt ids, tokens, margins], ...]; the nodes
run float32 too), and its KV must have gone node-p0 -> node-d0 streamed over rdma (the request's
kv_transferred event). The model is tiny-random, built once on the host into the shared tree
(MOONBUS_RDMA_MODEL_DIR): the same weights on both sides. The four node processes are forked from
one interpreter that imported torch once (tools/rdma_vm/forkserver.py): under emulation each
import of torch takes minutes. The workers import no transformers (common/engine/llama.py).
"""

from __future__ import annotations

import asyncio
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
from tests import greedy

NATS_URL = os.environ.get("MOONBUS_RDMA_MODEL_NATS_URL", "")  # the host cluster's (the transport tests have their own)
TORCH_PATH = os.environ.get("MOONBUS_RDMA_TORCH_PATH", "")  # the host venv's site-packages, for the node processes only
GATEWAY_URL = os.environ.get("MOONBUS_RDMA_GATEWAY_URL", "")
MODEL_DIR = os.environ.get("MOONBUS_RDMA_MODEL_DIR", "")
EXPECTED = json.loads(os.environ.get("MOONBUS_RDMA_EXPECTED", "[]"))
BLOCK_TOKENS = 16
READY_S = 900.0  # one interpreter importing torch under emulation, then four services starting
REQUEST_S = 300.0


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    if not (NATS_URL and GATEWAY_URL and MODEL_DIR and EXPECTED):
        pytest.fail("the host's services and references are not given (MOONBUS_RDMA_MODEL_NATS_URL, _GATEWAY_URL, "
                    "_MODEL_DIR, _EXPECTED)")
    tmp = tmp_path_factory.mktemp("nodes")
    node_flags = ["--transport", "rdma", "--transfer-host", "127.0.0.1", "--dram-bytes", str(64 << 20),  # the guest's /dev/shm is small
                  # under emulation a first prefill can starve its process for longer than the default 5 s
                  "--peer-timeout", "60"]

    def entry(name: str, kind: str, node: str, *args: str) -> dict:
        argv = ["--nats-url", NATS_URL, "--instance-id", name, "--home", str(tmp / "home"), "--node", node,
                "--shm-dir", f"/dev/shm/moonbus-vm/{node}", "--model", MODEL_DIR, "--block-tokens", str(BLOCK_TOKENS),
                "--dtype", "float32", *args]
        if kind in ("messenger", "prefill"):
            argv.append("--insecure")  # KV links inside the guest; the host's open control plane has no secret
        return {"module": f"services.{kind}", "argv": argv, "log": str(tmp / f"{name}.log")}

    spec = [entry("messenger-p0", "messenger", "node-p0", *node_flags, "--ssd-bytes", "0"),
            entry("messenger-d0", "messenger", "node-d0", *node_flags, "--ssd-bytes", "0"),
            entry("prefill-0", "prefill", "node-p0", "--threads", "1", "--transport", "rdma"),
            entry("decode-0", "decode", "node-d0", "--threads", "1", "--admission", "none")]
    (tmp / "spec.json").write_text(json.dumps(spec))
    started = time.monotonic()
    # torch for the node processes alone: on pytest's own path, its plugins would scan the whole venv
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, (os.environ.get("PYTHONPATH", ""), TORCH_PATH)))}
    server = subprocess.Popen([sys.executable, "-m", "tools.rdma_vm.forkserver", str(tmp / "spec.json")], env=env,
                              stdout=open(tmp / "forkserver.log", "wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + READY_S
        while True:
            assert server.poll() is None, f"the fork server exited {server.returncode}; logs: {logs(tmp)}"
            instances = health().get("instances", {})
            if instances.get("prefill", 0) >= 1 and instances.get("decode", 0) >= 1 and instances.get("messenger", 0) >= 2:
                break
            assert time.monotonic() < deadline, f"not ready after {READY_S:.0f} s: {instances}; logs: {logs(tmp)}"
            time.sleep(2)
        print(f"the nodes were ready {time.monotonic() - started:.0f} s after the fork server started")
        yield tmp
    finally:
        if server.poll() is None:
            server.terminate()  # forwarded to the four services, which drain and leave
        try:
            server.wait(120)
        except subprocess.TimeoutExpired:
            server.kill()
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


def complete(prompt: str, max_tokens: int) -> tuple[dict, str]:
    body = {"model": Path(MODEL_DIR).name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    req = urllib.request.Request(f"{GATEWAY_URL}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=REQUEST_S) as resp:
        return json.loads(resp.read()), resp.headers["X-Request-Id"]


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
    request_ids = []
    for prompt, ids, tokens, margins in EXPECTED:
        out, request_id = complete(prompt, len(tokens))
        assert out["usage"]["prompt_tokens"] == len(ids)
        assert not greedy.mismatch(out["choices"][0]["token_ids"], greedy.Greedy(tokens, margins),
                                   greedy.LOGIT_TOL["float32"]), (prompt, out, tokens)
        request_ids.append(request_id)
    events = asyncio.run(transferred(request_ids))
    for rid in request_ids:
        data = events[rid]["data"]
        assert data["transport"] == "rdma" and data["streamed"], data
        assert (data["src_node"], data["dest_node"]) == ("node-p0", "node-d0"), data
        assert data["bytes"] > 0
