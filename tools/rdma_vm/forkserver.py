"""Start several service processes from one interpreter that imported their modules once.

    python3 -m tools.rdma_vm.forkserver SPEC.json

Under the RDMA VM's software emulation importing torch takes minutes per process; the model
handoff test needs four service processes (two messengers, a prefill, a decode). This imports
the services' modules (torch included) once, then forks one child per entry of SPEC, each
running `python -m <module>` with its argv and its output in its log. The parent stays, forwards
SIGTERM and SIGINT to the children and exits when they all have (with the worst exit status).

SPEC: a JSON list of {"module": "services.prefill", "argv": [...], "log": "/path/prefill.log"}.
Fork happens before any thread exists (importing starts none), so the children are safe.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import signal
import sys


def main(argv: list[str]) -> int:
    spec = json.loads(open(argv[0]).read())
    for entry in spec:  # the services' modules and what they import (torch, nats, aiohttp), once
        importlib.import_module(entry["module"] + ".service")
    children = []
    for entry in spec:
        pid = os.fork()
        if pid == 0:
            _child(entry)  # never returns
        children.append(pid)

    def forward(signum, frame) -> None:
        for pid in children:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    worst = 0
    for pid in children:
        _, status = os.waitpid(pid, 0)
        worst = max(worst, os.waitstatus_to_exitcode(status) & 0xFF)
    return worst


def _child(entry: dict) -> None:
    fd = os.open(entry["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    sys.argv = [entry["module"], *entry["argv"]]
    code = 0
    try:
        runpy.run_module(entry["module"], run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported in the child's log
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
