"""Integration fixtures: a real nats-server on a free port and every service as a real process."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import aiohttp
import pytest
from multidict import CIMultiDict
import torch

from common import models
from tools.moonbus.traces.rows import resolve_trace
from tests import greedy, required
from tools.moonbus.cluster.processes import Cluster, ClusterSpec, free_port, nats_server_binary

TINY = models.TINY_RANDOM
# The KV dtypes a cluster runs in: the dtype-sensitive tests run in both, whatever `--dtype auto`
# picks on this machine (AUTO_DTYPE), so a CPU without bf16 units catches what one with them would
KV_DTYPES = ("float32", "bfloat16")
AUTO_DTYPE = models.resolve_dtype("auto")


def tiny_kv_bytes_per_token(dtype: str) -> int:
    """tiny-random's KV bytes a token in `dtype` (auto resolved): every layer's K and V."""
    from common.kv.blocks import DTYPES

    c = models.TINY_CONFIG
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    return c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * head_dim * DTYPES[models.resolve_dtype(dtype)][0]


def start_cluster(home: Path, model: str = TINY, **kwargs) -> Cluster:
    if model == TINY and kwargs.get("profile"):
        seed_model(Path(kwargs["profile"]).parent, home)
    spec = ClusterSpec(home=home, model=model, port=free_port(kwargs.get("gateways", 1)), nats_port=free_port(), **kwargs)
    cluster = Cluster(spec)
    cluster.start(ready_timeout_s=300)
    return cluster


def bare_nats_server(port: int) -> subprocess.Popen:
    """A real nats-server on the loopback, without JetStream, for tests that need the broker alone;
    returned once it listens. (Clients that first met a refused connection and connected on a
    retry once saw `no responders` for a subscription already flushed: suite14 and a clean-clone
    run, each time right after the refusal.)"""
    server = subprocess.Popen([nats_server_binary(), "-a", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and server.poll() is None:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return server
        time.sleep(0.05)
    raise AssertionError(f"nats-server did not listen on port {port} (exit code {server.poll()})")


@pytest.fixture
async def bare_nats_url():
    """The URL of a bare nats-server (bare_nats_server) of this test's own, killed after it."""
    port = free_port()
    server = bare_nats_server(port)
    try:
        yield f"nats://127.0.0.1:{port}"
    finally:
        server.kill()
        server.wait()


def seed_model(built_in: Path, home: Path) -> None:
    """tiny-random, built once this session (where its profile was measured), linked into a new
    cluster's home: its services find it there instead of building it again (seconds of CPU each)."""
    src, dest = models.resolve(TINY, built_in).path, models.resolve(TINY, home).path
    if (src / "config.json").is_file() and not dest.exists():
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(src, dest, copy_function=os.link)


def conversation_trace(home: Path) -> str:
    """The released conversation trace (kept in the repository: data/traces)."""
    path = resolve_trace("conversation")
    assert path.exists(), f"the conversation trace is missing: {path}"
    return str(path)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory, tiny_profile):
    """1 prefill + 1 decode instance of tiny-random, each on its own node."""
    cluster = start_cluster(tmp_path_factory.mktemp("cluster"), profile=tiny_profile)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def tiny(cluster):
    """The same model in this process, for single-process reference outputs."""
    ref = models.prepare(TINY, cluster.spec.home)
    return models.load_tokenizer(ref), models.load_model(ref, models.resolve_dtype(cluster.spec.dtype))


@pytest.fixture(scope="session")
def tiny_in(cluster):
    """dtype -> (tokenizer, tiny-random in that dtype), for the reference outputs of a cluster
    that runs in a dtype of its own."""
    ref, loaded = models.prepare(TINY, cluster.spec.home), {}

    def load(dtype: str):
        dtype = models.resolve_dtype(dtype)
        if dtype not in loaded:
            loaded[dtype] = models.load_tokenizer(ref), models.load_model(ref, dtype)
        return loaded[dtype]

    return load


def reference_greedy(model, prompt_ids: list[int], max_tokens: int, ignore_eos: bool = False) -> greedy.Greedy:
    """transformers' own greedy decoding, with each step's margin (tests/greedy.py); `ignore_eos`
    as the service's: EOS is a token like any other."""
    return greedy.reference(model, prompt_ids, max_tokens, ignore_eos)


def assert_greedy(got: list[int], model, prompt_ids: list[int], max_tokens: int, ignore_eos: bool = False,
                  what: str = "") -> None:
    """`got` is transformers' greedy output for the prompt, up to a near-tie (tests/greedy.py)."""
    want = reference_greedy(model, prompt_ids, max_tokens, ignore_eos)
    greedy.assert_matches(got, want, str(model.dtype).removeprefix("torch."), what)


