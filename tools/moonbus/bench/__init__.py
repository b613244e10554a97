"""`moonbus bench <target>`: benchmarks that measure ours against a baseline side by side, in one run.

    store.py       the DRAM slab and the SSD tier against memcpy and a file per block
    conductor.py   decisions per second at scale; route.py, route_report.py, fleet.py: the live route
    engine.py      batched decode, layer-wise prefill and the pipeline against the plain forward
                   (join.py: what a request joining a running batch costs the batch)
    transfer.py    the KV transport against a plain socket and Mooncake's engine, on the patterns the
                   system sends (transfer_patterns.py: the patterns, timing and per-run checks;
                   transfer_peers.py, transfer_socket.py: the receiving processes and the cases;
                   transfer_report.py: ratios and goals; transfer_tail.py: the streamed handoff's tail)
    wire.py        the wire codec (msgspec) against the hand-written one it replaced and stdlib json
    vllm.py        moonbus against vLLM's CPU backend on the same weights, trace slice and SLOs
                   (vllm_servers.py: both servers and vLLM's own environment; vllm_load.py: the load
                   through the replay client; vllm_report.py: the numbers and ratios)
    goodput.py     the admission modes side by side on live clusters under the same overload: what
                   predictive early rejection buys over admitting everything

`make bench` runs every target of TARGETS one after another (suite.py) into one JSON and one table.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util

# target -> module exposing add_arguments(parser) and run(args)
TARGETS = {
    "store": "tools.moonbus.bench.store",
    "conductor": "tools.moonbus.bench.conductor",
    "engine": "tools.moonbus.bench.engine",
    "transfer": "tools.moonbus.bench.transfer",
    "wire": "tools.moonbus.bench.wire",
    "vllm": "tools.moonbus.bench.vllm",
    "goodput": "tools.moonbus.bench.goodput",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="target", required=True)
    for name, module_name in TARGETS.items():
        if importlib.util.find_spec(module_name) is None:
            continue
        importlib.import_module(module_name).add_arguments(sub.add_parser(name))


def run(args: argparse.Namespace) -> int:
    return int(importlib.import_module(TARGETS[args.target]).run(args) or 0)
