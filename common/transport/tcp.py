"""The TCP backend: one-sided writes and reads emulated over a stream, at close to socket speed.

A connection first proves that both ends hold the cluster secret (when the cluster has one):

    server -> 16-byte nonce S
    client -> 16-byte nonce C, HMAC(secret, "client" | S)
    server -> HMAC(secret, "server" | C)              (each side checks the other's proof)

then carries requests from the connecting side, each `[1-byte op][4-byte big-endian length][JSON
header]` (schemas.transfer) and its payload:

    b"W" write  WriteFrame, then the pieces' bytes in order, then their xxh3-64 (8 bytes, big-endian)
                                                                   -> no answer (one-sided)
    b"R" read   ReadFrame                                          -> ReplyFrame, then the bytes
    b"C" call   CallFrame, then its body                           -> ReplyFrame, then the reply body

A failed write (unknown region, out of bounds, checksum mismatch, refused by its owner) has its
payload drained, so that framing holds, and fails the next call on the connection. Every read of
a frame has a deadline (`Transports.timeout_s`): a silent peer cannot hold a connection, or a
region, open. At most MAX_CONNECTIONS are served at once; more are closed at once.

Speed (measured by `moonbus bench transfer`): each connection is served by its own thread on a
blocking socket (deadlines by SO_RCVTIMEO/SO_SNDTIMEO, see `tune`), receiving with recv_into
straight into the region and hashing each part as it lands, while it is in cache; the sender
hashes CHUNK-sized parts and sends them with sendmsg of memoryviews of the source (no
concatenation, no intermediate bytes). asyncio's StreamReader, the
link before this one, copied every payload twice (readexactly into bytes, then into a file) and
moved 0.35 GiB/s where a plain socket moved 2.6.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
from typing import Sequence

import xxhash

from common.security import LINK_NONCE_BYTES, link_proof, proofs_match
from common.transport import Backend, Channel, Peer, Pieces, Region, TransportError, TransportRefused
from schemas.codec import WireError
from schemas.transfer import CallFrame, ReadFrame, RegionRef, ReplyFrame, WriteFrame

log = logging.getLogger(__name__)

OP_WRITE, OP_READ, OP_CALL = b"W", b"R", b"C"
MAX_HEADER = 1 << 20  # a header is a little JSON: a bigger one is an attack or a bug
MAX_CONNECTIONS = 64
CHUNK = 1 << 20  # bytes hashed and sent (or received and hashed) at a time: they stay in cache
# SO_SNDBUF / SO_RCVBUF; 0 = leave them to the kernel's autotuning, which grows them up to
# net.ipv4.tcp_[rw]mem's maximum (32 MiB here), beyond what setsockopt may ask (net.core.[rw]mem_max,
# 4 MiB here): measured, a fixed 4 MiB moved less and cost the receiver more CPU per byte
SOCKET_BUFFER = 0
HANDSHAKE_TIMEOUT_S = 10.0
_PROOF_BYTES = 32
_LEN = struct.Struct(">I")
_SUM = struct.Struct(">Q")
_IOV_MAX = 512


def tune(sock: socket.socket, deadline_s: float) -> None:
    """No Nagle wait, buffers (see SOCKET_BUFFER), and a deadline on every read and send.

    NOTE: the deadline is the kernel's (SO_RCVTIMEO / SO_SNDTIMEO) on a blocking socket, not
    Python's settimeout, which makes the socket non-blocking underneath: then every recv returns
    what has arrived so far and every send what fits, and the extra wakeups and polls cost more
    CPU per byte than the copy itself (measured: twice the receiver's CPU)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # calls and replies are small
    if SOCKET_BUFFER:
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER)
    set_deadline(sock, deadline_s)


def set_deadline(sock: socket.socket, seconds: float) -> None:
    sock.settimeout(None)
    timeval = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)


def deadline_of(sock: socket.socket) -> float:
    sec, usec = struct.unpack("ll", sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, 16))
    return sec + usec / 1e6


