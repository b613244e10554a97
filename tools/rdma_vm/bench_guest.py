"""Runs in the RDMA test VM (tools/rdma_vm session.run_bench): perftest beside our rdma backend.

    python3 -m tools.rdma_vm.bench_guest --mib 64 --out /run/moonbus/bench.json

On the same rxe device and the same message size (1 MiB, WR_BYTES: what one of our work requests
moves), MiB moved per second by
    ib_write_bw / ib_read_bw       perftest, server and client on this one device
    rdma backend write / read      two Transports("rdma") in this process, as test_backend's owner
                                   and writer: write = RDMA WRITE + the landed notice + the owner's
                                   xxh3 over the bytes (what a handoff pays); read = RDMA READ
and each backend row's ratio to perftest's. Under qemu's emulation (and soft-RoCE, which copies
every packet in the guest's kernel) the numbers compare the two on one machine; they say nothing
of a real NIC. MB/s here is perftest's: 2^20 bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import time

from common.transport import Transports

DEVICE = os.environ.get("MOONBUS_RDMA_DEVICE", "rxe0")
GID_INDEX = "1"  # the IPv4-mapped GID: RoCEv2
MiB = 1 << 20
MSG_BYTES = MiB
REPEATS = 3  # the median of these, after one warm-up
SECRET = b"moonbus-rdma-bench-secret-0123456789"


def perftest(tool: str, mib: int, port: int) -> float:
    """perftest's average MB/s (2^20) for `mib` messages of 1 MiB, server and client on DEVICE."""
    common = [tool, "-d", DEVICE, "-x", GID_INDEX, "-s", str(MSG_BYTES), "-n", str(mib), "-p", str(port), "-F"]
    server = subprocess.Popen(common, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(1.0)  # the server listens on its port before the client connects
        client = subprocess.run(common + ["127.0.0.1"], capture_output=True, text=True, timeout=300)
        server_out, _ = server.communicate(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()  # our own child, by its pid
            server.wait()
    # the result line: "#bytes  #iterations  BW peak[MB/sec]  BW average[MB/sec]  MsgRate[Mpps]"
    for line in client.stdout.splitlines():
        fields = line.split()
        if len(fields) >= 4 and fields[0] == str(MSG_BYTES) and re.fullmatch(r"[\d.]+", fields[3]):
            return float(fields[3])
    raise RuntimeError(f"{tool}: no result line (exit {client.returncode}):\n{client.stdout}\n{client.stderr}\n"
                       f"server:\n{server_out}")


def backend(mib: int) -> dict[str, float]:
    """MB/s (2^20) of the rdma backend's write and read of `mib` MiB between two Transports."""
    owner, writer = Transports("rdma", secret=SECRET), Transports("rdma", secret=SECRET)
    try:
        owner.listen("127.0.0.1")
        writer.listen("127.0.0.1")
        nbytes = mib * MiB
        ref = owner.register("bench", bytearray(nbytes))
        owner.handle("done", lambda body, peer: b"")
        src, dst = bytearray(os.urandom(nbytes)), bytearray(nbytes)
        writer.register("src", src)  # registered: zero-copy, as a slab or a handoff region is
        writer.register("dst", dst)
        staged = bytes(src)  # not registered: copied through the staging region
        with writer.connect(ref.endpoints) as ch:
            assert ch.transport == "rdma", ch.transport

            def write(buf) -> None:
                ch.write(ref, [(0, buf)])
                ch.call("done")  # ordered after the write: it has landed and been verified

            rates = {
                "rdma backend write (registered, + verify)": _rate(lambda: write(memoryview(src)), nbytes),
                "rdma backend write (staged copy, + verify)": _rate(lambda: write(staged), nbytes),
                "rdma backend read (registered)": _rate(lambda: ch.read(ref, [(0, memoryview(dst))]), nbytes),
            }
            assert dst == src, "the read did not return what was written"
        return rates
    finally:
        writer.close()
        owner.close()


def _rate(op, nbytes: int) -> float:
    op()  # warm-up: QP setup, staging registration
    times = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        op()
        times.append(time.perf_counter() - started)
    return nbytes / MiB / statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    write_bw = perftest("ib_write_bw", args.mib, 18515)
    read_bw = perftest("ib_read_bw", args.mib, 18516)
    ours = backend(args.mib)
    rows = [{"what": f"ib_write_bw (perftest, {args.mib} x 1 MiB)", "mb_s": write_bw, "ratio": None},
            {"what": f"ib_read_bw (perftest, {args.mib} x 1 MiB)", "mb_s": read_bw, "ratio": None}]
    for what, rate in ours.items():
        reference = read_bw if " read " in what else write_bw
        rows.append({"what": what, "mb_s": rate, "ratio": rate / reference})
    for row in rows:
        ratio = f"{row['ratio']:.2f}x" if row["ratio"] is not None else ""
        print(f"{row['what']:<44} {row['mb_s']:>8.1f} MB/s {ratio}")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(rows, fh)


if __name__ == "__main__":
    main()
