"""The TCP backend: one-sided writes and reads emulated over a stream, at close to socket speed.

A connection first proves that both ends hold the cluster secret (when the cluster has one):

    server -> 16-byte nonce S
    client -> 16-byte nonce C, HMAC(secret, "client" | S)
    server -> HMAC(secret, "server" | C)              (each side checks the other's proof)

With TLS (`Transports.tls`, `--link-cert` and `--link-ca`: common.security.link_tls), the
connection is a TLS 1.3 session first, both ends showing a certificate of the cluster's link CA,
and everything above travels inside it, encrypted and authenticated. The handshake above still
runs, so a link needs both the cluster secret and a certificate.

The connection then carries requests from the connecting side, each `[1-byte op][4-byte big-endian length][JSON
header]` (schemas.transfer) and its payload:

    b"W" write  WriteFrame, then the pieces' bytes in order, then their xxh3-64 (8 bytes, big-endian)
                                                                   -> no answer (one-sided)
    b"R" read   ReadFrame                                          -> ReplyFrame, then the bytes
    b"C" call   CallFrame, then its body                           -> ReplyFrame, then the reply body

A failed write (unknown region, out of bounds, checksum mismatch, refused by its owner) has its
payload drained, so that framing holds, and fails the next call on the connection.

Several connections per peer (`Transports.tcp_streams`), for links that one connection's core or
window cannot fill: a write of `tcp_stripe_min` bytes or more is cut into parts of about equal
bytes (at least half that each), sent at once, one per connection, each a write frame of its
own (own checksum) naming the write's group and its number of parts; the listener hands the
owner the write's own pieces once every part landed (`_Groups`), or its first failure at once. A
call then follows a FENCE on each other connection written since the last call, so a call still
runs after every write before it. Every read of
a frame has a deadline (`Transports.timeout_s`): a silent peer cannot hold a connection, or a
region, open. At most MAX_CONNECTIONS proven peers' connections are served at once; more are
closed at once.

The door (`_Door`): a connection that has not proven the cluster secret yet holds no connection
slot. It has HANDSHAKE_TIMEOUT_S to prove it, and at most MAX_HANDSHAKES such connections wait at
once, MAX_HANDSHAKES_PER_ADDRESS of them from one address; more are closed at once. So a stranger
who only reaches the port can neither hold the slots proven peers use nor, from one address, the
handshakes of peers at other addresses (from one address, it delays them by at most
HANDSHAKE_TIMEOUT_S per attempt). Where the cluster lists its members' addresses (`Transports.allow`,
--link-peers), a connection from any other is closed at accept, before it reads a byte or takes a
handshake's place. Refusals are counted (`TcpBackend.refused`, by reason), logged at
most once per source network every REFUSAL_LOG_S and for at most a few sources in that time, with
the counts not logged since (common/transport/refusals.py: a stranger with many addresses cannot
flood the log), and reported to `on_refused`.

Speed (measured by `moonbus bench transfer`): each connection is served by its own thread on a
blocking socket (deadlines by SO_RCVTIMEO/SO_SNDTIMEO, see `tune`), receiving with recv_into
straight into the region, CHUNK bytes per call (MSG_WAITALL: one wakeup each), and hashing each
part as it lands, while it is in cache; the sender
hashes CHUNK-sized parts and sends them with sendmsg of memoryviews of the source (no
concatenation, no intermediate bytes). asyncio's StreamReader, the
link before this one, copied every payload twice (readexactly into bytes, then into a file) and
moved 0.35 GiB/s where a plain socket moved 2.6.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import ssl
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Sequence

import xxhash

from common.security import LINK_NONCE_BYTES, link_proof, proofs_match
from common.transport.refusals import Refusals, Told
from common.transport import (STRIPE_MIN, Backend, Channel, Peer, Pieces, Region, TransportError, TransportRefused,
                              admitted)
from schemas.codec import WireError
from schemas.transfer import MAX_STRIPES, CallFrame, ReadFrame, RegionRef, ReplyFrame, WriteFrame

log = logging.getLogger(__name__)

OP_WRITE, OP_READ, OP_CALL = b"W", b"R", b"C"
MAX_HEADER = 1 << 20  # a header is a little JSON: a bigger one is an attack or a bug
MAX_CONNECTIONS = 64
CHUNK = 1 << 20  # bytes hashed and sent (or received and hashed) at a time: they stay in cache
# SO_SNDBUF / SO_RCVBUF; 0 = leave them to the kernel's autotuning, which grows them up to
# net.ipv4.tcp_[rw]mem's maximum (32 MiB here), beyond what setsockopt may ask (net.core.[rw]mem_max,
# 4 MiB here): measured, a fixed 4 MiB moved less and cost the receiver more CPU per byte
SOCKET_BUFFER = 0
HANDSHAKE_TIMEOUT_S = 3.0  # two small messages each way; a peer that cannot is refused
MAX_HANDSHAKES = 64  # connections proving themselves at once
MAX_HANDSHAKES_PER_ADDRESS = 16  # of them from one address (a busy local cluster shares 127.0.0.1)
REFUSAL_LOG_S = 10.0  # one log line per refused source network per this long
FENCE = "fence"  # a call each connection answers itself: the writes before it landed (or the first failed)
OPEN_GROUPS = 1024  # striped writes a listener waits on at once; more are refused
_PROOF_BYTES = 32
_LEN = struct.Struct(">I")
_SUM = struct.Struct(">Q")
_IOV_MAX = 512
_DEADLINE = (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError)  # SO_RCVTIMEO/SO_SNDTIMEO ran out


def _waitall(sock: socket.socket) -> int:
    """recv's flags: MSG_WAITALL (one wakeup per CHUNK), which a TLS socket does not take (each
    receive then returns a record or so, and the loops below ask again)."""
    return 0 if isinstance(sock, ssl.SSLSocket) else socket.MSG_WAITALL


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
            k = sock.recv_into(buf[got:got + CHUNK], 0, _waitall(sock))  # one wakeup per CHUNK
        except _DEADLINE as exc:  # SO_RCVTIMEO: the read deadline
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
    """sendmsg until every buffer is out (a partial send resumes mid-buffer; no concatenation);
    over TLS, which has no sendmsg, sendall of each."""
    views = [memoryview(b).cast("B") for b in bufs]
    views = [v for v in views if v.nbytes]
    try:
        if isinstance(sock, ssl.SSLSocket):
            for v in views:
                sock.sendall(v)
            return
        while views:
            sent = sock.sendmsg(views[:_IOV_MAX])
            i = 0
            while i < len(views) and sent >= views[i].nbytes:
                sent -= views[i].nbytes
                i += 1
            views = views[i:]
            if sent:
                views[0] = views[0][sent:]
    except _DEADLINE as exc:  # SO_SNDTIMEO: the send deadline
        raise TransportError(f"peer took nothing for {deadline_of(sock):g} s") from exc
    except OSError as exc:
        raise TransportError(f"connection broke: {exc}") from exc


def frame(op: bytes, header: bytes) -> bytes:
    return op + _LEN.pack(len(header)) + header


def read_header(sock: socket.socket) -> bytes:
    return read_sized(sock, _LEN.unpack(recv_exactly(sock, _LEN.size))[0])


def read_sized(sock: socket.socket, size: int) -> bytes:
    """A header whose length was read: at most MAX_HEADER bytes."""
    if size > MAX_HEADER:
        raise TransportError(f"header of {size} bytes is larger than {MAX_HEADER}")
    return recv_exactly(sock, size)


def _parts(views: Sequence[memoryview]):
    """CHUNK-sized parts of each view, in order."""
    for v in views:
        for i in range(0, v.nbytes, CHUNK):
            yield v[i:i + CHUNK] if v.nbytes > CHUNK else v


def stripes(pieces: list[tuple[int, memoryview]], k: int) -> list[list[tuple[int, memoryview]]]:
    """The pieces cut into at most k runs of about equal bytes, in order (a piece may be cut)."""
    total = sum(v.nbytes for _, v in pieces)
    size = -(-total // k)
    out: list[list[tuple[int, memoryview]]] = [[]]
    room = size
    for off, v in pieces:
        while v.nbytes:
            if not room:
                out.append([])
                room = size
            take = min(v.nbytes, room)
            out[-1].append((off, v[:take]))
            off, v, room = off + take, v[take:], room - take
    return out


def send_write(sock: socket.socket, header: WriteFrame, views: Sequence[memoryview]) -> None:
    """One write frame: the header, the views' bytes in CHUNK-sized parts, their xxh3-64."""
    h = xxhash.xxh3_64()
    batch: list = [frame(OP_WRITE, header.to_bytes())]
    size = 0
    for part in _parts(views):
        h.update(part)  # NOTE: hashed right before it is sent, while it is in cache
        batch.append(part)
        size += part.nbytes
        if size >= CHUNK:
            send_all(sock, batch)
            batch, size = [], 0
    batch.append(_SUM.pack(h.intdigest()))
    send_all(sock, batch)


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

    def __init__(self, locator: str, secret: bytes | None, timeout_s: float, streams: int = 1,
                 stripe_min: int = STRIPE_MIN, tls: ssl.SSLContext | None = None) -> None:
        self.locator = locator
        self.secret = secret
        self.tls = tls  # the link's client context (common.security.LinkTls), or None
        self.timeout_s = timeout_s
        self.streams = max(1, min(streams, MAX_STRIPES))
        self.stripe_min = max(2, stripe_min)
        self.sock = self._connect()
        self._extra: list[socket.socket] = []  # the other connections of striped writes, made on the first
        self._dirty: set[int] = set()  # extra connections written to since their last fence
        self._pool: ThreadPoolExecutor | None = None
        self._group = f"{os.urandom(6).hex()}-"
        self._groups = 0

    def _connect(self) -> socket.socket:
        host, _, port = self.locator.rpartition(":")
        try:
            sock = socket.create_connection((host, int(port)), timeout=self.timeout_s)
        except (OSError, ValueError) as exc:
            raise TransportError(f"cannot connect to {self.locator}: {exc}") from exc
        try:
            tune(sock, min(self.timeout_s, HANDSHAKE_TIMEOUT_S))
            if self.tls is not None:
                sock = self.tls.wrap_socket(sock)
            client_handshake(sock, self.secret)
            set_deadline(sock, self.timeout_s)
        except ssl.SSLError as exc:
            sock.close()
            raise TransportRefused(f"TLS with {self.locator} failed: {exc}") from exc
        except BaseException:
            sock.close()
            raise
        return sock

    def write(self, dest: RegionRef, pieces: Pieces, meta: dict | None = None) -> None:
        views = [(off, memoryview(b).cast("B")) for off, b in pieces]
        total = sum(v.nbytes for _, v in views)
        k = min(self.streams, total // (self.stripe_min // 2)) if total >= self.stripe_min else 1
        if k < 2:
            header = WriteFrame(dest.region, [[off, v.nbytes] for off, v in views], meta or {})
            send_write(self.sock, header, [v for _, v in views])
            return
        parts = stripes(views, k)
        self._groups += 1
        group, whole = f"{self._group}{self._groups}", [[off, v.nbytes] for off, v in views]
        frames = [(WriteFrame(dest.region, [[off, v.nbytes] for off, v in part], meta or {}, group, len(parts),
                              whole if i == 0 else []), [v for _, v in part]) for i, part in enumerate(parts)]
        extra = self._extra_socks(len(parts) - 1)
        self._dirty.update(range(len(extra)))
        sends = [self._pool.submit(send_write, sock, *f) for sock, f in zip(extra, frames[1:])]
        try:
            send_write(self.sock, *frames[0])
        finally:
            for f in sends:
                f.result()  # TransportError from a part's connection: raised here, after every part ended

    def _extra_socks(self, n: int) -> list[socket.socket]:
        while len(self._extra) < n:
            self._extra.append(self._connect())
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.streams - 1, thread_name_prefix=f"tcp-stripe-{self.locator}")
        return self._extra[:n]

    def read(self, src: RegionRef, pieces: Pieces) -> None:
        views = [memoryview(b).cast("B") for _, b in pieces]
        header = ReadFrame(src.region, [[off, v.nbytes] for (off, _), v in zip(pieces, views)])
        send_all(self.sock, [frame(OP_READ, header.to_bytes())])
        self._reply(self.sock)
        for v in views:
            recv_into(self.sock, v)

    def call(self, op: str, body: bytes = b"") -> bytes:
        for i in sorted(self._dirty):  # the parts of striped writes landed (or failed) before the call runs
            self._dirty.discard(i)
            self._call(self._extra[i], FENCE, b"")
        return self._call(self.sock, op, body)

    def _call(self, sock: socket.socket, op: str, body: bytes) -> bytes:
        send_all(sock, [frame(OP_CALL, CallFrame(op, len(body)).to_bytes()), body])
        reply = self._reply(sock)
        return recv_exactly(sock, reply.nbytes)

    def _reply(self, sock: socket.socket) -> ReplyFrame:
        try:
            reply = ReplyFrame.from_bytes(read_header(sock))
        except WireError as exc:
            raise TransportError(f"{self.locator} answered something else: {exc}") from exc
        if not reply.ok:
            raise TransportError(f"{self.locator}: {reply.error}")
        return reply

    def close(self) -> None:
        for sock in [self.sock, *self._extra]:
            sock.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False)


