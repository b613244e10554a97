"""compose.yaml end to end: the cluster as containers on a real Docker engine, chat through the gateway.

One test, in the order a person would do it by hand (`make compose-test` runs this file alone):

    engine     the Docker engine that runs, or a dockerd started here (tools/compose_e2e/engine.py)
    images     a base image (public, or debootstrap + import where no registry answers; cached by
               Docker) and the project image from docker/Dockerfile (torch from the local wheel)
    up         `compose up --wait` (emulated for compose v1), then prefill and decode scaled to 2
    secrets    `moonbus compose-secrets` into the test's directory: the cluster key, one NATS
               password per role, nats.conf and a first API key
    requests   concurrent greedy chat requests through the gateway's published port, with the
               API key (and one without, refused with 401): every answer
               equals the single-process reference up to a near-tie (tests/greedy.py,
               the same check the integration tests make of `moonbus up`)
    events     read from the audit stream through NATS's published port, as the read-only
               auditor (a client without credentials is refused): each request's KV went
               from node-a (a prefill container) to node-b (a decode container), and both replicas
               of prefill and of decode served requests (the `routed` events name them)
    down       containers, network and volumes removed; the daemon we started is stopped by its
               pid and the host is back to its snapshot (asserted)

It skips, saying why, where no Docker engine runs and none can be started (no dockerd, not root,
no overlay filesystem), or where no base image can be pulled or built.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common import models
from tests import greedy, required
from tests.integration.conftest import collect_request_events, on_docker_engine, post, reference_greedy
from tools.compose_e2e import engine as docker_engine
from tools.compose_e2e import images
from tools.compose_e2e.compose import Compose
from tools.moonbus.cluster import compose_secrets
from tools.moonbus.cluster.processes import free_port
from tools.moonbus.cluster.security import ClusterSecrets

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILES = [ROOT / "compose.yaml", ROOT / "tools" / "compose_e2e" / "compose.e2e.yaml"]
PROJECT = "moonbus-e2e"
# tiny-random by default (built in each container in a second); MOONBUS_E2E_MODEL=SmolLM2-135M-Instruct
# runs the real model (converted once per run into the moonbus-home volume: slower, readable answers)
MODEL = os.environ.get("MOONBUS_E2E_MODEL", models.TINY_RANDOM)
REPLICAS = {"prefill": 2, "decode": 2}
MAX_TOKENS = 12
QUESTIONS = [
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "How many legs does a spider have?",
    "Write a haiku about the moon.",
    "What is two plus two?",
    "Why is the sky blue?",
    "Tell me a fact about cats.",
    "Spell the word cache backwards.",
]
ROUNDS = 3  # concurrent rounds at most, until both replicas of each role have served


@pytest.mark.timeout(1800)  # a cold run builds a base image and installs torch into an image
def test_compose_cluster_end_to_end(tmp_path: Path) -> None:
    on_docker_engine("compose end to end", lambda engine, timings: run_cluster(engine, tmp_path, timings))


def run_cluster(engine: docker_engine.Engine, tmp_path: Path, timings: dict[str, float]) -> None:
    secrets_dir = tmp_path / "compose-secrets"
    api_key = compose_secrets.prepare(secrets_dir)
    env = {"MOONBUS_MODEL": MODEL, "MOONBUS_GATEWAY_PORT": str(free_port()), "MOONBUS_COMPOSE_SECRETS": str(secrets_dir),
           "MOONBUS_E2E_NATS_PORT": str(free_port()), "MOONBUS_LOG_LEVEL": "INFO"}
    compose = Compose.find(COMPOSE_FILES, PROJECT, ROOT, env)
    if compose is None:
        required.missing("compose", "neither `docker compose` nor `docker-compose` is installed (apt-get install docker-compose)")

    phase = time.monotonic()
    try:
        base = images.ensure_base_image(tmp_path / "base.log")
    except images.BaseImageUnavailable as exc:
        required.missing("compose", str(exc))
    timings["base image"] = time.monotonic() - phase
    built = images.build_project_image(ROOT, base, tmp_path / "build.log", remove_replaced=engine.ours)
    timings["project image"] = built.seconds
    print(f"image {built.tag} on {built.base}: torch from {built.torch_wheel or 'the CPU index'}, "
          f"{built.extra_ca_certs} extra CA certificate file(s), {built.seconds:.1f} s")

    expected = reference_answers(tmp_path / "home")
    compose.down()  # whatever an interrupted run left
    try:
        phase = time.monotonic()
        first = compose.up_wait()
        assert {c.service for c in first} == {"nats", "model-init", "gateway", "conductor", "cache_index",
                                               "messenger-a", "prefill", "messenger-b", "decode"}
        timings["up --wait"] = time.monotonic() - phase
        phase = time.monotonic()
        containers = compose.up_wait(scale=REPLICAS)
        timings["scale to 2+2"] = time.monotonic() - phase
        hostnames = {role: {c.hostname for c in containers if c.service == role} for role in REPLICAS}
        assert {role: len(names) for role, names in hostnames.items()} == REPLICAS, containers

        phase = time.monotonic()
        gateway = f"http://127.0.0.1:{env['MOONBUS_GATEWAY_PORT']}"
        address = f"nats://127.0.0.1:{env['MOONBUS_E2E_NATS_PORT']}"
        asyncio.run(check_doors(gateway, address))
        nats_url = ClusterSecrets(secrets_dir / "secrets").url(address, "auditor")
        asyncio.run(check_requests(gateway, nats_url, api_key, expected, hostnames))
        timings["requests"] = time.monotonic() - phase
        check_audit(nats_url, secrets_dir / "secrets", tmp_path / "auditor")
    except BaseException:
        print(compose.logs(tail=60))
        raise
    finally:
        phase = time.monotonic()
        compose.down()
        timings["down"] = time.monotonic() - phase


def reference_answers(home: Path) -> dict[str, tuple[greedy.Greedy, str]]:
    """question -> (greedy decoding, its text) from the model in this process, as the gateway tokenizes."""
    ref = models.prepare(MODEL, home)
    tokenizer, model = models.load_tokenizer(ref), models.load_model(ref, models.resolve_dtype("auto"))  # as the containers run
    answers = {}
    for question in QUESTIONS:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                               tokenize=True, return_dict=True)["input_ids"]
        want = reference_greedy(model, list(prompt), MAX_TOKENS)
        answers[question] = (want, tokenizer.decode(want.tokens, skip_special_tokens=True))
    return answers


async def check_doors(gateway: str, nats_address: str) -> None:
    """No key: 401 in the OpenAI shape. No NATS credentials: refused."""
    import nats

    status, body, _ = await post(f"{gateway}/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2})
    assert status == 401 and body["error"]["type"], body
    with pytest.raises(Exception) as refused:
        await nats.connect(nats_address, allow_reconnect=False, connect_timeout=5, max_reconnect_attempts=0)
    assert "authorization" in str(refused.value).lower() or "Authorization" in repr(refused.value), refused.value
    print(f"doors: no API key -> {status}; NATS without credentials -> {refused.value!r}")


async def check_requests(gateway: str, nats_url: str, api_key: str, expected: dict[str, tuple[greedy.Greedy, str]],
                         hostnames: dict[str, set[str]]) -> None:
    await wait_for_instances(nats_url, REPLICAS)
    served: dict[str, set[str]] = {role: set() for role in REPLICAS}  # role -> hostnames that served
    for _ in range(ROUNDS):
        bodies = await asyncio.gather(*(chat(gateway, api_key, q) for q in QUESTIONS))
        for question, (body, request_id) in zip(QUESTIONS, bodies):
            choice = body["choices"][0]
            want, text = expected[question]
            assert not greedy.mismatch(choice["token_ids"], want, greedy.LOGIT_TOL[models.resolve_dtype("auto")]), \
                (question, body, want)
            if choice["token_ids"] == want.tokens:  # else they parted at a near-tie: another text, as legitimately
                assert choice["message"]["content"] == text, (question, body)
            print(f"  {question!r} -> {text!r}  ({request_id})")
            events = await collect_request_events(nats_url, request_id)
            kinds = {e["kind"]: e for e in events}
            assert kinds.keys() >= {"routed", "kv_transferred", "completed"}, [e["kind"] for e in events]
            moved = kinds["kv_transferred"]["data"]
            assert (moved["src_node"], moved["dest_node"]) == ("node-a", "node-b"), moved
            route = kinds["routed"]["data"]
            for role, key in (("prefill", "prefill_id"), ("decode", "decode_id")):
                owner = [h for h in hostnames[role] if f"-{h}-" in route[key]]
                assert len(owner) == 1, (route[key], hostnames[role])  # a container of that role
                served[role] |= set(owner)
        if served == hostnames:
            break
    assert served == hostnames, f"requests reached only {served} of {hostnames}"
    print(f"served by prefill containers {sorted(served['prefill'])}, decode containers {sorted(served['decode'])}")


def check_audit(nats_url: str, secrets: Path, home: Path) -> None:
    """`moonbus audit verify` as an operator runs it on the host: every event sealed with the
    cluster secret and signed with its compose service's own key (secrets/signers.json)."""
    out = subprocess.run([sys.executable, "-m", "tools.moonbus.cli", "audit", "verify", "--nats-url", nats_url,
                          "--secret-file", str(secrets / "cluster.key"), "--home", str(home)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    print(f"audit verify: {out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr}")
    assert out.returncode == 0 and "OK: every chain" in out.stdout, out.stdout + out.stderr
    assert "note: no" not in out.stderr  # signers.json was found: signatures were required


async def chat(gateway: str, api_key: str, question: str) -> tuple[dict, str]:
    status, body, headers = await post(f"{gateway}/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": question}], "max_tokens": MAX_TOKENS,
        "temperature": 0, "return_token_ids": True}, api_key=api_key)
    assert status == 200, body
    return body, headers["X-Request-Id"]


async def wait_for_instances(nats_url: str, want: dict[str, int], timeout_s: float = 60) -> None:
    """Until the conductor has announced (instance.joined) `want[role]` instances of each role."""
    import nats.errors
    from nats.js.api import ConsumerConfig, DeliverPolicy

    from common import bus
    from schemas import subjects

    nc = await bus.connect(nats_url, "compose-e2e")
    try:
        sub = await nc.jetstream().subscribe(subjects.instance_event("joined", "*"), ordered_consumer=True,
                                             config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL))
        joined: dict[str, set[str]] = {role: set() for role in want}
        deadline = time.monotonic() + timeout_s
        while any(len(joined[role]) < n for role, n in want.items()):
            try:
                msg = await sub.next_msg(timeout=max(0.1, deadline - time.monotonic()))
            except nats.errors.TimeoutError:
                raise AssertionError(f"after {timeout_s:.0f} s the conductor knows only {joined}") from None
            role = json.loads(msg.data)["data"].get("role")
            if role in joined:  # the subject names the instance (the event's own id is the conductor's)
                joined[role].add(msg.subject.rsplit(".", 1)[-1])
    finally:
        await nc.drain()
