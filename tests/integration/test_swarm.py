"""The stack on a one-node Docker swarm: scale decode up and down and roll it, under load.

One test (`make swarm-test` runs this file alone), in the order an operator would:

    engine     the Docker engine that runs, or a dockerd started here (tools/compose_e2e/engine.py)
    images     the project image (docker/Dockerfile, as the compose test builds it), and a second
               tag of it for the rolling update
    swarm      `docker swarm init --advertise-addr 127.0.0.1` (where the engine is in none), the
               node labelled for NATS and both KV nodes (their messenger and workers on one host)
    stack      derived from compose.yaml + tools/compose_e2e/compose.e2e.yaml (tools/swarm/stack.py),
               the secrets of `moonbus compose-secrets` as swarm secrets; `docker stack deploy`,
               then every service's replicas healthy
    load       a few clients in a loop through the gateway's published port, all along
    scale up   the swarm driver (`moonbus swarm autoscale`, tools/swarm/autoscale.py) given the
               planner's decision 1 prefill + 2 decode runs `docker service scale`: a new decode
               instance joins and takes work
    roll       `docker service update --image <the second tag> --force <stack>_decode`: one
               instance at a time (at no moment were both decode instances gone), each old one left
               (drained, not lost), each new one took work
    scale down `docker service scale <stack>_decode=1`: the removed instance left, drained
    verdict    every request completed (200) or was refused (429); each request the gateway
               answered has exactly one terminal event and ran once (one decode_finished at most);
               `moonbus audit verify` finds every chain intact and signed
    down       stack removed (services, secrets, network, volumes), the second tag removed, the
               swarm left, the daemon we started stopped and the host back to its snapshot (asserted)

It skips, saying why, where no Docker engine runs and none can be started (the "compose"
component of tests/required.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest

from common import models
from tests import required
from tests.integration.conftest import on_docker_engine
from tests.unit.test_swarm_autoscale import make_planned
from tests.wait import until
from tools.compose_e2e import engine as docker_engine
from tools.compose_e2e import images
from tools.compose_e2e.swarm import Stack, Swarm, docker
from tools.moonbus.cluster import compose_secrets
from tools.moonbus.cluster.processes import free_port
from tools.moonbus.cluster.security import ClusterSecrets
from tools.swarm import stack as stack_tool
from tools.swarm.autoscale import SwarmScaler, docker_run

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILES = [ROOT / "compose.yaml", ROOT / "tools" / "compose_e2e" / "compose.e2e.yaml"]
STACK = "moonbus-swarm-e2e"  # not compose's moonbus-e2e: their volumes would share names
ROLL_IMAGE = "moonbus:swarm-e2e-roll"  # the same image under a second tag: `--image` changes, the code does not
LABELS = {"moonbus.nats": "true", "moonbus.node-a": "true", "moonbus.node-b": "true"}
MODEL = os.environ.get("MOONBUS_E2E_MODEL", models.TINY_RANDOM)
CLIENTS = 3  # requests in flight at once, each client one after another
MAX_TOKENS = 8
CONVERGE_S = 600  # a hang detector: the first start converts the model and loads torch in every container
STEP_S = 300  # one scale or roll step (a worker drains for up to 30 s)


@pytest.mark.timeout(2400)  # a cold run builds a base image and installs torch into an image
def test_swarm_scale_and_roll_under_load(tmp_path: Path) -> None:
    on_docker_engine("the swarm test", lambda engine, timings: run_swarm(engine, tmp_path, timings))


def run_swarm(engine: docker_engine.Engine, tmp_path: Path, timings: dict[str, float]) -> None:
    phase = time.monotonic()
    try:
        base = images.ensure_base_image(tmp_path / "base.log")
    except images.BaseImageUnavailable as exc:
        required.missing("compose", str(exc))
    built = images.build_project_image(ROOT, base, tmp_path / "build.log", remove_replaced=engine.ours)
    timings["images"] = time.monotonic() - phase
    print(f"image {built.tag} on {built.base}: {built.seconds:.1f} s")

    secrets_dir = tmp_path / "compose-secrets"
    api_key = compose_secrets.prepare(secrets_dir)
    gateway_port, nats_port = free_port(), free_port()
    env = os.environ | {"MOONBUS_MODEL": MODEL, "MOONBUS_GATEWAY_PORT": str(gateway_port), "MOONBUS_LOG_LEVEL": "INFO",
                        "MOONBUS_COMPOSE_SECRETS": str(secrets_dir), "MOONBUS_E2E_NATS_PORT": str(nats_port),
                        "MOONBUS_SWARM_WORKER_CPUS": str(min(2, os.cpu_count() or 1))}
    derived, notes = stack_tool.derive(stack_tool.load(COMPOSE_FILES, env), ROOT)
    stack_file = tmp_path / "stack.yaml"
    stack_file.write_text(stack_tool.render(derived, COMPOSE_FILES))
    for note in notes:
        print(f"stack: {note}")

    swarm = Swarm.join()
    stack = Stack(STACK)
    try:
        swarm.label(LABELS)
        docker("tag", images.PROJECT_IMAGE, ROLL_IMAGE)
        stack.remove()  # whatever an interrupted run left
        phase = time.monotonic()
        stack.deploy(stack_file)
        stack.wait_converged(CONVERGE_S)
        timings["deploy"] = time.monotonic() - phase
        print(f"swarm {'made here' if swarm.made_here else 'found'}, node {swarm.node_id}; stack {STACK} up in "
              f"{timings['deploy']:.1f} s")
        gateway = f"http://127.0.0.1:{gateway_port}"
        nats_url = ClusterSecrets(secrets_dir / "secrets").url(f"nats://127.0.0.1:{nats_port}", "auditor")
        phase = time.monotonic()
        asyncio.run(scale_and_roll(stack, gateway, nats_url, api_key, timings))
        timings["under load"] = time.monotonic() - phase
        check_audit(nats_url, secrets_dir / "secrets", tmp_path / "auditor")
    except BaseException:
        for service in ("gateway", "conductor", "decode", "prefill"):
            print(f"--- {service}\n{stack.logs(service, tail=40)}")
        raise
    finally:
        phase = time.monotonic()
        try:
            stack.remove()
            docker("rmi", ROLL_IMAGE, check=False)  # the tag only: the image is moonbus:latest's
        finally:
            swarm.leave()
        timings["down"] = time.monotonic() - phase
    assert not docker("secret", "ls", "-q", "--filter", f"label=com.docker.stack.namespace={STACK}", check=False).strip()


# --- the load ------------------------------------------------------------------------------------

@dataclass
class Result:
    status: int
    request_id: str
    body: dict


@dataclass
class Load:
    """CLIENTS clients, each sending one chat request after another until stopped."""

    gateway: str
    api_key: str
    results: list[Result] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: list[asyncio.Task] = field(default_factory=list)

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self.client(i)) for i in range(CLIENTS)]

    async def client(self, index: int) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300), headers=headers) as session:
            n = 0
            while not self.stop.is_set():
                n += 1
                body = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0,
                        "messages": [{"role": "user", "content": f"client {index} asks question {n}: count to ten"}]}
                async with session.post(f"{self.gateway}/v1/chat/completions", json=body) as resp:
                    payload = await resp.json(content_type=None)
                    self.results.append(Result(resp.status, resp.headers.get("X-Request-Id", ""), payload))
                    if resp.status == 429:
                        await asyncio.sleep(float(resp.headers.get("Retry-After", "0.5")))

    def completed(self) -> int:
        return sum(r.status == 200 for r in self.results)

    async def finish(self) -> None:
        self.stop.set()
        await asyncio.gather(*self.tasks)


# --- the events ------------------------------------------------------------------------------------

@dataclass
class Events:
    """The audit stream (moonbus.events.>) from its start, read as it grows."""

    nats_url: str
    events: list[dict] = field(default_factory=list)
    last_at: float = field(default_factory=time.monotonic)  # when the last event came

    async def __aenter__(self) -> "Events":
        from nats.js.api import ConsumerConfig, DeliverPolicy

        from common import bus
        from schemas import subjects

        self.nc = await bus.connect(self.nats_url, "swarm-e2e")
        self.sub = await self.nc.jetstream().subscribe(subjects.EVENTS_ALL, ordered_consumer=True,
                                                       config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL))
        self.reader = asyncio.create_task(self.read())
        return self

    async def read(self) -> None:
        while True:
            msg = await self.sub.next_msg(timeout=None)
            self.events.append(json.loads(msg.data) | {"subject": msg.subject})
            self.last_at = time.monotonic()

    def reading(self) -> None:
        """Raise what stopped the reader, if it stopped: a condition on the events would never come."""
        if self.reader.done():
            raise AssertionError(f"the events reader stopped: {self.reader.exception()!r}")

    def quiet(self, seconds: float = 2.0) -> bool:
        """No event for `seconds`: whatever the requests caused has been told."""
        self.reading()
        return time.monotonic() - self.last_at >= seconds

    async def __aexit__(self, *exc) -> None:
        self.reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self.reader
        await self.nc.drain()

    def instances(self, kind: str, role: str, since: int = 0) -> list[tuple[int, str]]:
        """(index in the stream read, instance id) of each instance event of `kind` for `role`."""
        self.reading()
        return [(i, e["subject"].rsplit(".", 1)[-1]) for i, e in enumerate(self.events[since:], since)
                if e["subject"].startswith(f"moonbus.events.instance.{kind}.") and e["data"].get("role") == role]

    def live(self, role: str) -> set[str]:
        """The instances of `role` the conductor counts in now (joined, and neither left nor lost)."""
        return self.live_counts(role)[-1][1]

    def live_counts(self, role: str) -> list[tuple[int, set[str]]]:
        """(index, the instances of `role` counted in after it) at each instance event of `role`, from
        the stream's start (index -1: none)."""
        self.reading()
        alive: set[str] = set()
        out = [(-1, set())]
        for i, e in enumerate(self.events):
            kind, _, instance = e["subject"].removeprefix("moonbus.events.instance.").partition(".")
            if e["subject"].startswith("moonbus.events.instance.") and e["data"].get("role") == role:
                if kind == "joined":
                    alive.add(instance)
                elif kind in ("left", "lost"):
                    alive.discard(instance)
                out.append((i, set(alive)))
        return out

    def routed_to(self, decode_id: str) -> list[dict]:
        self.reading()
        return [e for e in self.events if e["kind"] == "routed" and e["data"].get("decode_id") == decode_id]

    def of_requests(self) -> dict[str, list[dict]]:
        out: dict[str, list[dict]] = {}
        for e in self.events:
            if e.get("request_id"):
                out.setdefault(e["request_id"], []).append(e)
        return out