def recv_into(sock: socket.socket, buf: memoryview, hasher=None) -> None:
    """Fill `buf` exactly, hashing each part as it arrives (in cache) when given a hasher."""
    got, n = 0, buf.nbytes
    while got < n:
        try:
            k = sock.recv_into(buf[got:] if got else buf)
        except BlockingIOError as exc:  # SO_RCVTIMEO: the read deadline
            raise TransportError(f"peer sent nothing for {deadline_of(sock):g} s") from exc
        except OSError as exc:
            raise TransportError(f"connection broke: {exc}") from exc
        if not k:
            raise TransportError(f"peer closed the connection after {got} of {n} bytes")
        if hasher is not None:
            hasher.update(buf[got:got + k])
        got += k


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_into(sock, memoryview(buf))
    return bytes(buf)


def send_all(sock: socket.socket, bufs: list) -> None:
    """sendmsg until every buffer is out (a partial send resumes mid-buffer; no concatenation)."""
    views = [memoryview(b).cast("B") for b in bufs]
    views = [v for v in views if v.nbytes]
    try:
        while views:
            sent = sock.sendmsg(views[:_IOV_MAX])
            i = 0
            while i < len(views) and sent >= views[i].nbytes:
                sent -= views[i].nbytes
                i += 1
            views = views[i:]
            if sent:
                views[0] = views[0][sent:]
    except BlockingIOError as exc:  # SO_SNDTIMEO: the send deadline
        raise TransportError(f"peer took nothing for {deadline_of(sock):g} s") from exc
    except OSError as exc:
        raise TransportError(f"connection broke: {exc}") from exc


def frame(op: bytes, header: bytes) -> bytes:
    return op + _LEN.pack(len(header)) + header


def read_header(sock: socket.socket) -> bytes:
    (size,) = _LEN.unpack(recv_exactly(sock, _LEN.size))
    if size > MAX_HEADER:
        raise TransportError(f"header of {size} bytes is larger than {MAX_HEADER}")
    return recv_exactly(sock, size)


def _parts(views: Sequence[memoryview]):
    """CHUNK-sized parts of each view, in order."""
    for v in views:
        for i in range(0, v.nbytes, CHUNK):
            yield v[i:i + CHUNK] if v.nbytes > CHUNK else v


# --- the handshake ------------------------------------------------------------------------------
def server_handshake(sock: socket.socket, secret: bytes | None) -> None:
    """The accepting side: challenge the peer, then prove ourselves (no secret: nothing to do)."""
    if secret is None:
        return
    nonce = os.urandom(LINK_NONCE_BYTES)
    send_all(sock, [nonce])
    answer = recv_exactly(sock, LINK_NONCE_BYTES + _PROOF_BYTES)
    client_nonce, proof = answer[:LINK_NONCE_BYTES], answer[LINK_NONCE_BYTES:]
    if not proofs_match(link_proof(secret, nonce, b"client"), proof):
        raise TransportRefused("the peer does not hold the cluster secret")
    send_all(sock, [link_proof(secret, client_nonce, b"server")])


def client_handshake(sock: socket.socket, secret: bytes | None) -> None:
    if secret is None:
        return
    server_nonce = recv_exactly(sock, LINK_NONCE_BYTES)
    nonce = os.urandom(LINK_NONCE_BYTES)
    send_all(sock, [nonce + link_proof(secret, server_nonce, b"client")])
    if not proofs_match(link_proof(secret, nonce, b"server"), recv_exactly(sock, _PROOF_BYTES)):
        raise TransportRefused("the listener does not hold the cluster secret")


