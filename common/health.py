"""Readiness for container health checks: a file a service keeps fresh while it is ready.

A service is ready while its broker connection is up, its essential loops run and it takes
work (a draining worker is not: it finishes what it holds and leaves). The `beacon` task touches
the file every `interval_s` while ready and removes it otherwise; `python -m common.health FILE`
exits 0 only if the file was touched within `--max-age` seconds, which is what compose's
healthcheck runs. No file configured (`--health-file ""`, the default outside containers): off.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Callable

from common import runner


async def beacon(path: str, nc, stop: asyncio.Event, ready: Callable[[], bool] = lambda: True,
                 interval_s: float = 2.0) -> None:
    if not path:
        return
    target = Path(path)
    try:
        while not stop.is_set():
            if nc.is_connected and ready():
                target.touch()
            else:
                target.unlink(missing_ok=True)
            await runner.wait_set(stop, interval_s)
    finally:
        target.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m common.health", description=__doc__.splitlines()[0])
    parser.add_argument("file", help="the service's --health-file")
    parser.add_argument("--max-age", type=float, default=10.0, help="seconds")
    args = parser.parse_args(argv)
    try:
        age = time.time() - Path(args.file).stat().st_mtime
    except FileNotFoundError:
        print(f"not ready: {args.file} is missing", file=sys.stderr)
        return 1
    if age > args.max_age:
        print(f"not ready: {args.file} is {age:.0f} s old", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