async def scale_and_roll(stack: Stack, gateway: str, nats_url: str, api_key: str, timings: dict[str, float]) -> None:
    from schemas.events import TERMINAL_KINDS

    async with Events(nats_url) as events:
        await until(lambda: events.live("decode") and events.live("prefill"), "the conductor counts a prefill and a decode in",
                    timeout_s=CONVERGE_S)
        load = Load(gateway, api_key)
        load.start()
        try:
            await until(lambda: load.completed() >= 2 * CLIENTS, "the load's first requests completed", timeout_s=STEP_S)

            # scale up, by the swarm driver on a planned decision: a second decode instance joins and takes work
            phase = time.monotonic()
            first = events.live("decode")
            mark = len(events.events)
            driver = SwarmScaler(stack.name, docker_run)
            await asyncio.to_thread(driver.heard, make_planned(1, 2, time.time()), time.monotonic())
            assert driver.ran == [["docker", "service", "scale", "--detach", f"{stack.name}_prefill=1",
                                   f"{stack.name}_decode=2"]] and driver.pending is None, driver.ran
            joined = await until(lambda: [j for j in events.instances("joined", "decode", mark) if j[1] not in first],
                                 "a second decode instance joined", timeout_s=STEP_S)
            (joined_at, new), joined_ts = joined[0], events.events[joined[0][0]]["ts"]
            await until(lambda: events.routed_to(new), f"the new decode instance {new} took work", timeout_s=STEP_S)
            taken = events.routed_to(new)[0]
            routes_between = sum(e["kind"] == "routed" for e in events.events[joined_at:]
                                 if e["ts"] <= taken["ts"]) - 1
            await asyncio.to_thread(stack.wait_converged, STEP_S)
            timings["scale 1->2"] = time.monotonic() - phase
            print(f"scale 1->2: {new} joined, took its first request {taken['ts'] - joined_ts:.2f} s later "
                  f"({routes_between} routed to others in between); converged in {timings['scale 1->2']:.1f} s")

            # roll: one instance at a time, each old one drained, each new one working
            phase = time.monotonic()
            before = events.live("decode")
            assert len(before) == 2, before
            mark = len(events.events)
            await asyncio.to_thread(stack.roll, "decode", ROLL_IMAGE)
            await until(lambda: asyncio.to_thread(stack.update_state, "decode"),
                        "the rolling update of decode started", timeout_s=STEP_S)
            await until(lambda: _update_done(stack), "the rolling update of decode completed", timeout_s=2 * STEP_S)
            await asyncio.to_thread(stack.wait_converged, STEP_S)
            running = await asyncio.to_thread(stack.running, "decode")
            assert sorted(t.image for t in running) == [ROLL_IMAGE, ROLL_IMAGE], running
            rolled_in = {i for _, i in events.instances("joined", "decode", mark)}
            await until(lambda: len(events.live("decode") & rolled_in) == 2, "both rolled decode instances counted in",
                        timeout_s=STEP_S)
            left = {i for _, i in events.instances("left", "decode", mark)}
            lost = {i for _, i in events.instances("lost", "decode", mark)}
            assert before <= left and not lost & before, (before, left, lost)  # drained, not lost
            counts = events.live_counts("decode")
            at_mark = [alive for i, alive in counts if i < mark][-1]
            fewest = min(len(alive) for alive in [at_mark, *(alive for i, alive in counts if i >= mark)])
            assert fewest >= 1, "both decode instances were gone at once during the roll"
            for instance in rolled_in:
                await until(lambda: events.routed_to(instance), f"the rolled decode instance {instance} took work",
                            timeout_s=STEP_S)
            timings["roll"] = time.monotonic() - phase
            print(f"roll: {sorted(before)} left, {sorted(rolled_in)} joined, never fewer than {fewest} decode instance(s); "
                  f"{timings['roll']:.1f} s")

            # scale down: the removed instance drains and leaves
            phase = time.monotonic()
            before = events.live("decode")
            mark = len(events.events)
            await asyncio.to_thread(stack.scale, "decode", 1)
            await asyncio.to_thread(stack.wait_converged, STEP_S)
            await until(lambda: len(events.live("decode")) == 1, "one decode instance left", timeout_s=STEP_S)
            gone = before - events.live("decode")
            assert gone and gone <= {i for _, i in events.instances("left", "decode", mark)}, (gone, events.live("decode"))
            done = load.completed()
            await until(lambda: load.completed() >= done + 2 * CLIENTS, "the load goes on with one decode instance",
                        timeout_s=STEP_S)
            timings["scale 2->1"] = time.monotonic() - phase
            print(f"scale 2->1: {sorted(gone)} drained and left; {timings['scale 2->1']:.1f} s")
        finally:
            await load.finish()

        # the verdict: completed or refused, each once
        statuses: dict[int, int] = {}
        for r in load.results:
            statuses[r.status] = statuses.get(r.status, 0) + 1
        print(f"load: {len(load.results)} requests, by status {statuses}")
        bad = [(r.status, r.request_id, r.body) for r in load.results if r.status not in (200, 429)]
        assert not bad, bad[:5]
        ids = [r.request_id for r in load.results]
        assert all(ids) and len(set(ids)) == len(ids), "each answer names a request of its own"
        for r in load.results:
            if r.status == 200:
                assert r.body["usage"]["completion_tokens"] >= 1, r.body
        await until(lambda: all(any(e["kind"] in TERMINAL_KINDS for e in events.of_requests().get(i, [])) for i in ids),
                    "every request's terminal event is in the stream")
        await until(events.quiet, "the stream is quiet")
        by_request = events.of_requests()
        twice = {}
        for r in load.results:
            mine = by_request[r.request_id]
            terminal = [e["kind"] for e in mine if e["kind"] in TERMINAL_KINDS]
            finished = [e for e in mine if e["kind"] == "decode_finished"]
            want = "completed" if r.status == 200 else "rejected"
            if terminal != [want] or len(finished) > 1:
                twice[r.request_id] = (r.status, terminal, len(finished))
        assert not twice, f"requests that did not end exactly once: {dict(list(twice.items())[:5])}"


async def _update_done(stack: Stack) -> bool:
    state = await asyncio.to_thread(stack.update_state, "decode")
    assert state not in ("paused", "rollback_started", "rollback_paused", "rollback_completed"), \
        f"the rolling update of decode went wrong: {state}"
    return state == "completed"


def check_audit(nats_url: str, secrets: Path, home: Path) -> None:
    """`moonbus audit verify` as an operator runs it: every event sealed with the cluster secret and
    signed with its compose service's own key (secrets/signers.json); each completed request told by
    every service that took part."""
    out = subprocess.run([sys.executable, "-m", "tools.moonbus.cli", "audit", "verify", "--nats-url", nats_url,
                          "--secret-file", str(secrets / "cluster.key"), "--home", str(home)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    print(f"audit verify: {out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr}")
    assert out.returncode == 0 and "OK: every chain" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
    assert "note: no" not in out.stderr  # signers.json was found: signatures were required