# --- the connecting side ------------------------------------------------------------------------
class TcpChannel(Channel):
    transport = "tcp"

    def __init__(self, locator: str, secret: bytes | None, timeout_s: float) -> None:
        host, _, port = locator.rpartition(":")
        try:
            self.sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        except (OSError, ValueError) as exc:
            raise TransportError(f"cannot connect to {locator}: {exc}") from exc
        self.locator = locator
        try:
            tune(self.sock, min(timeout_s, HANDSHAKE_TIMEOUT_S))
            client_handshake(self.sock, secret)
            set_deadline(self.sock, timeout_s)
        except BaseException:
            self.sock.close()
            raise

    def write(self, dest: RegionRef, pieces: Pieces, meta: dict | None = None) -> None:
        views = [memoryview(b).cast("B") for _, b in pieces]
        header = WriteFrame(dest.region, [[off, v.nbytes] for (off, _), v in zip(pieces, views)], meta or {})
        h = xxhash.xxh3_64()
        batch: list = [frame(OP_WRITE, header.to_bytes())]
        size = 0
        for part in _parts(views):
            h.update(part)  # NOTE: hashed right before it is sent, while it is in cache
            batch.append(part)
            size += part.nbytes
            if size >= CHUNK:
                send_all(self.sock, batch)
                batch, size = [], 0
        batch.append(_SUM.pack(h.intdigest()))
        send_all(self.sock, batch)

    def read(self, src: RegionRef, pieces: Pieces) -> None:
        views = [memoryview(b).cast("B") for _, b in pieces]
        header = ReadFrame(src.region, [[off, v.nbytes] for (off, _), v in zip(pieces, views)])
        send_all(self.sock, [frame(OP_READ, header.to_bytes())])
        self._reply()
        for v in views:
            recv_into(self.sock, v)

    def call(self, op: str, body: bytes = b"") -> bytes:
        send_all(self.sock, [frame(OP_CALL, CallFrame(op, len(body)).to_bytes()), body])
        reply = self._reply()
        return recv_exactly(self.sock, reply.nbytes)

    def _reply(self) -> ReplyFrame:
        try:
            reply = ReplyFrame.from_bytes(read_header(self.sock))
        except WireError as exc:
            raise TransportError(f"{self.locator} answered something else: {exc}") from exc
        if not reply.ok:
            raise TransportError(f"{self.locator}: {reply.error}")
        return reply

    def close(self) -> None:
        self.sock.close()


# --- the accepting side -------------------------------------------------------------------------
class TcpBackend(Backend):
    name = "tcp"

    def __init__(self, transports) -> None:
        super().__init__(transports)
        self._locator = ""
        self._listener: socket.socket | None = None
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    @property
    def locator(self) -> str:
        return self._locator

    def listen(self, host: str, port: int, advertise: str = "") -> str:
        sock = socket.create_server((host, port), backlog=128)
        self._listener = sock
        self._locator = f"{advertise or host}:{sock.getsockname()[1]}"
        threading.Thread(target=self._accept_loop, args=(sock,), name=f"tcp-accept-{self._locator}", daemon=True).start()
        return self._locator

    def connect(self, locator: str, timeout_s: float) -> Channel:
        return TcpChannel(locator, self.transports.secret, timeout_s)

    def close(self) -> None:
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() of the accepting thread
            except OSError:
                pass
            self._listener.close()
            self._listener = None

    def _accept_loop(self, listener: socket.socket) -> None:
        while True:
            try:
                sock, addr = listener.accept()
            except OSError:
                return  # closed
            if not self._slots.acquire(blocking=False):  # at the limit: refuse rather than queue
                log.warning("connection from %s refused: %d connections already open", addr, MAX_CONNECTIONS)
                sock.close()
                continue
            threading.Thread(target=self._serve, args=(sock, addr), name=f"tcp-peer-{addr[0]}:{addr[1]}",
                             daemon=True).start()

    def _serve(self, sock: socket.socket, addr) -> None:
        peer = Peer(f"{addr[0]}:{addr[1]}")
        t = self.transports
        try:
            tune(sock, HANDSHAKE_TIMEOUT_S)
            server_handshake(sock, t.secret)
            set_deadline(sock, t.timeout_s)
            _Connection(self, sock, peer).run()
        except TransportRefused as exc:
            log.warning("connection from %s refused: %s", peer.name, exc)
            if t.on_refused is not None:
                t.on_refused(peer.name, str(exc))
        except (TransportError, WireError, ValueError, OSError) as exc:  # a broken peer or a malformed frame
            log.warning("connection from %s broke: %s", peer.name, exc)
        except Exception:
            log.exception("connection from %s failed", peer.name)
        finally:
            sock.close()
            peer.closed()
            self._slots.release()


