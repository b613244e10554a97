"""`moonbus soak`: drive a running cluster with trace load (and chaos), prove it stays up and leaks nothing.

    moonbus soak --trace conversation --duration 120 --load 2 [--chaos prefill,decode --every 20]

Defaults come from the local cluster's state file `<home>/cluster.json` (written by `moonbus up`).
The run, in order:

  1. subscribe to MOONBUS_EVENTS (new events only) before the first request: terminal, migrated
     and restarted events are recorded per request id / process kind;
  2. measure the pools, the shm directory and /dev/shm before;
  3. send the trace's rows open loop at their scaled times (soak_load), each as `moonbus replay`
     sends it (replay.send_one); meanwhile sample RSS and shared memory every second and, with
     --chaos, SIGKILL a random process of a random listed kind every --every seconds;
  4. stop sending, wait for the requests in flight, then up to --drain-timeout for the cluster to
     be idle (conductor in flight 0, no pinned block, no request KV file);
  5. judge (soak_verdict), write <out>/soak.json and soak.png, print the summary (soak_report).

Exit status 0 only if every request completed or was rejected (429/503), each ended exactly once
and nothing leaked; 1 otherwise (every violation is listed); 2 if the run could not start.

Modules: soak_run (the run), soak_load (schedule, capacity), soak_cluster (state file, processes,
shared memory, NATS probes), soak_verdict (outcomes, exactly-once, leaks), soak_report (text, PNG).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

import orjson

from common.config import default_home
from tools.moonbus.soak import cluster as sc
from tools.moonbus.soak import report as soak_report
from tools.moonbus.soak.run import Soak, SoakError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=None, help="gateway URL (default: the local cluster's)")
    parser.add_argument("--nats-url", default=None, help="NATS URL (default: the local cluster's)")
    parser.add_argument("--home", type=Path, default=default_home(), help="where cluster.json is (default ./.moonbus)")
    parser.add_argument("--trace", default="conversation", metavar="conversation|synthetic|PATH",
                        help="a Mooncake-format trace: one of the released ones by name, or a file")
    parser.add_argument("--limit", type=int, default=None, metavar="N", help="use only the first N rows of the trace")
    parser.add_argument("--tokens-per-block", type=int, default=16, metavar="B", help="tokens per trace hash id")
    parser.add_argument("--max-input", type=int, default=None, metavar="N", help="cut prompts to N tokens")
    parser.add_argument("--max-output", type=int, default=None, metavar="N", help="cap output lengths at N tokens")
    parser.add_argument("--output-scale", type=float, default=None, metavar="F", help="scale outputs by F (default B/512)")
    parser.add_argument("--vocab-size", type=int, default=259, help="prompt ids are drawn from [3, vocab size)")
    how_long = parser.add_mutually_exclusive_group()
    how_long.add_argument("--duration", type=float, default=None, metavar="S", help="send for S seconds (default 60)")
    how_long.add_argument("--count", type=int, default=None, metavar="N", help="send N requests")
    rate = parser.add_mutually_exclusive_group()
    rate.add_argument("--load", type=float, default=None, metavar="X", help="X times the profile's capacity (default 1)")
    rate.add_argument("--speed", type=float, default=None, metavar="X", help="divide trace time by X instead")
    parser.add_argument("--chaos", default="", metavar="KINDS", help=f"kinds to SIGKILL: {','.join(sc.CHAOS_KINDS)}")
    parser.add_argument("--every", type=float, default=10.0, metavar="S", help="seconds between kills")
    parser.add_argument("--chaos-order", choices=("random", "cycle"), default="random",
                        help="random: a random listed kind each time; cycle: the listed kinds in turn")
    parser.add_argument("--seed", type=int, default=0, help="seeds the chaos and the prompts")
    parser.add_argument("--timeout", type=float, default=300.0, metavar="S", help="seconds per request")
    parser.add_argument("--drain-timeout", type=float, default=60.0, metavar="S", help="seconds to wait for idle")
    parser.add_argument("--ttft-slo", type=float, default=30.0, metavar="S", help="as the cluster's (moonbus up: 30)")
    parser.add_argument("--tbt-slo", type=float, default=1.0, metavar="S", help="as the cluster's (moonbus up: 1)")
    parser.add_argument("--min-attainment", type=float, default=0.9, metavar="F",
                        help="fail when fewer of the completed requests met both SLOs (default 0.9; 0: do not judge)")
    parser.add_argument("--out", type=Path, default=Path("soak-out"), metavar="DIR")
    parser.add_argument("--json", action="store_true", help="also print soak.json")
    parser.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        soak = Soak(args)  # ValueError, OSError: a bad trace or state file
        report = asyncio.run(soak.run())
    except (SoakError, ValueError, OSError) as exc:
        print(f"moonbus soak: {exc if isinstance(exc, SoakError) else repr(exc)}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    soak_report.plot(report, args.out / "soak.png")
    print(soak_report.format_text(report), file=soak.say)
    print(f"report in {args.out / 'soak.json'} and {args.out / 'soak.png'}", file=soak.say)
    if args.json:
        print(orjson.dumps(report).decode())
    return report["exit_code"]
