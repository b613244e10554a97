"""The receiving ends of `moonbus bench transfer`, and the cases that send to them.

Every receiver runs in its own process (spawned), so that the GIL never serializes the two ends,
and holds one buffer of `capacity` bytes that starts with the same seeded content as the sender's
source (transfer_patterns.make_buffer). Each peer gives the cases it can run of a pattern
(transfer_patterns.Case):

    ours         Transports("tcp") at both ends (the sender's with `streams` connections per peer; with
                 `tls_dir`, TLS on the link as --link-cert gives it, each end with its certificate
                 from the link CA in that directory: `ours_tcp_tls`),
                 the receiver's buffer a registered region. A push: one `Channel.write` per write of
                 the pattern, then a call that returns once every write landed and its xxh3 was
                 verified (`ours_tcp`, xxh3 both ends: the transport always checks). A pull: one
                 `Channel.read` of the blocks into local slots, then each block's checksum compared
                 with the announced one, as the messenger's pull does (`ours_tcp`, xxh3 on arrival),
                 or not (`ours_tcp_unverified`).
    mooncake     the Mooncake Transfer Engine, protocol "tcp", P2PHANDSHAKE metadata: source and local
                 slots registered at the sender, the buffer at the receiver. A push: every write
                 submitted at once (batch_transfer_async_write), then waited for; a pull: one
                 batch_transfer_sync_read. `mooncake_te` checks nothing; `mooncake_te_verified` does
                 the same work as ours: the sender hashes the bytes, and a completion over a plain
                 socket makes the receiver hash what landed and compare (a pull: the reader hashes).
    socket       the plain-socket baseline (transfer_socket.py).

Control (the receiver's address; "the checksum of these ranges of your buffer"; "stamp your
buffer with run r"; stop) goes over a multiprocessing pipe, never timed. (The Mooncake engine logs
its handshakes to stderr through glog, which neither GLOG_minloglevel nor its MC_* variables quiet:
the report goes to stdout.)
"""

from __future__ import annotations

import multiprocessing
import socket
import struct
import threading
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np
import xxhash

from common.kv import blocks as kvblocks
from tools.moonbus.bench.transfer_patterns import Case, Pattern, digest, make_buffer, stamp

HOST = "127.0.0.1"
_SPAWN = multiprocessing.get_context("spawn")
_NOTE = struct.Struct("<IQ")  # mooncake_te_verified's completion: count of ranges, their xxh3; then the ranges
_SPAN = struct.Struct("<QQ")


class PeerFailed(RuntimeError):
    """Raised when a receiving process cannot start, or a transfer to it fails or arrives damaged."""


def mooncake_missing() -> str:
    """Why the Mooncake Transfer Engine cannot be used here ('' when it can)."""
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except (ImportError, OSError) as exc:  # not installed, or its native libraries do not load
        return f"not installed ({exc})"
    return ""


class Peer:
    """A receiving process with a `capacity`-byte buffer, and the sending side of its cases."""

    name = ""
    serve = None  # the receiver's entry point: fn(conn, capacity, seed, *extra)

    def __init__(self, capacity: int, seed: int, *extra) -> None:
        self._conn, child = _SPAWN.Pipe()
        self._proc = _SPAWN.Process(target=type(self).serve, args=(child, capacity, seed, *extra), daemon=True,
                                    name=f"bench-transfer-{self.name}")
        self._proc.start()
        child.close()
        self.address = self.ask(None)  # what the receiver says once it is ready

    def ask(self, command):
        if command is not None:
            self._conn.send(command)
        if not self._conn.poll(120):
            raise PeerFailed(f"{self.name}: the receiving process did not answer")
        kind, value = self._conn.recv()
        if kind == "error":
            raise PeerFailed(f"{self.name}: the receiving process failed: {value}")
        return value

    def cases(self, pattern: Pattern, source: np.ndarray, local: np.ndarray) -> list[Case]:
        """The cases this peer runs of `pattern` (none: it has no such transfer)."""
        raise NotImplementedError

    def digest(self, ranges: list[tuple[int, int]]) -> int:
        """xxh3-64 of these ranges of the receiver's buffer, computed by the receiver."""
        return self.ask(("digest", ranges))

    def stamp(self, run: int) -> None:
        self.ask(("stamp", run))

    def close(self) -> None:
        try:
            self._conn.send(("stop", 0))
        except OSError:
            pass
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()


