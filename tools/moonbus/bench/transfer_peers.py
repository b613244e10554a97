"""The two ends of each `moonbus bench transfer` case: a receiving process, and how to send to it.

Every receiver runs in its own process (spawned), so that the GIL never serializes the two ends,
and holds one preallocated buffer of `capacity` bytes; the sender, in the bench's process, puts
the first n bytes of its source at offset 0 and returns once they are at the destination:

    ours      Transports("tcp") on both ends (the sender's with `streams` connections per peer):
              the region registered by the receiver, written by the sender with `Channel.write`, then a call (ordered after the write: its handler
              runs once the bytes have landed and their xxh3 was verified)
    raw       a plain blocking socket: sendall of an 8-byte length and the bytes; the receiver
              recv_into's them into its buffer and answers one byte
    mooncake  the Mooncake Transfer Engine, protocol "tcp", P2PHANDSHAKE metadata: the receiver
              registers its buffer, the sender `transfer_sync_write`s from its registered source

Control (the receiver's address, "what is the checksum of your first n bytes", stop) goes over a
multiprocessing pipe, never timed. Each peer's `digest(n)` is how the bench proves that every
byte arrived intact. (The Mooncake engine logs its handshakes to stderr through glog, which
neither GLOG_minloglevel nor its MC_* variables quiet: the report goes to stdout.)
"""

from __future__ import annotations

import multiprocessing
import socket
import struct
import threading
from multiprocessing.connection import Connection

import numpy as np
import xxhash

HOST = "127.0.0.1"
_LEN = struct.Struct(">Q")
_SPAWN = multiprocessing.get_context("spawn")


class PeerFailed(RuntimeError):
    """Raised when a receiving process cannot start, or a transfer to it fails."""


def mooncake_missing() -> str:
    """Why the Mooncake Transfer Engine cannot be used here ('' when it can)."""
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except (ImportError, OSError) as exc:  # not installed, or its native libraries do not load
        return f"not installed ({exc})"
    return ""


class Peer:
    """A receiving process with a `capacity`-byte buffer, and the sending side of one case."""

    case = ""
    serve = None  # the receiver's entry point: fn(conn, capacity, *extra)

    def __init__(self, capacity: int, *extra) -> None:
        self._conn, child = _SPAWN.Pipe()
        self._proc = _SPAWN.Process(target=type(self).serve, args=(child, capacity, *extra), daemon=True,
                                    name=f"bench-transfer-{self.case}")
        self._proc.start()
        child.close()
        self.address = self.ask(None)  # what the receiver says once it is ready

    def ask(self, command):
        if command is not None:
            self._conn.send(command)
        if not self._conn.poll(120):
            raise PeerFailed(f"{self.case}: the receiving process did not answer")
        kind, value = self._conn.recv()
        if kind == "error":
            raise PeerFailed(f"{self.case}: the receiving process failed: {value}")
        return value

    def send(self, src: memoryview) -> None:
        """Put `src` at offset 0 of the receiver's buffer; return once it is there."""
        raise NotImplementedError

    def digest(self, nbytes: int) -> int:
        """xxh3-64 of the receiver's first `nbytes`, computed by the receiver."""
        return self.ask(("digest", nbytes))

    def close(self) -> None:
        try:
            self._conn.send(("stop", 0))
        except OSError:
            pass
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()


def _answer_digests(conn: Connection, buf) -> None:
    """The receiver's control loop: answer checksums of its buffer until told to stop."""
    view = memoryview(buf).cast("B")
    while True:
        op, n = conn.recv()
        if op == "stop":
            return
        conn.send(("ok", xxhash.xxh3_64_intdigest(view[:n])))


def answer_error(conn: Connection, exc: BaseException) -> None:
    conn.send(("error", f"{type(exc).__name__}: {exc}"))