# --- the accepting side -------------------------------------------------------------------------
class TcpBackend(Backend):
    name = "tcp"

    def __init__(self, transports) -> None:
        super().__init__(transports)
        self._locator = ""
        self._listener: socket.socket | None = None
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.door = _Door()
        self.groups = _Groups(transports.timeout_s)

    @property
    def refused(self) -> dict[str, int]:
        """Connections refused so far, by reason: 'stranger' (an address outside --link-peers),
        'handshakes' (too many proving themselves, at once or from one address), 'tls' (no TLS
        session with a certificate of the link CA), 'secret' (failed the proof or its deadline),
        'connections'."""
        return dict(self.door.refused)

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
        t = self.transports
        return TcpChannel(locator, t.secret, timeout_s, t.tcp_streams, t.tcp_stripe_min,
                          t.tls.client if t.tls is not None else None)

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
            if not admitted(addr[0], self.transports.allow):  # not a cluster's address: nothing more is read
                sock.close()
                self._refuse(addr, "stranger", "not an address the cluster's links are given (--link-peers)")
                continue
            if not self.door.enter(addr[0]):  # too many unproven connections: refuse rather than queue
                sock.close()
                self._refuse(addr, "handshakes", f"more than {MAX_HANDSHAKES_PER_ADDRESS} from this address or "
                                                 f"{MAX_HANDSHAKES} in all are proving themselves")
                continue
            threading.Thread(target=self._serve, args=(sock, addr), name=f"tcp-peer-{addr[0]}:{addr[1]}",
                             daemon=True).start()

    def _refuse(self, addr, reason: str, why: str) -> None:
        told = self.door.refusal(addr[0], reason)
        if told is not None:
            log.warning("connection from %s:%s refused: %s (since the last line: %d more from %s, %d from sources "
                        "not logged)", addr[0], addr[1], why, told.untold, told.source, told.untold_elsewhere)
        if self.transports.on_refused is not None:
            self.transports.on_refused(f"{addr[0]}:{addr[1]}", why)

    def _serve(self, sock: socket.socket, addr) -> None:
        peer = Peer(f"{addr[0]}:{addr[1]}")
        t = self.transports
        slot = False
        # the whole handshake (TLS and the secret) within HANDSHAKE_TIMEOUT_S: the socket's
        # deadline is per read, and a peer sending a byte now and then would hold its place for ever
        cutoff = _Cutoff(sock, HANDSHAKE_TIMEOUT_S)
        try:
            try:
                tune(sock, HANDSHAKE_TIMEOUT_S)
                if t.tls is not None:
                    sock = t.tls.server.wrap_socket(sock, server_side=True)
            except OSError as exc:  # no TLS, or a certificate the cluster's link CA did not issue
                cutoff.passed()
                self.door.leave(addr[0])
                self._refuse(addr, "tls", f"no TLS session with a certificate of the cluster's link CA: {exc}")
                return
            try:
                server_handshake(sock, t.secret)
                if not cutoff.passed():
                    raise TransportError(f"the handshake took longer than {HANDSHAKE_TIMEOUT_S:g} s")
            except (TransportError, OSError) as exc:  # a wrong proof, or none within the deadline
                in_time = cutoff.passed()
                self._refuse(addr, "secret", (str(exc) or type(exc).__name__) if in_time else
                             f"the handshake took longer than {HANDSHAKE_TIMEOUT_S:g} s")
                return
            finally:
                self.door.leave(addr[0])
            slot = self._slots.acquire(blocking=False)
            if not slot:
                self._refuse(addr, "connections", f"{MAX_CONNECTIONS} connections already open")
                return
            set_deadline(sock, t.timeout_s)
            _Connection(self, sock, peer).run()
        except (TransportError, WireError, ValueError, OSError) as exc:  # a broken peer or a malformed frame
            log.warning("connection from %s broke: %s", peer.name, exc)
        except Exception:
            log.exception("connection from %s failed", peer.name)
        finally:
            sock.close()
            peer.closed()
            if slot:
                self._slots.release()


