"""`make bench`: every `moonbus bench` target, one after another in one run, into one JSON file and one table.

    python -m tools.moonbus.bench.suite --out bench-out [--with 'transfer=--require-mooncake'] [--targets a,b]

Each target of TARGETS (tools/moonbus/bench/__init__.py, so targets added later run too) runs as
`python -m tools.moonbus.cli bench <target> --json [its --with arguments]` in a process of its
own (a fresh interpreter: one target's torch threads, pages or garbage do not weigh on the next),
its stderr kept in <out>/<target>.log. Its own JSON (the last line it prints) is the source of its
rows: the target module's `summary(result)` where it has one (row, ours, baseline, ratio, goal,
met), else every number its JSON names `ratio*` or `vs_*`, by its path.

Writes <out>/bench.json ({date, machine, targets: {name: {argv, exit, seconds, load before and
after, result, rows}}}) and <out>/BENCH.md (the date, the machine, a table per target). Exits 1
when a target failed (its exit status and stderr's tail are in both files).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import orjson

from common import machine
from tools.moonbus.bench import TARGETS

ROOT = Path(__file__).resolve().parents[3]
RATIO_KEYS = ("ratio", "vs_")  # a target without summary(): its rows are the numbers named so


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.moonbus.bench.suite", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-out"), help="where bench.json and BENCH.md go")
    parser.add_argument("--targets", default=",".join(TARGETS), help="which targets, in order (default: all)")
    parser.add_argument("--with", dest="extra", action="append", default=[], metavar="TARGET=ARGS",
                        help="more arguments for one target, e.g. 'transfer=--require-mooncake' (repeatable)")
    args = parser.parse_args(argv)
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown:
        parser.error(f"unknown targets {unknown}; TARGETS has {sorted(TARGETS)}")
    extra: dict[str, list[str]] = {}
    for item in args.extra:
        name, _, rest = item.partition("=")
        if name not in TARGETS:
            parser.error(f"--with {item!r}: no target {name!r}")
        extra.setdefault(name, []).extend(shlex.split(rest))
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "machine": machine.describe(),
              "targets": {}}
    for name in targets:
        print(f"moonbus bench {name} ...", file=sys.stderr, flush=True)
        report["targets"][name] = run_target(name, extra.get(name, []), args.out)
        print(f"  exit {report['targets'][name]['exit']} after {report['targets'][name]['seconds']:.0f} s",
              file=sys.stderr, flush=True)
    (args.out / "bench.json").write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    (args.out / "BENCH.md").write_text(markdown(report))
    print(f"wrote {args.out / 'bench.json'} and {args.out / 'BENCH.md'}", file=sys.stderr)
    return 0 if all(t["exit"] == 0 for t in report["targets"].values()) else 1


def run_target(name: str, extra: list[str], out: Path) -> dict:
    argv = [sys.executable, "-m", "tools.moonbus.cli", "bench", name, "--json", *extra]
    log = out / f"{name}.log"
    load_before, started = os.getloadavg(), time.perf_counter()
    with open(log, "wb") as stderr:
        done = subprocess.run(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr)
    entry = {"argv": ["moonbus", *argv[3:]], "exit": done.returncode, "seconds": time.perf_counter() - started,
             "load_before": load_before, "load_after": os.getloadavg(), "log": str(log), "result": None, "rows": []}
    lines = done.stdout.decode(errors="replace").strip().splitlines()
    try:
        entry["result"] = orjson.loads(lines[-1]) if lines else None
    except orjson.JSONDecodeError:
        pass
    if entry["result"] is None:
        entry["exit"] = entry["exit"] or 1  # printed no JSON: it failed, whatever its status
    else:
        entry["rows"] = rows_of(name, entry["result"])
    if entry["exit"]:
        entry["stderr_tail"] = log.read_text(errors="replace")[-2000:]
    return entry


def rows_of(name: str, result: dict) -> list[dict]:
    summary = getattr(importlib.import_module(TARGETS[name]), "summary", None)
    if summary is not None:
        return summary(result)
    return [{"row": path, "ours": None, "baseline": None, "ratio": value, "goal": None, "met": None}
            for path, value in _ratios(result, "")]


def _ratios(obj, path: str):
    """(path, number) of every number named ratio*/vs_* in a JSON value; list items by their name."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key.startswith(RATIO_KEYS):
                yield f"{path}{key}", value
            elif isinstance(value, (dict, list)):
                yield from _ratios(value, f"{path}{key}.")
    elif isinstance(obj, list):
        for i, item in enumerate(obj):
            label = next((str(item[k]) for k in ("name", "case", "pattern") if isinstance(item, dict) and k in item), i)
            yield from _ratios(item, f"{path}{label}.")


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = [f"Run {report['date']} on {m['cpu']} ({m['cores']} cores, {m['memory_gib']} GiB, {m['system']}, "
             f"Python {m['python']}) by `make bench`; every target's own JSON is in bench.json. Ratios are ours over "
             "the baseline (for times, lower is better; for speeds, higher)."]
    for name, t in report["targets"].items():
        load = "/".join(f"{x:.1f}" for x in t["load_before"])
        lines += ["", f"### {name}", "", f"`{' '.join(t['argv'])}`: exit {t['exit']}, {t['seconds']:.0f} s, "
                                          f"load average before {load}", ""]
        if t["exit"]:
            tail = (t.get("stderr_tail") or "").strip().splitlines()[-5:]
            lines += ["FAILED:", "", "```", *tail, "```", ""]
        if t["rows"]:
            lines += ["| row | ours | baseline | ratio | goal | met |", "|---|---|---|---|---|---|"]
            lines += [f"| {r['row']} | {r['ours'] or ''} | {r['baseline'] or ''} | {_x(r['ratio'])} | "
                      f"{r['goal'] or ''} | {_met(r['met'])} |" for r in t["rows"]]
    return "\n".join(lines) + "\n"


def _x(ratio: float | None) -> str:
    if ratio is None:
        return ""
    return f"{ratio:.2f}x" if ratio >= 0.1 else f"{ratio:.3f}x"


def _met(met: bool | None) -> str:
    return "" if met is None else ("yes" if met else "**no**")


if __name__ == "__main__":
    sys.exit(main())
