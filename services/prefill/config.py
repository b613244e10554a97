"""The prefill service's settings: the prefill role's flags (common/roles/prefill_config.py) on their own parser."""

from __future__ import annotations

import argparse

from common import config as common
from common.roles.prefill_config import PrefillConfig, add_flags, from_args


def load(argv: list[str] | None = None) -> PrefillConfig:
    parser = argparse.ArgumentParser(prog="python -m services.prefill", description="moonbus prefill instance")
    common.add_common_flags(parser, "prefill")
    add_flags(parser)
    return from_args(parser.parse_args(argv))
