"""The baseline of `moonbus bench transfer`: a plain TCP socket, written as well as we know how.

One connection to a receiving process (its own, spawned, so the GIL never serializes the two
ends), blocking, TCP_NODELAY, SO_SNDBUF/SO_RCVBUF set large at both ends (--socket-buffer; the
kernel caps them at net.core.[wr]mem_max), every receive a recv_into straight into its place in the
receiver's buffer with MSG_WAITALL (one wakeup per receive), every send a sendmsg of views of the
source (no copy, no concatenation). The wire:

    [op 1][verify 1][count 4] [count x (offset 8, nbytes 8)]   then, by op:
    W  the pieces' bytes in order; when verify, their xxh3-64 (8)        -> nothing (one-sided)
    C  (count 0)                                                          -> 1 byte: 1 = every write
                                                                             since the last C was intact
    R  nothing                                                            -> the pieces' bytes in order

With `verify` the same work as ours: the sender hashes each CHUNK right before sending it, the
receiver each CHUNK right after it landed (both while the bytes are in cache), and the reader of
a pull each block right after it arrived, against the checksum the source announced. Two cases
on one connection: `socket_verified` (xxh3 both ends, or on arrival for a pull) and `socket` (none).
"""

from __future__ import annotations

import socket
import struct
import threading
from multiprocessing.connection import Connection

import numpy as np
import xxhash

from tools.moonbus.bench.transfer_patterns import Case, Pattern, make_buffer
from tools.moonbus.bench.transfer_peers import HOST, Peer, PeerFailed, answer_control, answer_error

CHUNK = 1 << 20  # bytes hashed at a time while they are in cache
DEFAULT_BUFFER = 4 << 20  # SO_SNDBUF / SO_RCVBUF: what net.core.[wr]mem_max allows on a stock kernel
_HEAD = struct.Struct("<cBI")
_SPAN = struct.Struct("<QQ")
_SUM = struct.Struct("<Q")
_IOV_MAX = 1024


def tune(sock: socket.socket, buffer_bytes: int) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # completions and their replies are small
    if buffer_bytes:  # NOTE: setting them turns the kernel's autotuning off (0 leaves it on)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)


def buffers_of(sock: socket.socket) -> dict[str, int]:
    """What the kernel granted (Linux reports twice the bytes asked, for its bookkeeping)."""
    return {"sndbuf": sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF),
            "rcvbuf": sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)}


def recv_into(sock: socket.socket, view: memoryview, hasher=None) -> None:
    """Fill `view`: one MSG_WAITALL receive (a CHUNK at a time when hashing, so each is in cache)."""
    step = CHUNK if hasher is not None else view.nbytes
    got = 0
    while got < view.nbytes:
        k = sock.recv_into(view[got:got + step], 0, socket.MSG_WAITALL)
        if not k:
            raise PeerFailed(f"connection closed after {got} of {view.nbytes} bytes")
        if hasher is not None:
            hasher.update(view[got:got + k])
        got += k


def send_all(sock: socket.socket, views: list) -> None:
    """sendmsg until every buffer is out (a partial send resumes mid-buffer)."""
    views = [memoryview(v).cast("B") for v in views if len(v)]
    while views:
        sent = sock.sendmsg(views[:_IOV_MAX])
        while views and sent >= views[0].nbytes:
            sent -= views.pop(0).nbytes
        if sent:
            views[0] = views[0][sent:]


def send_hashed(sock: socket.socket, head: bytes, views: list[memoryview]) -> None:
    """The head, the views' bytes a CHUNK at a time each hashed right before it is sent, their xxh3."""
    h = xxhash.xxh3_64()
    batch, size = [head], 0
    for v in views:
        for i in range(0, v.nbytes, CHUNK):
            part = v[i:i + CHUNK]
            h.update(part)
            batch.append(part)
            size += part.nbytes
            if size >= CHUNK:
                send_all(sock, batch)
                batch, size = [], 0
    batch.append(_SUM.pack(h.intdigest()))
    send_all(sock, batch)


