"""A region owner in its own process (killed by the tests to make a peer vanish midway).

    python3 -m tests.rdma.owner NBYTES     prints its RegionRef as one JSON line, then serves
"""

from __future__ import annotations

import sys
import time

from common.transport import Transports

SECRET = b"moonbus-rdma-test-secret-0123456789"


def main() -> None:
    transports = Transports("rdma", secret=SECRET)
    transports.listen("127.0.0.1")
    ref = transports.register("victim", bytearray(int(sys.argv[1])))
    transports.handle("echo", lambda body, peer: body[::-1])
    print(ref.to_bytes().decode(), flush=True)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    main()
