"""`moonbus tap`: print the event stream (JetStream MOONBUS_EVENTS), live or from the start.

  moonbus tap                       live events from now on
  moonbus tap --kind routed         only routing decisions
  moonbus tap --request-id X        one request's whole path, from the start of the stream
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import signal
from pathlib import Path

from nats.js.api import ConsumerConfig, DeliverPolicy

from common import bus
from common.config import default_home
from schemas import subjects
from schemas.events import TERMINAL_KINDS, Event
from tools.moonbus.observe.escape import printable, printable_json


def default_access(home=None):
    """(NATS URL, credentials): $MOONBUS_NATS_URL, else the local cluster's, as its read-only auditor."""
    if os.environ.get("MOONBUS_NATS_URL"):
        return os.environ["MOONBUS_NATS_URL"], None
    state = (home or default_home()) / "cluster.json"
    if state.exists():
        from tools.moonbus.cluster.security import local_access

        return local_access(json.loads(state.read_text()), "auditor")
    return "nats://127.0.0.1:4333", None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nats-url", default=None, help="default: $MOONBUS_NATS_URL, else the local cluster's")
    parser.add_argument("--home", type=Path, default=None, help="the local cluster's state directory (default ./.moonbus)")
    parser.add_argument("--kind", help="only events of this kind (e.g. routed, failed, stored)")
    parser.add_argument("--request-id", help="one request's events, from the start of the stream")
    parser.add_argument("--all", action="store_true", help="replay the stream from its start, then follow")
    parser.add_argument("--json", action="store_true", help="print raw JSON, one event per line")
    parser.add_argument("--until-terminal", action="store_true", help="with --request-id: exit after its terminal event")
    parser.add_argument("--timeout", type=float, default=0, help="exit after this many seconds without events (0 = never)")


def filter_subject(args: argparse.Namespace) -> str:
    if args.request_id and args.kind:
        return subjects.request_event(args.kind, args.request_id)
    if args.request_id:
        return subjects.events_of_request(args.request_id)
    if args.kind:
        return subjects.events_of_kind(args.kind)
    return subjects.EVENTS_ALL


def format_event(event: Event) -> str:
    """One line; whatever its publisher chose is escaped (json.dumps escapes the values already)."""
    ts = datetime.datetime.fromtimestamp(event.ts).strftime("%H:%M:%S.%f")[:-3]
    who = printable(f"{event.service}/{event.instance_id}")
    data = " ".join(f"{printable(k)}={json.dumps(v, separators=(',', ':'))}" for k, v in event.data.items())
    rid = f" {printable(event.request_id)}" if event.request_id else ""
    return f"{ts} {printable(event.kind):<15} {who:<28}{rid} {data}"


DRAIN_S = 2.0  # at exit, how long to wait for the connection to drain


async def tap(args: argparse.Namespace) -> int:
    url, auth = (args.nats_url, None) if args.nats_url else default_access(args.home)
    nc = await bus.connect(url, "moonbus-tap", auth)
    js = nc.jetstream()
    deliver = DeliverPolicy.ALL if (args.all or args.request_id) else DeliverPolicy.NEW
    sub = await js.subscribe(filter_subject(args), ordered_consumer=True, config=ConsumerConfig(deliver_policy=deliver))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        while True:
            # NOTE: a signal ends the wait for the next event at once (an idle tap waited up to an hour)
            nxt = asyncio.ensure_future(sub.next_msg(timeout=args.timeout or 3600))
            await asyncio.wait({nxt, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if stopped.done():
                nxt.cancel()
                break
            try:
                msg = nxt.result()
            except asyncio.TimeoutError:
                if args.timeout:
                    break
                continue
            try:
                event = Event.from_bytes(msg.data)
            except ValueError as exc:  # someone published something else on an events subject
                print(printable(f"(malformed event on {msg.subject}: {exc})"), flush=True)
                continue
            print(printable_json(msg.data.decode()) if args.json else format_event(event), flush=True)
            if args.until_terminal and event.kind in TERMINAL_KINDS:
                break
    finally:
        stopped.cancel()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(sub.unsubscribe(), DRAIN_S)
        try:  # a broker that went away would keep a drain reconnecting: give up after DRAIN_S
            await asyncio.wait_for(nc.drain(), DRAIN_S)
        except Exception:  # noqa: BLE001 - leaving anyway
            await nc.close()
    return 0


def run(args: argparse.Namespace) -> int:
    return asyncio.run(tap(args))