def header(op: bytes, verify: bool, spans: list[tuple[int, int]]) -> bytes:
    return _HEAD.pack(op, verify, len(spans)) + b"".join(_SPAN.pack(off, n) for off, n in spans)


class SocketPeer(Peer):
    name = "socket"

    def __init__(self, capacity: int, seed: int, buffer_bytes: int = DEFAULT_BUFFER) -> None:
        super().__init__(capacity, seed, buffer_bytes)
        self.sock = socket.create_connection((HOST, self.address))
        tune(self.sock, buffer_bytes)
        self.buffers = buffers_of(self.sock)

    @staticmethod
    def serve(conn: Connection, capacity: int, seed: int, buffer_bytes: int) -> None:
        try:
            listener = socket.create_server((HOST, 0))
            buf = make_buffer(capacity, seed)
        except Exception as exc:
            answer_error(conn, exc)
            return
        conn.send(("ok", listener.getsockname()[1]))
        threading.Thread(target=SocketPeer._receive, args=(listener, memoryview(buf), buffer_bytes),
                         daemon=True).start()
        answer_control(conn, buf)

    @staticmethod
    def _receive(listener: socket.socket, buf: memoryview, buffer_bytes: int) -> None:
        sock, _ = listener.accept()
        tune(sock, buffer_bytes)
        head = bytearray(_HEAD.size)
        intact = True
        while sock.recv_into(head, _HEAD.size, socket.MSG_WAITALL) == _HEAD.size:
            op, verify, count = _HEAD.unpack(head)
            if op == b"C":
                sock.sendall(b"\x01" if intact else b"\x00")
                intact = True
                continue
            table = bytearray(count * _SPAN.size)
            recv_into(sock, memoryview(table))
            spans = list(_SPAN.iter_unpack(table))
            if op == b"R":
                send_all(sock, [buf[off:off + n] for off, n in spans])
                continue
            h = xxhash.xxh3_64() if verify else None
            for off, n in spans:
                recv_into(sock, buf[off:off + n], h)
            if h is not None:
                sent = bytearray(_SUM.size)
                recv_into(sock, memoryview(sent))
                intact &= _SUM.unpack(sent)[0] == h.intdigest()

    def cases(self, pattern: Pattern, source: np.ndarray, local: np.ndarray) -> list[Case]:
        if pattern.kind == "push":
            return [Case("socket_verified", "xxh3 both ends", self._pusher(pattern, source, True), self),
                    Case("socket", "none", self._pusher(pattern, source, False), self)]
        return [Case("socket_verified", "xxh3 on arrival", self._puller(pattern, local, True), self),
                Case("socket", "none", self._puller(pattern, local, False), self)]

    def _pusher(self, pattern: Pattern, source: np.ndarray, verify: bool):
        src, sock = memoryview(source), self.sock
        writes = [(header(b"W", verify, list(w)), [src[off:off + n] for off, n in w]) for w in pattern.writes]
        done = header(b"C", False, [])

        def run(_expected: list[int]) -> None:
            for head, views in writes:
                if verify:
                    send_hashed(sock, head, views)
                else:
                    send_all(sock, [head, *views])
            sock.sendall(done)
            if sock.recv(1, socket.MSG_WAITALL) != b"\x01":
                raise PeerFailed("socket: the receiver found a write damaged")
        return run

    def _puller(self, pattern: Pattern, local: np.ndarray, verify: bool):
        loc, sock = memoryview(local), self.sock
        head = header(b"R", False, [(off, n) for off, _, n in pattern.reads])
        views = [loc[off:off + n] for _, off, n in pattern.reads]

        def run(expected: list[int]) -> None:
            sock.sendall(head)
            for i, v in enumerate(views):
                recv_into(sock, v)
                if verify and xxhash.xxh3_64_intdigest(v) != expected[i]:  # in cache: it just landed
                    raise PeerFailed(f"socket: block {i} failed its checksum")
        return run

    def close(self) -> None:
        self.sock.close()
        super().close()