async def post(url: str, body: dict | bytes, timeout_s: float = 120, api_key: str = "") -> tuple[int, dict, dict]:
    """POST JSON (with `Authorization: Bearer api_key` when given); returns (status, parsed body,
    headers (case-insensitive))."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        async with session.post(url, data=data, headers=headers) as resp:
            return resp.status, await resp.json(content_type=None), CIMultiDict(resp.headers)


async def stream_events(url: str, body: dict, timeout_s: float = 120) -> list[dict]:
    """POST with stream=true; returns every SSE data payload (the [DONE] marker as {"done": True})."""
    events = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        async with session.post(url, json=body | {"stream": True}) as resp:
            assert resp.status == 200, await resp.text()
            async for line in resp.content:
                line = line.strip()
                if line.startswith(b"data: "):
                    payload = line[6:]
                    events.append({"done": True} if payload == b"[DONE]" else json.loads(payload))
    return events


async def stream_tokens(url: str, body: dict, api_key: str | None = None,
                        on_first_token=None) -> tuple[list[int], str | None]:
    """POST a streamed completion (`body` asks for token ids); (its token ids, its finish reason).
    `on_first_token(event)` is awaited once, at the first chunk with a token, before the rest is read."""
    tokens: list[int] = []
    finish = None
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession() as session:
        async with session.post(url, json=body, headers=headers) as resp:
            assert resp.status == 200, await resp.text()
            async for line in resp.content:
                if not line.startswith(b"data: ") or line[6:].strip() == b"[DONE]":
                    continue
                event = json.loads(line[6:])
                if not event.get("choices"):
                    continue
                choice = event["choices"][0]
                first = not tokens
                tokens += choice.get("token_ids", [])
                finish = choice.get("finish_reason") or finish
                if first and tokens and on_first_token is not None:
                    await on_first_token(event)
    return tokens, finish


def on_docker_engine(needs: str, run) -> None:
    """`run(engine, timings)` on a Docker engine (tools.compose_e2e.engine: this host's, or one started
    for the test and stopped after); the test fails as missing "compose" without one. Prints each
    phase's seconds; where the engine was the test's, the host must be as it found it."""
    from tools.compose_e2e import engine as docker_engine
    from tools.compose_e2e.host import HostState

    timings: dict[str, float] = {}
    started = time.monotonic()
    try:
        engine = docker_engine.acquire()
    except docker_engine.EngineUnavailable as exc:
        required.missing("compose", f"{needs} needs a Docker engine: {exc}")
    timings["engine"] = time.monotonic() - started
    print(f"\nengine: {engine.describe()} ({timings['engine']:.1f} s)")
    try:
        run(engine, timings)
    finally:
        phase = time.monotonic()
        engine.release()  # stops our dockerd by its pid and restores the host (raises if it cannot)
        timings["release"] = time.monotonic() - phase
        timings["total"] = time.monotonic() - started
        print("timings: " + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in timings.items()))
    if engine.ours:
        assert engine.before.differences(HostState.capture_under(engine.before.watched)) == []


async def collect_request_events(nats_url: str, request_id: str, timeout_s: float = 30) -> list[dict]:
    """Read one request's events from the JetStream stream, until its terminal event and a second
    more; in the order they happened (their timestamps). Each service stores its events in order,
    but the stream interleaves services as their events arrive: a worker's report may be stored
    after the gateway's terminal event that it caused."""
    from nats.js.api import ConsumerConfig, DeliverPolicy

    from common import bus
    from schemas import subjects
    from schemas.events import TERMINAL_KINDS

    nc = await bus.connect(nats_url, "test-tap")
    try:
        sub = await nc.jetstream().subscribe(subjects.events_of_request(request_id), ordered_consumer=True,
                                             config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL))
        events = []
        while True:
            msg = await sub.next_msg(timeout=timeout_s)
            events.append(json.loads(msg.data))
            if events[-1]["kind"] in TERMINAL_KINDS:
                with contextlib.suppress(asyncio.TimeoutError):
                    while True:  # what arrives after it (a second end would be a bug: the tests look)
                        events.append(json.loads((await sub.next_msg(timeout=1.0)).data))
                return sorted(events, key=lambda e: e["ts"])
    finally:
        await nc.drain()


@pytest.fixture(scope="session")
def tiny_profile(tmp_path_factory) -> str:
    """One measured profile of tiny-random, shared by every test cluster."""
    import subprocess
    import sys

    home = tmp_path_factory.mktemp("profile")
    out = home / "tiny-random.json"
    subprocess.run([sys.executable, "-m", "tools.moonbus.cli", "profile", "--quick", "--model", TINY,
                    "--home", str(home), "--out", str(out), "--repeats", "1"], check=True, capture_output=True)
    return str(out)


def pytest_collection_finish(session) -> None:
    """The RDMA VM's run takes minutes of emulation: start it in the background as soon as it is
    known to be wanted, so the rest of the suite runs meanwhile (its tests wait for the result)."""
    if any(item.nodeid.startswith("tests/integration/test_rdma_vm.py") for item in session.items):
        from tests.integration import test_rdma_vm

        if test_rdma_vm.why_unusable() is None:
            test_rdma_vm.GuestRun.shared()
