"""The `moonbus` command line: one subcommand per module, loaded on demand.

Each subcommand module exposes `add_arguments(parser)` and `run(args) -> int`.
Loading on demand keeps `moonbus tap` from importing torch.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys

from common.runner import OWNER_ONLY

# subcommand -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("tools.moonbus.cluster.up", "start a local cluster (embedded NATS and every service)"),
    "keys": ("tools.moonbus.cluster.keys", "API keys of the cluster, stored hashed (add, list, revoke)"),
    "compose-secrets": ("tools.moonbus.cluster.compose_secrets", "write the secrets compose.yaml hands its containers"),
    "tap": ("tools.moonbus.observe.tap", "print the event stream live, filtered by kind or request id"),
    "audit": ("tools.moonbus.observe.audit", "prove the audit log complete and unaltered (verify), or show one request's record"),
    "cachesim": ("tools.moonbus.traces.cachesim", "replay a trace through the KV pool's eviction and index code"),
    "bench": ("tools.moonbus.bench", "side-by-side benchmarks (store, conductor, engine, transfer, wire)"),
    "profile": ("tools.moonbus.cluster.profile", "measure the model's prefill/decode times and fit the predictors"),
    "replay": ("tools.moonbus.traces.replay", "replay a trace against a live cluster"),
    "sim": ("tools.moonbus.traces.sim", "simulate a cluster from the same scheduling code"),
    "soak": ("tools.moonbus.soak", "drive a running cluster with trace load (and chaos); prove it stays up and leaks nothing"),
    "swarm": ("tools.swarm.cli", "a stack on a Docker swarm: autoscale (follow the planner with docker service scale)"),
}


def build_parser(available: dict[str, tuple[str, str]]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moonbus", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in available.items():
        module = importlib.import_module(module_name)
        module.add_arguments(sub.add_parser(name, help=help_text, description=help_text))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    os.umask(OWNER_ONLY)  # `moonbus up` and its children, profiles, reports: the owner's alone
    # Only import the module of the subcommand asked for (torch is slow to import).
    wanted = {k: v for k, v in COMMANDS.items() if argv and argv[0] == k} or COMMANDS
    available = {k: v for k, v in wanted.items() if importlib.util.find_spec(v[0]) is not None}
    args = build_parser(available).parse_args(argv)
    module = importlib.import_module(available[args.command][0])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
