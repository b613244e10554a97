"""Logging, configured once per process."""

from __future__ import annotations

import logging
import sys


def setup_logging(level: str, service: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s",
    )
    # transformers and nats are chatty at INFO
    for noisy in ("nats", "transformers", "accelerate", "aiohttp.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
