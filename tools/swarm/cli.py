"""`moonbus swarm ...`: tools for a moonbus stack on a Docker swarm (docs/swarm.md).

    autoscale   follow the planner's decisions with `docker service scale` (autoscale.py)
"""

from __future__ import annotations

import argparse

from tools.swarm import autoscale

SUBCOMMANDS = {"autoscale": (autoscale, "follow the planner's decisions with docker service scale")}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="swarm_command", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        module.add_arguments(sub.add_parser(name, help=help_text, description=help_text))


def run(args: argparse.Namespace) -> int:
    return SUBCOMMANDS[args.swarm_command][0].run(args)