# --- ours: common/transport over tcp ------------------------------------------------------------
class OursPeer(Peer):
    case = "ours_tcp"

    def __init__(self, capacity: int, secret: bytes, streams: int = 1) -> None:
        from common.transport import Transports
        from schemas.transfer import RegionRef

        self.case = self.case_for(streams)
        super().__init__(capacity, secret)
        self.ref = RegionRef.from_bytes(self.address)
        self.transports = Transports("tcp", secret, tcp_streams=streams)
        self.channel = self.transports.connect(self.ref.endpoints)

    @staticmethod
    def case_for(streams: int) -> str:
        return "ours_tcp" if streams == 1 else f"ours_tcp_x{streams}"

    @staticmethod
    def serve(conn: Connection, capacity: int, secret: bytes) -> None:
        from common.transport import Transports

        try:
            transports = Transports("tcp", secret)
            transports.listen(HOST)
            buf = bytearray(capacity)
            transports.handle("landed", lambda body, peer: b"")  # a call runs after the writes before it
            ref = transports.register("bench", buf)
        except Exception as exc:
            answer_error(conn, exc)
            return
        conn.send(("ok", ref.to_bytes()))
        try:
            _answer_digests(conn, buf)
        finally:
            transports.close()

    def send(self, src: memoryview) -> None:
        self.channel.write(self.ref, [(0, src)])
        self.channel.call("landed")

    def close(self) -> None:
        self.channel.close()
        self.transports.close()
        super().close()


# --- the baseline: a plain blocking socket ------------------------------------------------------
class RawSocketPeer(Peer):
    case = "raw_socket"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.sock = socket.create_connection((HOST, self.address))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # the length and the ack are small

    @staticmethod
    def serve(conn: Connection, capacity: int) -> None:
        try:
            listener = socket.create_server((HOST, 0))
            buf = bytearray(capacity)
        except Exception as exc:
            answer_error(conn, exc)
            return
        conn.send(("ok", listener.getsockname()[1]))
        threading.Thread(target=RawSocketPeer._receive, args=(listener, memoryview(buf)), daemon=True).start()
        _answer_digests(conn, buf)

    @staticmethod
    def _receive(listener: socket.socket, buf: memoryview) -> None:
        sock, _ = listener.accept()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        header = bytearray(_LEN.size)
        while True:
            if not _recv_exactly(sock, memoryview(header)):
                return
            (n,) = _LEN.unpack(header)
            if not _recv_exactly(sock, buf[:n]):
                return
            sock.sendall(b"\x01")

    def send(self, src: memoryview) -> None:
        self.sock.sendall(_LEN.pack(src.nbytes))
        self.sock.sendall(src)
        if self.sock.recv(1) != b"\x01":
            raise PeerFailed("raw_socket: the receiver closed the connection")

    def close(self) -> None:
        self.sock.close()
        super().close()


def _recv_exactly(sock: socket.socket, view: memoryview) -> bool:
    got = 0
    while got < view.nbytes:
        k = sock.recv_into(view[got:])
        if not k:
            return False
        got += k
    return True


# --- the Mooncake Transfer Engine, tcp ----------------------------------------------------------
class MooncakePeer(Peer):
    case = "mooncake_te"

    def __init__(self, capacity: int, source: np.ndarray) -> None:
        from mooncake.engine import TransferEngine

        super().__init__(capacity)
        self.session, self.dest_ptr = self.address
        self.engine = TransferEngine()
        if self.engine.initialize(HOST, "P2PHANDSHAKE", "tcp", "") != 0:
            raise PeerFailed("mooncake_te: the sender's engine did not initialize")
        self.source = source
        if self.engine.register_memory(source.ctypes.data, source.nbytes) != 0:
            raise PeerFailed("mooncake_te: the source buffer could not be registered")

    @staticmethod
    def serve(conn: Connection, capacity: int) -> None:
        try:
            from mooncake.engine import TransferEngine

            engine = TransferEngine()
            if engine.initialize(HOST, "P2PHANDSHAKE", "tcp", "") != 0:
                raise PeerFailed("the engine did not initialize")
            buf = np.zeros(capacity, np.uint8)
            if engine.register_memory(buf.ctypes.data, capacity) != 0:
                raise PeerFailed("the buffer could not be registered")
        except Exception as exc:
            answer_error(conn, exc)
            return
        conn.send(("ok", (f"{HOST}:{engine.get_rpc_port()}", buf.ctypes.data)))
        _answer_digests(conn, buf)

    def send(self, src: memoryview) -> None:
        # NOTE: src must be a prefix of the registered source: the engine moves registered memory
        rc = self.engine.transfer_sync_write(self.session, self.source.ctypes.data, self.dest_ptr, src.nbytes)
        if rc != 0:
            raise PeerFailed(f"mooncake_te: transfer_sync_write of {src.nbytes} bytes returned {rc}")

    def close(self) -> None:
        self.engine.unregister_memory(self.source.ctypes.data)
        super().close()
