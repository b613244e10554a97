"""`moonbus swarm autoscale`: the planner's targets on a Docker swarm, through `docker service scale`.

The stack's conductor runs the planner (MOONBUS_PLANNER=1 and its bounds, docs/swarm.md), which
publishes a `planned` event each time a target changes. This driver follows them with the code
`moonbus up --autoscale` follows them with (common.decide.scaling.Follower) and, for each change,
runs

    docker service scale --detach <stack>_prefill=P <stack>_decode=D

A swarm gives a grown service new tasks, and chooses itself which task a shrunk one loses (docker
offers no say in it: not necessarily the instance holding least); the task gets SIGTERM and its
stop_grace_period, in which the worker drains. A task that dies is the swarm's restart policy's:
a planned event for a loss (lost_*) moves no target, and nothing is run for it. A command that
fails (the manager unreachable, say) is tried again every `retry_s` until it succeeds or a newer
decision replaces it.

It needs the docker CLI of a swarm manager and the stack's NATS, as a user that may read the
planned events (the auditor, read-only, is enough). It acts on the decisions made while it runs:
started later, it does nothing until the planner next changes a target.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Callable

from common import bus
from common.config import NatsAuth
from common.decide.scaling import Follower, Targets
from schemas.codec import WireError
from schemas.events import PLANNED_ALL, Event

log = logging.getLogger(__name__)

RETRY_S = 10.0


def scale_command(stack: str, targets: Targets, services: dict[str, str] | None = None) -> list[str]:
    """The docker command that runs `targets` on the stack's prefill and decode services."""
    names = {"prefill": "prefill", "decode": "decode"} | (services or {})
    return ["docker", "service", "scale", "--detach",
            f"{stack}_{names['prefill']}={targets.prefill}", f"{stack}_{names['decode']}={targets.decode}"]


@dataclass
class SwarmScaler:
    """Follows planned events and scales the stack's services (see the module's docstring). `run`
    runs one command and returns (exit code, what it printed): subprocess by default, a fake in tests."""

    stack: str
    run: Callable[[list[str]], tuple[int, str]]
    services: dict[str, str] = field(default_factory=dict)
    retry_s: float = RETRY_S
    follower: Follower = field(default_factory=Follower)
    pending: Targets | None = None  # decided, not yet run (or its command failed)
    tried_at: float = float("-inf")
    ran: list[list[str]] = field(default_factory=list)  # every command run, in order

    def heard(self, event: Event, now: float) -> None:
        targets = self.follower.heard(event)
        if targets is not None:
            log.info("swarm autoscale: the planner asks for %s", targets.describe())
            self.pending, self.tried_at = targets, float("-inf")
            self.tick(now)

    def tick(self, now: float) -> None:
        """Run the pending decision, or try a failed one again once retry_s has passed."""
        if self.pending is None or now - self.tried_at < self.retry_s:
            return
        command = scale_command(self.stack, self.pending, self.services)
        self.tried_at = now
        self.ran.append(command)
        code, output = self.run(command)
        if code == 0:
            log.info("swarm autoscale: ran %s", " ".join(command))
            self.pending = None
        else:
            log.warning("swarm autoscale: %s failed (exit %d): %s; trying again in %g s", " ".join(command), code,
                        output.strip()[-500:], self.retry_s)


def docker_run(command: list[str], timeout_s: float = 60.0) -> tuple[int, str]:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 1, str(exc)
    return done.returncode, done.stdout + done.stderr


async def follow(scaler: SwarmScaler, nats_url: str, auth: NatsAuth | None, stop: asyncio.Event) -> None:
    """Feed the planned events to `scaler` until `stop` (the docker commands run off the event loop)."""
    received: asyncio.Queue[Event] = asyncio.Queue()

    async def on_planned(msg) -> None:
        try:
            received.put_nowait(Event.from_bytes(msg.data))
        except WireError as exc:
            log.warning("swarm autoscale: dropped a malformed event on %s: %s", msg.subject, exc)

    nc = await bus.connect(nats_url, "swarm-autoscale", auth)
    try:
        await bus.subscribe(nc, PLANNED_ALL, on_planned)
        await nc.flush()
        log.info("swarm autoscale: following the planner on %s for stack %s", PLANNED_ALL, scaler.stack)
        while not stop.is_set():
            try:
                event = await asyncio.wait_for(received.get(), timeout=1.0)
            except asyncio.TimeoutError:
                event = None
            if event is not None:
                await asyncio.to_thread(scaler.heard, event, time.monotonic())
            else:
                await asyncio.to_thread(scaler.tick, time.monotonic())
    finally:
        await bus.shutdown(nc)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stack", default="moonbus", help="the stack's name (docker stack deploy ... NAME)")
    parser.add_argument("--nats-url", default=os.environ.get("MOONBUS_NATS_URL", "nats://127.0.0.1:4222"),
                        help="the stack's NATS, as this host reaches it (default: $MOONBUS_NATS_URL)")
    parser.add_argument("--nats-user", default="auditor", help="a user that may read the planned events")
    parser.add_argument("--nats-password-file", default="", help="its password (moonbus compose-secrets wrote them)")
    parser.add_argument("--prefill-service", default="prefill", help="the stack's prefill service")
    parser.add_argument("--decode-service", default="decode", help="the stack's decode service")
    parser.add_argument("--dry-run", action="store_true", help="print each docker command instead of running it")
    parser.add_argument("--retry", type=float, default=RETRY_S, help="seconds before a failed command is tried again")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")

    def dry(command: list[str]) -> tuple[int, str]:
        print(" ".join(command), flush=True)
        return 0, ""

    scaler = SwarmScaler(args.stack, dry if args.dry_run else docker_run,
                         {"prefill": args.prefill_service, "decode": args.decode_service}, args.retry)
    auth = NatsAuth(args.nats_user, args.nats_password_file) if args.nats_password_file else None

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await follow(scaler, args.nats_url, auth, stop)

    try:
        asyncio.run(main())
    except ConnectionError as exc:
        log.error("swarm autoscale: %s", exc)
        return 1
    return 0