class _Connection:
    """One accepted connection's requests, served in order on its thread."""

    def __init__(self, backend: TcpBackend, sock: socket.socket, peer: Peer) -> None:
        self.transports = backend.transports
        self.sock = sock
        self.peer = peer
        self.failed = ""  # the first failed write since the last call: the next call reports it
        self._scratch = memoryview(bytearray(CHUNK))

    def run(self) -> None:
        ops = {OP_WRITE: self.write, OP_READ: self.read, OP_CALL: self.call}
        while True:
            try:
                op = self.sock.recv(1)
            except BlockingIOError:
                return  # idle past the deadline: the peer connects again when it has something to send
            if not op:
                return  # the peer is done
            handler = ops.get(op)
            if handler is None:
                raise TransportError(f"unknown op {op!r}")
            handler(read_header(self.sock))

    def write(self, header: bytes) -> None:
        req = WriteFrame.from_bytes(header)
        region = self.transports.region(req.region)
        total = sum(n for _, n in req.pieces)
        spans = [(off, n) for off, n in req.pieces]
        error = ""
        if region is None:
            error = f"no region {req.region}"
        elif not region.writable:
            error = f"region {req.region} is read-only"
        else:
            error = region.bounds_error(spans)
        if error or not region.enter():
            self.drain(total + _SUM.size)
            self.fail(region, req.meta, spans, error or f"region {req.region} is being unregistered")
            return
        try:
            h = xxhash.xxh3_64()
            for off, n in spans:
                with region.buf[off: off + n] as part:
                    recv_into(self.sock, part, h)  # NOTE: each part hashed as it lands, while in cache
            (expected,) = _SUM.unpack(recv_exactly(self.sock, _SUM.size))
            if h.intdigest() != expected:
                self.fail(region, req.meta, spans, f"write {req.meta or ''} to region {req.region} failed its "
                                                   f"checksum ({total} bytes)")
            elif region.on_write is not None:
                try:
                    region.on_write(req.meta, spans, None)
                except Exception as exc:  # refused by the owner (e.g. a slice that does not belong)
                    self.fail(None, req.meta, spans, f"region {req.region} refused write {req.meta}: {exc}")
        finally:
            region.leave()

    def fail(self, region: Region | None, meta: dict, spans: list, error: str) -> None:
        log.warning("from %s: %s", self.peer.name, error)
        self.failed = self.failed or error
        if region is not None and region.on_write is not None:
            try:
                region.on_write(meta, spans, error)
            except Exception:
                log.exception("region %s: on_write failed on a failed write", region.id)

    def drain(self, n: int) -> None:
        while n:
            k = min(n, self._scratch.nbytes)
            recv_into(self.sock, self._scratch[:k])
            n -= k

    def read(self, header: bytes) -> None:
        req = ReadFrame.from_bytes(header)
        region = self.transports.region(req.region)
        spans = [(off, n) for off, n in req.pieces]
        error = f"no region {req.region}" if region is None else region.bounds_error(spans)
        if error or not region.enter():
            send_all(self.sock, [_reply_bytes(ReplyFrame(False, error or f"region {req.region} is gone"))])
            return
        try:
            send_all(self.sock, [_reply_bytes(ReplyFrame(True, nbytes=sum(n for _, n in spans)))])
            for off, n in spans:
                with region.buf[off: off + n] as view:
                    send_all(self.sock, [view])
        finally:
            region.leave()

    def call(self, header: bytes) -> None:
        req = CallFrame.from_bytes(header)
        body = recv_exactly(self.sock, req.nbytes)
        handler = self.transports.handlers.get(req.op)
        if self.failed:
            reply, out = ReplyFrame(False, f"an earlier write failed: {self.failed}"), b""
            self.failed = ""
        elif handler is None:
            reply, out = ReplyFrame(False, f"no handler for {req.op!r}"), b""
        else:
            try:
                out = handler(body, self.peer)
                reply = ReplyFrame(True, nbytes=len(out))
            except Exception as exc:  # answered, never a hang
                log.warning("call %s from %s failed: %r", req.op, self.peer.name, exc)
                reply, out = ReplyFrame(False, f"{type(exc).__name__}: {exc}"), b""
        send_all(self.sock, [_reply_bytes(reply), out])


def _reply_bytes(reply: ReplyFrame) -> bytes:
    body = reply.to_bytes()
    return _LEN.pack(len(body)) + body
