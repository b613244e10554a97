"""Coupled instance settings: the prefill and the decode flags on one parser, one node, one model.

The instance announces itself twice, as `<instance-id>-prefill` and `<instance-id>-decode`, so the
conductor sees one prefill and one decode instance on the same node (it keeps a request on that
node with --colocate).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

from common.config import add_common_flags, check_subject_token
from services.decode import config as decode_config
from services.decode.config import DecodeConfig
from services.prefill import config as prefill_config
from services.prefill.config import PrefillConfig


@dataclass(frozen=True)
class CoupledConfig:
    instance_id: str
    log_level: str
    prefill: PrefillConfig
    decode: DecodeConfig

    def __post_init__(self) -> None:
        check_subject_token("instance id", self.instance_id)
        p, d = self.prefill, self.decode
        # one process, one model, one node: the flags are shared, so these hold unless built by hand
        if (p.node, p.model, p.block_tokens, p.home, p.nats_url) != (d.node, d.model, d.block_tokens, d.home, d.nats_url):
            raise ValueError("prefill and decode of a coupled instance must share node, model, block tokens, home and NATS")


def load(argv: list[str] | None = None) -> CoupledConfig:
    # NOTE: both roles define --node, --model, --threads, ...; "resolve" keeps one flag for each
    parser = argparse.ArgumentParser(prog="python -m services.coupled", conflict_handler="resolve",
                                     description="moonbus coupled instance (prefill and decode on one model)")
    prefill_config.add_flags(parser)
    decode_config.add_flags(parser)
    add_common_flags(parser, "coupled")
    args = parser.parse_args(argv)
    return CoupledConfig(
        instance_id=args.instance_id,
        log_level=args.log_level,
        prefill=replace(prefill_config.from_args(args), instance_id=f"{args.instance_id}-prefill"),
        decode=replace(decode_config.from_args(args), instance_id=f"{args.instance_id}-decode"),
    )