class _Cutoff:
    """Closes a socket whose handshake is not over within `seconds` (a timer thread shuts it down,
    which ends any read the handshake is blocked in)."""

    def __init__(self, sock: socket.socket, seconds: float) -> None:
        self._sock, self._lock, self._over = sock, threading.Lock(), False
        self._timer = threading.Timer(seconds, self._cut)
        self._timer.daemon = True
        self._timer.start()

    def _cut(self) -> None:
        with self._lock:
            if self._over:
                return
            self._over = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def passed(self) -> bool:
        """The handshake is over: True if it ended before the cutoff (the socket is whole)."""
        self._timer.cancel()
        with self._lock:
            in_time, self._over = not self._over, True
        return in_time


class _Door:
    """Connections proving themselves, per address, and refusals (counted; logged sparingly)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[str, int] = {}
        self.refused: collections.Counter[str] = collections.Counter()
        self.log = Refusals(REFUSAL_LOG_S)  # which refusals are logged

    def enter(self, address: str) -> bool:
        with self._lock:
            here = self._waiting.get(address, 0)
            if here >= MAX_HANDSHAKES_PER_ADDRESS or sum(self._waiting.values()) >= MAX_HANDSHAKES:
                return False
            self._waiting[address] = here + 1
            return True

    def leave(self, address: str) -> None:
        with self._lock:
            left = self._waiting.get(address, 0) - 1
            if left > 0:
                self._waiting[address] = left
            else:
                self._waiting.pop(address, None)

    def refusal(self, address: str, reason: str) -> Told | None:
        """Count a refusal; what to log of it now, or None."""
        with self._lock:
            self.refused[reason] += 1
            return self.log.refused(address, time.monotonic())


class _Connection:
    """One accepted connection's requests, served in order on its thread."""

    def __init__(self, backend: TcpBackend, sock: socket.socket, peer: Peer) -> None:
        self.backend = backend
        self.transports = backend.transports
        self.sock = sock
        self.peer = peer
        self.failed = ""  # the first failed write since the last call: the next call reports it
        self._scratch = memoryview(bytearray(CHUNK))

    def run(self) -> None:
        ops = {OP_WRITE: self.write, OP_READ: self.read, OP_CALL: self.call}
        while True:
            try:
                head = self.sock.recv(1 + _LEN.size, _waitall(self.sock))  # the op and its header's length at once
            except _DEADLINE:
                return  # idle past the deadline: the peer connects again when it has something to send
            if not head:
                return  # the peer is done
            handler = ops.get(head[:1])
            if handler is None:
                raise TransportError(f"unknown op {head[:1]!r}")
            if len(head) < 1 + _LEN.size:
                head += recv_exactly(self.sock, 1 + _LEN.size - len(head))
            handler(read_sized(self.sock, _LEN.unpack_from(head, 1)[0]))

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
            self.landed(region, req, spans, error or f"region {req.region} is being unregistered")
            return
        try:
            h = xxhash.xxh3_64()
            for off, n in spans:
                with region.buf[off: off + n] as part:
                    recv_into(self.sock, part, h)  # NOTE: each part hashed as it lands, while in cache
            (expected,) = _SUM.unpack(recv_exactly(self.sock, _SUM.size))
            error = "" if h.intdigest() == expected else \
                f"write {req.meta or ''} to region {req.region} failed its checksum ({total} bytes)"
            self.landed(region, req, spans, error)
        finally:
            region.leave()

    def landed(self, region: Region | None, req: WriteFrame, spans: list, error: str) -> None:
        """A write, or a part of a striped one, ended: the owner is handed a failure at once (once
        per write), a striped write's whole pieces once every part landed."""
        if error:
            log.warning("from %s: %s", self.peer.name, error)
            self.failed = self.failed or error
        if req.parts > 1:
            whole, earlier_error, done = self.backend.groups.land(req, error)
            if earlier_error or not (error or done):  # told already, or parts still to come
                return
            if not error:
                spans = [(off, n) for off, n in whole] or spans
        if region is None or region.on_write is None:
            return
        try:
            region.on_write(req.meta, spans, error or None)
        except Exception as exc:  # refused by the owner (e.g. a slice that does not belong)
            if error:
                log.exception("region %s: on_write failed on a failed write", region.id)
            else:
                self.failed = self.failed or f"region {req.region} refused write {req.meta}: {exc}"
                log.warning("from %s: %s", self.peer.name, self.failed)

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
        if req.op == FENCE and not self.failed:
            reply, out = ReplyFrame(True), b""
        elif self.failed:
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


