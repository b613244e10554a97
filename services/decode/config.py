"""The decode service's settings: the decode role's flags (common/roles/decode_config.py) on their own parser."""

from __future__ import annotations

import argparse

from common import config as common
from common.roles.decode_config import DecodeConfig, add_flags, from_args


def load(argv: list[str] | None = None) -> DecodeConfig:
    parser = argparse.ArgumentParser(prog="python -m services.decode", description="moonbus decode instance")
    common.add_common_flags(parser, "decode")
    add_flags(parser)
    return from_args(parser.parse_args(argv))
