"""The live route's floor: a process that answers every request at once, with the bytes of a route's
reply, and does nothing else (`moonbus bench conductor`'s `echo` row).

The same client sends it the same route requests through the same nats-server, so the difference
between the conductor's row and this one is what the conductor adds to a route (decoding, hashing,
the decision, the event, dispatch, and hearing the fleet meanwhile); this row itself is the bus:
two processes' event loops (nats-py on uvloop, as every service runs) and the broker between them.

    python -m tools.moonbus.bench.echo NATS_URL SUBJECT REPLY_FILE
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from common import bus, runner


async def serve(url: str, subject: str, reply: bytes, stop: asyncio.Event) -> bool:
    nc = await bus.connect(url, "bench-echo")

    async def answer(msg) -> None:
        await msg.respond(reply)

    await nc.subscribe(subject, cb=answer)
    await runner.serving(stop)
    await bus.shutdown(nc)
    return True


def main(argv: list[str] | None = None) -> None:
    url, subject, reply_file = argv if argv is not None else sys.argv[1:]
    reply = Path(reply_file).read_bytes()
    runner.run(lambda stop: serve(url, subject, reply, stop))  # exits the process when stopped


if __name__ == "__main__":
    main()