def answer_control(conn: Connection, buf: np.ndarray) -> None:
    """The receiver's control loop, until told to stop."""
    while True:
        op, arg = conn.recv()
        if op == "stop":
            return
        if op == "digest":
            conn.send(("ok", digest(buf, arg)))
        elif op == "stamp":
            stamp(buf, arg)
            conn.send(("ok", None))


def answer_error(conn: Connection, exc: BaseException) -> None:
    conn.send(("error", f"{type(exc).__name__}: {exc}"))


def check_blocks(views: list[memoryview], expected: list[int], case: str) -> None:
    """A pull's check: each block against the checksum its source announced."""
    for i, (v, e) in enumerate(zip(views, expected)):
        if kvblocks.checksum(v) != e:
            raise PeerFailed(f"{case}: block {i} failed its checksum")


# --- ours: common/transport over tcp ------------------------------------------------------------
def link_tls_of(tls_dir: str, name: str):
    """`name`'s link TLS contexts from the link CA in `tls_dir` (None without one)."""
    if not tls_dir:
        return None
    from common.security import link_tls
    from tools.moonbus.cluster import certs

    return link_tls(certs.ensure_cert(Path(tls_dir), name), certs.ca_file(Path(tls_dir)))


class OursPeer(Peer):
    name = "ours_tcp"

    def __init__(self, capacity: int, seed: int, secret: bytes, streams: int = 1, tls_dir: str = "") -> None:
        from common.transport import Transports
        from schemas.transfer import RegionRef

        self.name = self.case_for(streams) + ("_tls" if tls_dir else "")
        self.streams = streams
        super().__init__(capacity, seed, secret, tls_dir)
        self.ref = RegionRef.from_bytes(self.address)
        self.transports = Transports("tcp", secret, tcp_streams=streams, tls=link_tls_of(tls_dir, "sender"))
        self.channel = self.transports.connect(self.ref.endpoints)

    @staticmethod
    def case_for(streams: int) -> str:
        return "ours_tcp" if streams == 1 else f"ours_tcp_x{streams}"

    @staticmethod
    def serve(conn: Connection, capacity: int, seed: int, secret: bytes, tls_dir: str = "") -> None:
        from common.transport import Transports

        try:
            transports = Transports("tcp", secret, tls=link_tls_of(tls_dir, "receiver"))
            transports.listen(HOST)
            buf = make_buffer(capacity, seed)
            transports.handle("landed", lambda body, peer: b"")  # a call runs after the writes before it
            ref = transports.register("bench", buf)
        except Exception as exc:
            answer_error(conn, exc)
            return
        conn.send(("ok", ref.to_bytes()))
        try:
            answer_control(conn, buf)
        finally:
            transports.close()

    def cases(self, pattern: Pattern, source: np.ndarray, local: np.ndarray) -> list[Case]:
        channel, ref = self.channel, self.ref
        if pattern.kind == "push":
            src = memoryview(source)
            writes = [[(off, src[off:off + n]) for off, n in w] for w in pattern.writes]
            metas = pattern.metas or (None,) * len(writes)

            def push(_expected: list[int]) -> None:
                for pieces, m in zip(writes, metas):
                    channel.write(ref, pieces, m)
                channel.call("landed")
            return [Case(self.name, "xxh3 both ends", push, self)]
        if self.streams > 1:
            return []  # a read is not striped: the same as one connection's
        loc = memoryview(local)
        pieces = [(off, loc[lo:lo + n]) for off, lo, n in pattern.reads]
        views = [v for _, v in pieces]

        def pull(expected: list[int]) -> None:
            channel.read(ref, pieces)
            check_blocks(views, expected, self.name)
        return [Case(self.name, "xxh3 on arrival", pull, self),
                Case(f"{self.name}_unverified", "none", lambda _expected: channel.read(ref, pieces), self)]

    def close(self) -> None:
        self.channel.close()
        self.transports.close()
        super().close()


