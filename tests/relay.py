"""What the tests' TCP relays share: bytes passed on from one socket to another until either end
closes, then both ends shut, so the peers on each side see the relay's end as a closed connection."""

from __future__ import annotations

import socket
from typing import Callable


def shut(*socks: socket.socket) -> None:
    """Both directions of each socket shut (its peer reads the end); one already gone is skipped."""
    for sock in socks:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def pump(src: socket.socket, dst: socket.socket, on_bytes: Callable[[bytes], bytes] | None = None,
         first: Callable[[socket.socket, socket.socket], None] | None = None) -> None:
    """Pass `src`'s bytes to `dst` until one ends or breaks, then shut both. `first(src, dst)` runs
    before (a relay that reads a handshake or a frame itself); `on_bytes` sees (and may change)
    each read before it is sent on."""
    try:
        if first is not None:
            first(src, dst)
        while data := src.recv(1 << 16):
            dst.sendall(on_bytes(data) if on_bytes is not None else data)
    except OSError:  # a TransportError too (a ConnectionError): a frame cut short
        pass
    finally:
        shut(src, dst)
