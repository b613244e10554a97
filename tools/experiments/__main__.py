"""Run one experiment (1-7) or all: each writes N_name.md (table + settings) and N_name.png.

1-5 and 7 simulate (tools/sim); 6 starts real clusters on this machine and replays a trace slice.

    python -m tools.experiments 1            # scheduling policies
    python -m tools.experiments all --out docs/experiments
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from tools.experiments import live, runs
from tools.moonbus.traces.rows import resolve_trace

EXPERIMENTS = dict(sorted({**runs.EXPERIMENTS, "6": live.live}.items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.experiments", description=__doc__.splitlines()[0])
    parser.add_argument("which", choices=[*EXPERIMENTS, "all"])
    parser.add_argument("--out", type=Path, default=Path("docs/experiments"))
    parser.add_argument("--traces", type=Path, default=resolve_trace("conversation").parent,
                        help="the folder holding conversation_trace.jsonl and synthetic_trace.jsonl (default: the repository's data/traces)")
    parser.add_argument("--limit", type=int, default=None,
                        help=f"first N rows of each trace (smoke runs; experiment 6: default {live.ROWS})")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for key in (EXPERIMENTS if args.which == "all" else [args.which]):
        started = time.perf_counter()
        path = EXPERIMENTS[key](args)
        print(f"experiment {key}: {path} ({time.perf_counter() - started:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