# --- the Mooncake Transfer Engine, tcp ----------------------------------------------------------
class MooncakePeer(Peer):
    name = "mooncake_te"

    def __init__(self, capacity: int, seed: int, source: np.ndarray, local: np.ndarray) -> None:
        from mooncake.engine import TransferEngine

        super().__init__(capacity, seed)
        self.session, self.dest_ptr, notify_port = self.address
        self.engine = TransferEngine()
        if self.engine.initialize(HOST, "P2PHANDSHAKE", "tcp", "") != 0:
            raise PeerFailed("mooncake_te: the sender's engine did not initialize")
        self.registered = [a for a in (source, local) if a.nbytes]
        for a in self.registered:
            if self.engine.register_memory(a.ctypes.data, a.nbytes) != 0:
                raise PeerFailed("mooncake_te: a sender buffer could not be registered")
        self.notify = socket.create_connection((HOST, notify_port))
        self.notify.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    @staticmethod
    def serve(conn: Connection, capacity: int, seed: int) -> None:
        try:
            from mooncake.engine import TransferEngine

            engine = TransferEngine()
            if engine.initialize(HOST, "P2PHANDSHAKE", "tcp", "") != 0:
                raise PeerFailed("the engine did not initialize")
            buf = make_buffer(capacity, seed)
            if engine.register_memory(buf.ctypes.data, capacity) != 0:
                raise PeerFailed("the buffer could not be registered")
            listener = socket.create_server((HOST, 0))
        except Exception as exc:
            answer_error(conn, exc)
            return
        threading.Thread(target=MooncakePeer._verify, args=(listener, buf), daemon=True).start()
        conn.send(("ok", (f"{HOST}:{engine.get_rpc_port()}", buf.ctypes.data, listener.getsockname()[1])))
        answer_control(conn, buf)

    @staticmethod
    def _verify(listener: socket.socket, buf: np.ndarray) -> None:
        """mooncake_te_verified's completions: hash the ranges that landed, answer whether they match."""
        sock, _ = listener.accept()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while head := sock.recv(_NOTE.size, socket.MSG_WAITALL):
            count, expected = _NOTE.unpack(head)
            spans = list(_SPAN.iter_unpack(sock.recv(count * _SPAN.size, socket.MSG_WAITALL)))
            sock.sendall(b"\x01" if digest(buf, spans) == expected else b"\x00")

    def cases(self, pattern: Pattern, source: np.ndarray, local: np.ndarray) -> list[Case]:
        engine, session, dest = self.engine, self.session, self.dest_ptr
        if pattern.kind == "pull":
            base, loc = local.ctypes.data, memoryview(local)
            mine = [base + lo for _, lo, _ in pattern.reads]
            theirs = [dest + off for off, _, _ in pattern.reads]
            lens = [n for _, _, n in pattern.reads]
            views = [loc[lo:lo + n] for _, lo, n in pattern.reads]

            def pull(expected: list[int], verify: bool) -> None:
                if engine.batch_transfer_sync_read(session, mine, theirs, lens) != 0:
                    raise PeerFailed(f"mooncake_te: batch_transfer_sync_read of {len(lens)} blocks failed")
                if verify:
                    check_blocks(views, expected, "mooncake_te_verified")
            return [Case("mooncake_te_verified", "xxh3 on arrival", lambda e: pull(e, True), self),
                    Case("mooncake_te", "none", lambda e: pull(e, False), self)]
        base, src = source.ctypes.data, memoryview(source)
        writes = [([base + off for off, _ in w], [dest + off for off, _ in w], [n for _, n in w]) for w in pattern.writes]
        spans = pattern.peer_ranges
        note = b"".join(_SPAN.pack(off, n) for off, n in spans)
        views = [src[off:off + n] for off, n in spans]

        def push(_expected: list[int], verify: bool) -> None:
            if verify:
                h = xxhash.xxh3_64()
                for v in views:
                    h.update(v)
            batches = [engine.batch_transfer_async_write(session, *w) for w in writes]  # back to back
            if min(batches) < 0 or engine.get_batch_transfer_status(batches) != 0:
                raise PeerFailed(f"mooncake_te: {len(writes)} batch writes did not all complete")
            if verify:
                self.notify.sendall(_NOTE.pack(len(spans), h.intdigest()) + note)
                if self.notify.recv(1, socket.MSG_WAITALL) != b"\x01":
                    raise PeerFailed("mooncake_te_verified: the receiver found the bytes damaged")
        return [Case("mooncake_te_verified", "xxh3 both ends", lambda e: push(e, True), self),
                Case("mooncake_te", "none", lambda e: push(e, False), self)]

    def close(self) -> None:
        self.notify.close()
        for a in self.registered:
            self.engine.unregister_memory(a.ctypes.data)
        super().close()