@dataclass
class _Group:
    left: int  # parts not ended yet
    opened: float  # monotonic
    whole: list = field(default_factory=list)  # the write's own pieces (from its first part)
    error: str = ""  # the first failure of its parts


class _Groups:
    """The striped writes a listener has seen some parts of, by group id."""

    def __init__(self, stale_s: float) -> None:
        self.stale_s = stale_s  # a group whose other parts have not come after this long never will: their connection broke
        self._open: dict[str, _Group] = {}
        self._lock = threading.Lock()

    def land(self, req: WriteFrame, error: str) -> tuple[list, str, bool]:
        """Count a part; returns (the write's whole pieces, the first error of the parts before this
        one, whether every part has now ended)."""
        with self._lock:
            group = self._open.get(req.group)
            if group is None:
                if len(self._open) >= OPEN_GROUPS:  # drop groups whose other parts never came (a broken connection)
                    stale = time.monotonic() - self.stale_s
                    for gid in [g for g, v in self._open.items() if v.opened < stale]:
                        del self._open[gid]
                if len(self._open) >= OPEN_GROUPS:
                    raise TransportError(f"{OPEN_GROUPS} striped writes are already waiting for their parts")
                group = self._open[req.group] = _Group(req.parts, time.monotonic())
            group.left -= 1
            group.whole = group.whole or req.whole
            earlier, group.error = group.error, group.error or error
            if group.left <= 0:
                del self._open[req.group]
            return group.whole, earlier, group.left <= 0
