"""python -m tools.rdma_vm build | run COMMAND | test [PYTEST ARGS] | bench

    build   build the image (or say where the cached one is)
    run     run a shell command in the VM (in /work, the project's tree), print its output
    test    the in-guest tests (tests/rdma) under pytest, with a nats-server on the host
    bench   ib_write_bw and ib_read_bw against the rdma backend on the same rxe device
"""

from __future__ import annotations

import argparse
import logging
import sys

from tools.rdma_vm import image, vm
from tools.rdma_vm.session import guest_pytest, run_bench, with_host_nats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.rdma_vm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("build")
    run = sub.add_parser("run")
    run.add_argument("command")
    run.add_argument("--timeout", type=float, default=600)
    test = sub.add_parser("test")
    test.add_argument("pytest_args", nargs="*")
    bench = sub.add_parser("bench")
    bench.add_argument("--mib", type=int, default=64, help="bytes moved per measurement, in MiB")
    args, unknown = parser.parse_known_args(argv)  # `test -x -k name`: pytest's own options pass through
    if unknown and args.cmd != "test":
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.cmd == "test":
        args.pytest_args = unknown + args.pytest_args
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")

    img = image.ensure_image()
    if img.built_s:
        print(f"image built in {img.built_s:.0f} s: {img.directory}")
    if args.cmd == "build":
        print(f"image: {img.directory}")
        return 0
    if args.cmd == "run":
        result = vm.run(img, args.command, timeout_s=args.timeout)
    elif args.cmd == "test":
        result = with_host_nats(lambda url: guest_pytest(img, url, args.pytest_args))
    else:
        result, table = run_bench(img, args.mib)
        print(table)
    print(result.output)
    print(f"guest exit status: {result.rc}; VM wall time {result.wall_s:.1f} s "
          f"(command started at guest uptime {result.started_s} s); logs in {result.run_dir}")
    if result.rc is None:
        print(result.guest_log[-3000:], result.console[-3000:], sep="\n", file=sys.stderr)
    return 0 if result.rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
