"""`moonbus bench <target>`: benchmarks that measure ours against a baseline side by side, in one run."""

from __future__ import annotations

import argparse
import importlib
import importlib.util

# target -> module exposing add_arguments(parser) and run(args)
TARGETS = {
    "store": "tools.moonbus.bench_store",
    "conductor": "tools.moonbus.bench_conductor",
    "engine": "tools.moonbus.bench_engine",
    "transfer": "tools.moonbus.bench_transfer",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="target", required=True)
    for name, module_name in TARGETS.items():
        if importlib.util.find_spec(module_name) is None:
            continue
        importlib.import_module(module_name).add_arguments(sub.add_parser(name))


def run(args: argparse.Namespace) -> int:
    return int(importlib.import_module(TARGETS[args.target]).run(args) or 0)
