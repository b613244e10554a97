"""`moonbus up --autoscale` on one machine: a load that turns from prefill-heavy to decode-heavy
makes the planner change the split, the supervisor follows it, and no request fails meanwhile.

The cluster is `moonbus up` itself (tiny-random, 1 prefill + 1 decode to start, each role 1..2,
the planner every 2 s with short streaks and cooldowns: a test's settings, not a day's). Clients
stream requests in a closed loop, each sending its next as soon as its last ended (after a 429,
a short pause):

    phase A   prefill-heavy: 4,000-token prompts (random token ids: nothing cached), 8 tokens out.
              One prefill instance is busy all the time and its queue grows: the predicted work
              offered is above its high watermark, so the planner asks for a second (the probe
              that chose these loads saw 1.3-1.5 instances' worth within 6 s)
    phase B   decode-heavy: 16-token prompts, 1,024 tokens out (ignore_eos). Each decode instance
              has room for 16,384 tokens of KV (MOONBUS_KV_CACHE_BYTES, which the decode
              instances read), and the clients' requests reserve about 1.2 times that: one
              instance is full (its KV room above the decode high watermark, arrivals refused for
              "kv room"), two hold about 0.6 each, between the watermarks. So the planner asks
              for a second decode instance, and (prefill's demand now a few percent) gives back
              the second prefill one once its cooldown is over and no arrival is refused

Asserted, on events and never on how fast this machine is (every wait is a hang detector):
the planned events raise prefill in phase A (targets 2 prefill, 1 decode), and in phase B turn
the split to 1 prefill, 2 decode; the supervisor's scaled_up / scaled_down / retired events and
the conductor's joined / left events follow them (nothing lost); /health's instances reach the
targets while the load runs; every request completed (a whole stream, [DONE]) or got a 429,
none failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest

from common import bus
from tests.integration.conftest import TINY, seed_model, tiny_kv_bytes_per_token
from tests.wait import until
from tools.moonbus.cluster.processes import free_port
from tools.moonbus.cluster.security import ClusterSecrets

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
KV_ROOM_TOKENS = 16_384  # per decode instance
PHASES = {  # name -> (clients, prompt tokens, max_tokens)
    "A": (6, 4000, 8),
    "B": (18, 16, 1024),
}
PLANNER = "up_after=2,down_after=3,up_cooldown_s=4,down_cooldown_s=20,lead_s=4,drain_s=10,lost_hold_s=10"
STEP_S = 180  # a hang detector for each step (a new worker loads torch and the model on 2 busy cores)


@dataclass
class Seen:
    """The instance events (planned, scaled_up, ...), each with the phase it came in and when."""

    t0: float = field(default_factory=time.monotonic)
    phase: str = "start"
    events: list[dict] = field(default_factory=list)

    def of(self, kind: str, phase: str | None = None) -> list[dict]:
        return [e for e in self.events if e["kind"] == kind and (phase is None or e["phase"] == phase)]

    def targets(self) -> tuple[int, int] | None:
        planned = self.of("planned")
        return (planned[-1]["data"]["prefill"], planned[-1]["data"]["decode"]) if planned else None


@dataclass
class Load:
    """Closed-loop clients; outcomes by phase: "200" (a whole stream), "429", or what went wrong."""

    url: str
    outcomes: dict[tuple[str, str], int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def count(self, phase: str, outcome: str) -> None:
        self.outcomes[(phase, outcome)] = self.outcomes.get((phase, outcome), 0) + 1

    async def client(self, session: aiohttp.ClientSession, phase: str, stop: asyncio.Event) -> None:
        _, prompt_tokens, max_tokens = PHASES[phase]
        while not stop.is_set():
            body = {"model": TINY, "prompt": [random.randint(3, 250) for _ in range(prompt_tokens)],
                    "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
            try:
                outcome = await self.one(session, body)
            except Exception as exc:  # a connection cut, a timeout: a failure like any other
                outcome = f"{type(exc).__name__}: {exc}"
            self.count(phase, outcome if outcome in ("200", "429") else "failed")
            if outcome not in ("200", "429"):
                self.failures.append(f"phase {phase}: {outcome}")
            if outcome == "429":
                await asyncio.sleep(0.5)

    async def one(self, session: aiohttp.ClientSession, body: dict) -> str:
        async with session.post(f"{self.url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                return str(resp.status) if resp.status == 429 else f"{resp.status}: {(await resp.text())[:300]}"
            last, done = b"", False
            async for line in resp.content:
                line = line.strip()
                if line == b"data: [DONE]":
                    done = True
                elif line.startswith(b"data: "):
                    if b'"error"' in line:
                        return f"error in the stream: {line[:300]!r}"
                    last = line
        finish = json.loads(last[6:])["choices"][0].get("finish_reason") if last else None
        return "200" if done and finish == "length" else f"stream ended without [DONE] or finish (last {last[:200]!r})"


async def health(url: str) -> tuple[int, int]:
    """(prefill, decode) instances as /health counts them (the conductor's view)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        async with session.get(f"{url}/health") as resp:
            instances = (await resp.json()).get("instances", {})
    return instances.get("prefill", 0), instances.get("decode", 0)


@pytest.fixture
def up(tmp_path, tiny_profile):
    home = tmp_path / "up"
    seed_model(Path(tiny_profile).parent, home)
    port = free_port()
    env = os.environ | {"MOONBUS_KV_CACHE_BYTES": str(KV_ROOM_TOKENS * tiny_kv_bytes_per_token("auto"))}
    argv = [sys.executable, "-m", "tools.moonbus.cli", "up", "--model", TINY, "--home", str(home), "--port", str(port),
            "--nats-port", str(free_port()), "--profile", tiny_profile, "--ttft-slo", "5",
            "--autoscale", "--autoscale-prefill", "1:2", "--autoscale-decode", "1:2",
            "--planner-interval", "2", "--planner-settings", PLANNER]
    with open(tmp_path / "up.log", "wb") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        yield home, url, proc
    finally:
        print("\n--- moonbus up's lines about autoscaling ---")
        for line in (tmp_path / "up.log").read_text(errors="replace").splitlines():
            if "autoscale" in line:
                print(line)
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def test_the_split_follows_a_load_that_turns_from_prefill_to_decode(up):
    home, url, proc = up

    async def started() -> bool:
        assert proc.poll() is None, f"moonbus up exited with code {proc.returncode}"
        with contextlib.suppress(OSError, asyncio.TimeoutError, aiohttp.ClientError, ValueError):
            return (home / "cluster.json").exists() and await health(url) == (1, 1)
        return False

    await until(started, "moonbus up --autoscale serves with 1 prefill and 1 decode instance", 300)
    seen, load = Seen(), Load(url)
    nc = await bus.connect(ClusterSecrets(home / "secrets").url(json.loads((home / "cluster.json").read_text())
                                                                ["nats_url"], "admin"), "test-autoscale")

    async def on_event(msg) -> None:
        event = json.loads(msg.data)  # the instance it is about is the subject's last token (its publisher may differ)
        seen.events.append({"kind": event["kind"], "instance": msg.subject.split(".", 4)[4], "data": event["data"],
                            "phase": seen.phase, "t": round(time.monotonic() - seen.t0, 1)})

    await nc.subscribe("moonbus.events.instance.>", cb=on_event)
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300))
    clients: list[asyncio.Task] = []
    try:
        # phase A: prefill-heavy; the planner asks for a second prefill instance, which starts and joins
        seen.phase, stop_a = "A", asyncio.Event()
        clients += [asyncio.create_task(load.client(session, "A", stop_a)) for _ in range(PHASES["A"][0])]
        await until(lambda: any(e["data"]["prefill"] > e["data"]["previous_prefill"] for e in seen.of("planned", "A")),
                    "the planner raises prefill under the prefill-heavy load", STEP_S)
        await until(lambda: [e for e in seen.of("joined") if e["instance"] in
                             {s["instance"] for s in seen.of("scaled_up") if s["data"]["role"] == "prefill"}],
                    "the prefill instance the supervisor started joins", STEP_S)
        before_b = seen.targets()

        # phase B: decode-heavy; the planner raises decode and gives the second prefill instance back
        seen.phase, stop_b = "B", asyncio.Event()
        stop_a.set()
        clients += [asyncio.create_task(load.client(session, "B", stop_b)) for _ in range(PHASES["B"][0])]
        await until(lambda: seen.targets() == (1, 2), f"the planner turns the split from {before_b} to 1 prefill "
                    "and 2 decode instances", STEP_S)

        async def followed() -> tuple[tuple[int, int], tuple[int, int]] | None:
            targets = seen.targets()
            with contextlib.suppress(OSError, asyncio.TimeoutError, aiohttp.ClientError, ValueError):
                instances = await health(url)
                return (targets, instances) if instances == targets else None
            return None

        after_b, health_b = await until(followed, "/health's instances reach the planner's latest targets", STEP_S)
        seen.phase = "end"  # the clients finish what they sent, and send nothing more
        stop_b.set()
        await asyncio.wait_for(asyncio.gather(*clients), 300)  # a hang detector
    finally:
        for client in clients:  # after a failed wait: the requests in flight are the test's to cut, no failure
            client.cancel()
        await asyncio.gather(*clients, return_exceptions=True)
        await session.close()
        await asyncio.sleep(1)  # the last events
        await nc.drain()
        print_timeline(seen, load)

    # every request completed whole or was refused early: none failed, in either phase
    assert load.failures == [], load.failures[:10]
    assert load.outcomes.get(("A", "200"), 0) > 0 and load.outcomes.get(("B", "200"), 0) > 0, load.outcomes
    # the split turned from prefill to decode, and the instances followed the planner's targets
    assert (before_b, after_b, health_b) == ((2, 1), (1, 2), (1, 2))
    # what the supervisor did: a prefill instance started in phase A; in phase B a decode instance
    # started and a prefill instance drained, then retired with its messenger; none of them lost
    assert [e["data"]["role"] for e in seen.of("scaled_up", "A")] == ["prefill"], seen.of("scaled_up")
    assert [e["data"]["role"] for e in seen.of("scaled_up", "B")] == ["decode"], seen.of("scaled_up")
    [drained] = [e["instance"] for e in seen.of("scaled_down", "B") if e["data"]["role"] == "prefill"]
    assert {drained, f"messenger-p{drained.rsplit('-', 1)[1]}"} <= {e["instance"] for e in seen.of("retired")}
    assert drained in {e["instance"] for e in seen.of("left")}
    assert not seen.of("lost"), seen.of("lost")


def print_timeline(seen: Seen, load: Load) -> None:
    print("\n--- the planner's targets and the supervisor's steps (seconds since the load began) ---")
    for e in seen.events:
        d = e["data"]
        if e["kind"] == "planned":
            print(f"{e['t']:7.1f} {e['phase']} planned prefill {d['previous_prefill']}->{d['prefill']} decode "
                  f"{d['previous_decode']}->{d['decode']} (demand {d['demand_prefill']:.2f} / {d['demand_decode']:.2f}, "
                  f"attainment {d['attainment']}): {'; '.join(d['reasons'])}")
        elif e["kind"] in ("scaled_up", "scaled_down", "retired", "joined", "left", "lost"):
            print(f"{e['t']:7.1f} {e['phase']} {e['kind']} {e['instance']} {json.dumps(d, sort_keys=True)}")
    print(f"outcomes by phase: {dict(sorted(load.outcomes.items()))}")
    for failure in load.failures[:10]:
        print(f"failed: {failure}")
