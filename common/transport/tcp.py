"""The TCP backend: one-sided writes and reads emulated over a stream, at close to socket speed.

A connection first proves that both ends hold the cluster secret (when the cluster has one):

    server -> 16-byte nonce S
    client -> 16-byte nonce C, HMAC(secret, "client+mac" | S)
    server -> HMAC(secret, "server+mac" | C)          (each side checks the other's proof)

Integrity (`_Seal`): with "+mac" (the default of every channel `Transports` opens without TLS,
`Transports.link_mac`), every later frame both ways ends with a keyed MAC in place of a write's
xxh3: GMAC under a key of this connection and direction, HMAC(secret, direction | S | C), the
frame's number its nonce. The MAC covers the op, the header and the payload, so no one on the
path can rewrite KV, nor replay, reorder or drop a frame, unnoticed; the first frame that fails
ends the connection. Without "+mac" (the roles "client" and "server": TLS, which authenticates
every byte itself, an RDMA control connection, or `link_mac=False` to measure its cost) frames
are as below, writes with only their xxh3. The connecting side chooses; its proof says which, so
no one on the path can strip it.

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

(a ReplyFrame is [4-byte length][JSON]; with "+mac", each request and each reply ends with its
8-byte MAC, a write's where its xxh3 was.)

A failed write (unknown region, out of bounds, checksum mismatch, refused by its owner) has its
payload drained, so that framing holds, and fails the next call on the connection.

Every send (a frame and its payload) is over within max(Transports.send_floor_s, its bytes /
send_min_rate) (`_Sending`: a watch thread shuts the socket past it), so a reader that takes a
byte now and then cannot hold the sender, or the listener's connection slot, for ever.

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
slot. It has HANDSHAKE_TIMEOUT_S for the whole handshake (a timer, not a per-read deadline), and at
most MAX_HANDSHAKES such connections wait at once, MAX_HANDSHAKES_PER_ADDRESS of them from one
address. A newcomer beyond either bound takes the place of the oldest one waiting (from its address,
or of all): a proven peer's handshake takes milliseconds, so connections a stranger opens and holds
are pushed out by the next peer that comes, where refusing the newcomer had let 16 held connections
per address block every handoff (and a connection pushed out is tried again by the prefill,
TransportTurnedAway: services/prefill/handoff.py). So a stranger who only reaches the port can neither hold the slots
proven peers use nor, by holding connections, the handshakes of peers. Where the cluster lists its members' addresses (`Transports.allow`,
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
import hashlib
import hmac
import logging
import math
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
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from common.security import LINK_NONCE_BYTES, link_proof, proofs_match
from common.transport.refusals import Refusals, Told
from common.transport import (SEND_FLOOR_S, SEND_MIN_RATE, STRIPE_MIN, Backend, Channel, Peer, Pieces, Region,
                              TransportError, TransportRefused, TransportTurnedAway, admitted)
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
MAC_BYTES = _SUM.size  # a MAC'd frame's tag: where a plain write's xxh3 goes, so frames keep their length
_NONCE = struct.Struct(">4xQ")  # GCM's 96-bit nonce: the frame's number on its connection and direction
MAC_FAILED = "failed its checksum (the link's keyed MAC: changed, replayed or reordered on the way)"
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


class PeerClosed(TransportError):
    """The peer closed its end before all the bytes awaited came."""


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
            raise PeerClosed(f"peer closed the connection after {got} of {n} bytes")
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


@dataclass(frozen=True)
class Pace:
    """How long a send may take: max(floor_s, its bytes / min_rate) (Transports.send_floor_s, send_min_rate)."""

    floor_s: float = SEND_FLOOR_S
    min_rate: float = SEND_MIN_RATE  # bytes/s

    def seconds(self, nbytes: int) -> float:
        return max(self.floor_s, nbytes / self.min_rate)


class _Sending:
    """One send within its deadline (`Pace`). SO_SNDTIMEO bounds each system call only: a reader
    taking a byte before each timeout held the connection (and its slot, and the region it reads)
    for ever. Past the deadline the watch shuts the socket, which ends the blocked send, and the
    send raises saying why."""

    __slots__ = ("sock", "nbytes", "pace", "seconds", "due", "cut")

    def __init__(self, sock: socket.socket, nbytes: int, pace: Pace) -> None:
        self.sock, self.nbytes, self.pace = sock, nbytes, pace
        self.seconds = pace.seconds(nbytes)
        self.due = time.monotonic() + self.seconds
        self.cut = False

    def __enter__(self) -> "_Sending":
        _WATCH.arm(self)
        return self

    def __exit__(self, kind, exc, tb) -> None:
        if _WATCH.disarm(self):
            return  # in time: whatever was raised stands
        raise TransportError(f"the peer took {self.nbytes} bytes slower than {self.pace.min_rate / 1e6:g} MB/s: "
                             f"the send was cut off at its deadline of {self.seconds:g} s, and the connection "
                             f"with it") from exc


class _Watch:
    """The process's sends in flight: one thread shuts the socket of any past its deadline (a
    timer per send would start a thread per frame). It sleeps until the earliest deadline and
    is woken only by a send due before that."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._open: set[_Sending] = set()
        self._wake = math.inf  # when the thread wakes next
        self._thread: threading.Thread | None = None

    def arm(self, send: _Sending) -> None:
        with self._cond:
            self._open.add(send)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tcp-send-deadlines", daemon=True)
                self._thread.start()
            if send.due < self._wake:
                self._wake = send.due
                self._cond.notify()

    def disarm(self, send: _Sending) -> bool:
        """The send is over: True if it ended within its deadline (the socket is whole)."""
        with self._cond:
            self._open.discard(send)
            return not send.cut

    def _run(self) -> None:
        with self._cond:
            while True:
                now = time.monotonic()
                for send in [s for s in self._open if s.due <= now]:
                    self._open.discard(send)
                    send.cut = True
                    try:  # closed, it resets: what the reader did not take is dropped, not sent on at its pace
                        send.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
                        socket.socket.shutdown(send.sock, socket.SHUT_RDWR)  # the plain socket's, under TLS too
                    except OSError:
                        pass
                self._wake = min((s.due for s in self._open), default=math.inf)
                self._cond.wait(None if self._wake == math.inf else self._wake - now)


_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() resets the connection
_WATCH = _Watch()
os.register_at_fork(after_in_child=_WATCH.__init__)  # the thread does not follow a fork


# --- the keyed MAC ------------------------------------------------------------------------------
_KEEP = 64 << 10  # a frame up to this long is MAC'd at once, from a copy (see _Mac)


class _Mac:
    """One frame's GMAC: `update` with its bytes in order, then `tag`. A small frame (a call, a
    reply, a header) is kept and MAC'd at once (AESGCM: under 1 us); a larger one streams through
    a GCM context (about 4 us to set up, then each part while it is in cache). Both are the GMAC
    of the same bytes, so either end may take either way."""

    __slots__ = ("_seal", "_nonce", "_kept", "_size", "_gcm")

    def __init__(self, seal: "_Seal", nonce: bytes) -> None:
        self._seal, self._nonce = seal, nonce
        self._kept: list[bytes] = []
        self._size = 0
        self._gcm = None

    def update(self, data) -> None:
        if self._gcm is None:
            n = data.nbytes if isinstance(data, memoryview) else len(data)
            if self._size + n <= _KEEP:
                self._kept.append(bytes(data))
                self._size += n
                return
            self._gcm = Cipher(self._seal.aes, modes.GCM(self._nonce)).encryptor()
            for kept in self._kept:
                self._gcm.authenticate_additional_data(kept)
        self._gcm.authenticate_additional_data(data)

    def tag(self) -> bytes:
        if self._gcm is None:
            return self._seal.aead.encrypt(self._nonce, b"", b"".join(self._kept))[:MAC_BYTES]
        self._gcm.finalize()
        return self._gcm.tag[:MAC_BYTES]


class _Seal:
    """One direction of a MAC'd connection: each frame's GMAC (AES-GCM over no plaintext, the frame
    as its associated data) under this connection's key for this direction, with the frame's
    number as its nonce, so a frame changed, replayed, reordered, dropped, reflected or taken from
    another connection fails. Chosen by measurement (1-4 MiB frames, this machine's AES-NI and
    carry-less multiply): GMAC 20 GB/s, Poly1305 12, HMAC-SHA256 1.8, keyed BLAKE2b 0.9, against
    xxh3's 55 which it replaces (and 1-4 us more per frame, see _Mac).

    The tag is cut to MAC_BYTES, the length of the xxh3 it replaces. That holds because a forger
    gets one try per connection: the first frame that fails ends the connection's trust
    (`_Connection.tampered`, `TcpChannel._check`), and a new connection needs the cluster secret."""

    __slots__ = ("aes", "aead", "_frames")

    def __init__(self, key: bytes) -> None:
        self.aes, self.aead = algorithms.AES(key), AESGCM(key)
        self._frames = 0

    def open(self) -> _Mac:
        """The next frame's MAC."""
        self._frames += 1
        return _Mac(self, _NONCE.pack(self._frames))


def derived_seal(secret: bytes, purpose: bytes) -> _Seal:
    """A seal under a key of the cluster secret for `purpose`, for bytes that move outside this
    protocol's frames (an RDMA write or read lands in memory with no byte stream to seal:
    common/transport/rdma.py); each message's nonce is the caller's (random, sent beside its tag)."""
    return _Seal(hmac.new(secret, b"link mac|" + purpose, hashlib.sha256).digest()[:16])


def mac_of(seal: _Seal, nonce: bytes, pieces) -> bytes:
    """The GMAC of the pieces' bytes, in order, under `seal` and `nonce` (12 bytes)."""
    mac = _Mac(seal, nonce)
    for piece in pieces:
        mac.update(piece)
    return mac.tag()


@dataclass
class Seals:
    """A MAC'd connection's two directions, from this end: what it sends, what it receives."""

    tx: _Seal
    rx: _Seal

    @classmethod
    def derive(cls, secret: bytes, server_nonce: bytes, client_nonce: bytes, server: bool) -> "Seals":
        """Keys of this connection alone: HMAC(secret, direction | both handshake nonces)."""
        def key(direction: bytes) -> bytes:
            return hmac.new(secret, b"link mac|" + direction + b"|" + server_nonce + client_nonce,
                            hashlib.sha256).digest()[:16]
        ours, theirs = (key(b"server"), key(b"client")) if server else (key(b"client"), key(b"server"))
        return cls(_Seal(ours), _Seal(theirs))


def sealed(sock: socket.socket, mac: _Mac, tag: bytes | None = None) -> bool:
    """Whether the frame's tag (read now, unless read with the frame's last bytes) is the MAC of
    the bytes `mac` was given."""
    return hmac.compare_digest(recv_exactly(sock, MAC_BYTES) if tag is None else tag, mac.tag())


def send_frame(sock: socket.socket, head: bytes, views: Sequence[memoryview], h=None, trailer=None,
               pace: Pace = Pace()) -> None:
    """`head`, the views' bytes in CHUNK-sized parts, then `trailer(h)` if given: each part added
    to `h` right before it is sent, while it is in cache; all of it within the send's deadline."""
    total = len(head) + sum(v.nbytes for v in views) + (MAC_BYTES if trailer is not None else 0)
    with _Sending(sock, total, pace):
        batch: list = [head]
        size = 0
        for part in _parts(views):
            if h is not None:
                h.update(part)
            batch.append(part)
            size += part.nbytes
            if size >= CHUNK:
                send_all(sock, batch)
                batch, size = [], 0
        if trailer is not None:
            batch.append(trailer(h))
        send_all(sock, batch)


def send_sealed(sock: socket.socket, head: bytes, views: Sequence[memoryview], tx: _Seal | None,
                pace: Pace = Pace()) -> None:
    """A frame of any op and its payload: plain, or followed by its MAC (`tx`: the connection's)."""
    if tx is None:
        send_frame(sock, head, views, pace=pace)
        return
    mac = tx.open()
    mac.update(head)
    send_frame(sock, head, views, mac, _Mac.tag, pace)


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


def send_write(sock: socket.socket, header: WriteFrame, views: Sequence[memoryview], tx: _Seal | None = None,
               pace: Pace = Pace()) -> None:
    """One write frame: the header, the views' bytes in CHUNK-sized parts, then their xxh3-64 or,
    on a MAC'd connection, the frame's MAC in its place."""
    head = frame(OP_WRITE, header.to_bytes())
    if tx is not None:
        send_sealed(sock, head, views, tx, pace)
    else:
        send_frame(sock, head, views, xxhash.xxh3_64(), lambda h: _SUM.pack(h.intdigest()), pace)


# --- the handshake ------------------------------------------------------------------------------
_MAC_ROLE = b"+mac"  # a proof with it asks for (and agrees to) a MAC'd connection: no one on the path can strip it


def server_handshake(sock: socket.socket, secret: bytes | None) -> Seals | None:
    """The accepting side: challenge the peer, then prove ourselves (no secret: nothing to do). The
    connecting side chooses whether the connection is MAC'd (its proof says which); its Seals, or None."""
    if secret is None:
        return None
    nonce = os.urandom(LINK_NONCE_BYTES)
    send_all(sock, [nonce])
    answer = recv_exactly(sock, LINK_NONCE_BYTES + _PROOF_BYTES)
    client_nonce, proof = answer[:LINK_NONCE_BYTES], answer[LINK_NONCE_BYTES:]
    if proofs_match(link_proof(secret, nonce, b"client" + _MAC_ROLE), proof):
        mac = True
    elif proofs_match(link_proof(secret, nonce, b"client"), proof):
        mac = False
    else:
        raise TransportRefused("the peer does not hold the cluster secret")
    send_all(sock, [link_proof(secret, client_nonce, b"server" + (_MAC_ROLE if mac else b""))])
    return Seals.derive(secret, nonce, client_nonce, server=True) if mac else None


def client_handshake(sock: socket.socket, secret: bytes | None, mac: bool = False) -> Seals | None:
    """The connecting side; `mac`: every later frame both ways carries a keyed MAC (its Seals)."""
    if secret is None:
        return None
    role = _MAC_ROLE if mac else b""
    server_nonce = recv_exactly(sock, LINK_NONCE_BYTES)
    nonce = os.urandom(LINK_NONCE_BYTES)
    send_all(sock, [nonce + link_proof(secret, server_nonce, b"client" + role)])
    if not proofs_match(link_proof(secret, nonce, b"server" + role), recv_exactly(sock, _PROOF_BYTES)):
        raise TransportRefused("the listener does not hold the cluster secret")
    return Seals.derive(secret, server_nonce, nonce, server=False) if mac else None


# --- the connecting side ------------------------------------------------------------------------
class TcpChannel(Channel):
    transport = "tcp"

    def __init__(self, locator: str, secret: bytes | None, timeout_s: float, streams: int = 1,
                 stripe_min: int = STRIPE_MIN, tls: ssl.SSLContext | None = None, mac: bool = False,
                 pace: Pace = Pace()) -> None:
        self.locator = locator
        self.secret = secret
        self.tls = tls  # the link's client context (common.security.LinkTls), or None
        self.mac = mac and secret is not None  # every frame both ways with a keyed MAC (TcpBackend.connect asks)
        self.pace = pace  # each send's deadline
        self.timeout_s = timeout_s
        self.streams = max(1, min(streams, MAX_STRIPES))
        self.stripe_min = max(2, stripe_min)
        self._seals: dict[socket.socket, Seals | None] = {}  # each connection's, None where plain
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
            self._seals[sock] = client_handshake(sock, self.secret, self.mac)
            set_deadline(sock, self.timeout_s)
        except ssl.SSLError as exc:
            sock.close()
            raise TransportRefused(f"TLS with {self.locator} failed: {exc}") from exc
        except PeerClosed as exc:
            sock.close()
            raise TransportTurnedAway(f"{self.locator} closed the connection during the handshake ({exc})") from exc
        except BaseException:
            sock.close()
            raise
        return sock

    def _tx(self, sock: socket.socket) -> _Seal | None:
        seals = self._seals.get(sock)
        return seals.tx if seals is not None else None

    def write(self, dest: RegionRef, pieces: Pieces, meta: dict | None = None) -> None:
        views = [(off, memoryview(b).cast("B")) for off, b in pieces]
        total = sum(v.nbytes for _, v in views)
        k = min(self.streams, total // (self.stripe_min // 2)) if total >= self.stripe_min else 1
        if k < 2:
            header = WriteFrame(dest.region, [[off, v.nbytes] for off, v in views], meta or {})
            send_write(self.sock, header, [v for _, v in views], self._tx(self.sock), self.pace)
            return
        parts = stripes(views, k)
        self._groups += 1
        group, whole = f"{self._group}{self._groups}", [[off, v.nbytes] for off, v in views]
        frames = [(WriteFrame(dest.region, [[off, v.nbytes] for off, v in part], meta or {}, group, len(parts),
                              whole if i == 0 else []), [v for _, v in part]) for i, part in enumerate(parts)]
        extra = self._extra_socks(len(parts) - 1)
        self._dirty.update(range(len(extra)))
        sends = [self._pool.submit(send_write, sock, *f, self._tx(sock), self.pace)
                 for sock, f in zip(extra, frames[1:])]
        try:
            send_write(self.sock, *frames[0], self._tx(self.sock), self.pace)
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
        send_sealed(self.sock, frame(OP_READ, header.to_bytes()), [], self._tx(self.sock), self.pace)
        reply, mac = self._reply(self.sock)
        if reply.ok:
            for v in views:
                recv_into(self.sock, v, mac)
        self._check(self.sock, reply, mac)

    def call(self, op: str, body: bytes = b"") -> bytes:
        for i in sorted(self._dirty):  # the parts of striped writes landed (or failed) before the call runs
            self._dirty.discard(i)
            self._call(self._extra[i], FENCE, b"")
        return self._call(self.sock, op, body)

    def _call(self, sock: socket.socket, op: str, body: bytes) -> bytes:
        self._post(sock, op, body)
        reply, out = self._answer(sock)
        if not reply.ok:
            raise TransportError(f"{self.locator}: {reply.error}")
        return out

    def post(self, op: str, body: bytes = b"") -> None:
        """Send a call without waiting for its answer; the peer answers calls in order (`answer`)."""
        self._post(self.sock, op, body)

    def answer(self) -> tuple[ReplyFrame, bytes]:
        """The answer to the oldest call `post`ed and not answered yet: its reply (ok or not) and body."""
        return self._answer(self.sock)

    def _post(self, sock: socket.socket, op: str, body: bytes) -> None:
        send_sealed(sock, frame(OP_CALL, CallFrame(op, len(body)).to_bytes()), [memoryview(body).cast("B")],
                    self._tx(sock), self.pace)

    def _answer(self, sock: socket.socket) -> tuple[ReplyFrame, bytes]:
        """The next reply on `sock` and its body (a failed reply has none), its MAC checked."""
        reply, mac = self._reply(sock)
        n = reply.nbytes if reply.ok else 0
        got = recv_exactly(sock, n + (MAC_BYTES if mac is not None else 0))  # the body and its tag in one read
        out = got[:n]
        if mac is not None:
            mac.update(out)
            self._check(sock, ReplyFrame(True), mac, got[n:])
        return reply, out

    def _reply(self, sock: socket.socket) -> tuple[ReplyFrame, _Mac | None]:
        """A reply's header, and its MAC so far (None: a plain connection), its payload still to read."""
        seals = self._seals.get(sock)
        mac = seals.rx.open() if seals is not None else None
        head = recv_exactly(sock, _LEN.size)
        body = read_sized(sock, _LEN.unpack(head)[0])
        if mac is not None:
            mac.update(head)
            mac.update(body)
        try:
            return ReplyFrame.from_bytes(body), mac
        except WireError as exc:
            raise TransportError(f"{self.locator} answered something else: {exc}") from exc

    def _check(self, sock: socket.socket, reply: ReplyFrame, mac: _Mac | None, tag: bytes | None = None) -> None:
        """The reply read whole: its MAC, then whether it failed. A reply that fails its MAC ends
        the connection (one forgery try per connection: see _Seal)."""
        if mac is not None and not sealed(sock, mac, tag):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            raise TransportError(f"{self.locator}: a reply {MAC_FAILED}; the connection is closed")
        if not reply.ok:
            raise TransportError(f"{self.locator}: {reply.error}")

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
                          t.tls.client if t.tls is not None else None,
                          mac=t.link_mac and t.tls is None,  # TLS authenticates every byte already
                          pace=self.pace)

    @property
    def pace(self) -> Pace:
        return Pace(self.transports.send_floor_s, self.transports.send_min_rate)

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
            # the whole handshake (TLS and the secret) within HANDSHAKE_TIMEOUT_S: the socket's
            # deadline is per read, and a peer sending a byte now and then would hold its place for ever
            cutoff = _Cutoff(sock, HANDSHAKE_TIMEOUT_S)
            self.door.enter(addr[0], cutoff)  # too many proving themselves: the oldest gives way
            threading.Thread(target=self._serve, args=(sock, addr, cutoff), name=f"tcp-peer-{addr[0]}:{addr[1]}",
                             daemon=True).start()

    def _refuse(self, addr, reason: str, why: str) -> None:
        told = self.door.refusal(addr[0], reason)
        if told is not None:
            log.warning("connection from %s:%s refused: %s (since the last line: %d more from %s, %d from sources "
                        "not logged)", addr[0], addr[1], why, told.untold, told.source, told.untold_elsewhere)
        if self.transports.on_refused is not None:
            self.transports.on_refused(f"{addr[0]}:{addr[1]}", why)

    def _serve(self, sock: socket.socket, addr, cutoff: "_Cutoff") -> None:
        peer = Peer(f"{addr[0]}:{addr[1]}")
        t = self.transports
        slot = False
        try:
            try:
                tune(sock, HANDSHAKE_TIMEOUT_S)
                if t.tls is not None:
                    sock = t.tls.server.wrap_socket(sock, server_side=True)
            except OSError as exc:  # no TLS, or a certificate the cluster's link CA did not issue
                cutoff.passed()
                self.door.leave(cutoff)
                self._refuse(addr, *(cutoff.why() if cutoff.evicted else
                                     ("tls", f"no TLS session with a certificate of the cluster's link CA: {exc}")))
                return
            try:
                seals = server_handshake(sock, t.secret)
                if not cutoff.passed():
                    raise TransportError(f"the handshake took longer than {HANDSHAKE_TIMEOUT_S:g} s")
            except (TransportError, OSError) as exc:  # a wrong proof, or none within the deadline
                in_time = cutoff.passed()
                self._refuse(addr, *(("secret", str(exc) or type(exc).__name__) if in_time else cutoff.why()))
                return
            finally:
                self.door.leave(cutoff)
            slot = self._slots.acquire(blocking=False)
            if not slot:
                self._refuse(addr, "connections", f"{MAX_CONNECTIONS} connections already open")
                return
            set_deadline(sock, t.timeout_s)
            _Connection(self, sock, peer, seals).run()
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
    which ends any read the handshake is blocked in), or sooner where the door gives its place to
    a newer connection (`evict`)."""

    def __init__(self, sock: socket.socket, seconds: float) -> None:
        self._sock, self._lock, self._over = sock, threading.Lock(), False
        self._seconds, self._evicted = seconds, False
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

    def evict(self) -> None:
        self._evicted = True
        self._timer.cancel()
        self._cut()

    @property
    def evicted(self) -> bool:
        return self._evicted

    def why(self) -> tuple[str, str]:
        """(refusal reason, words) of a handshake cut off."""
        if self._evicted:
            return "handshakes", (f"its place went to a newer connection: more than {MAX_HANDSHAKES_PER_ADDRESS} "
                                  f"from its address or {MAX_HANDSHAKES} in all were proving themselves")
        return "secret", f"the handshake took longer than {self._seconds:g} s"

    def passed(self) -> bool:
        """The handshake is over: True if it ended before the cutoff (the socket is whole)."""
        self._timer.cancel()
        with self._lock:
            in_time, self._over = not self._over, True
        return in_time


class _Door:
    """Connections proving themselves, oldest first, per address, and refusals (counted; logged
    sparingly). Beyond MAX_HANDSHAKES_PER_ADDRESS from one address, or MAX_HANDSHAKES in all, the
    oldest waiting (of that address, or of all) is cut off to make room: held connections cannot
    keep a peer out, whose own handshake is over in milliseconds."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[str, dict[_Cutoff, None]] = {}  # address -> its handshakes, oldest first
        self._all: dict[_Cutoff, str] = {}  # every handshake, oldest first -> its address
        self.refused: collections.Counter[str] = collections.Counter()
        self.log = Refusals(REFUSAL_LOG_S)  # which refusals are logged

    def enter(self, address: str, cutoff: _Cutoff) -> None:
        evicted = []
        with self._lock:
            here = self._waiting.setdefault(address, {})
            if len(here) >= MAX_HANDSHAKES_PER_ADDRESS:
                evicted.append(self._drop(next(iter(here))))
            elif len(self._all) >= MAX_HANDSHAKES:
                evicted.append(self._drop(next(iter(self._all))))
            here[cutoff] = None
            self._all[cutoff] = address
        for oldest in evicted:
            oldest.evict()  # its thread refuses it and leaves

    def _drop(self, cutoff: _Cutoff) -> _Cutoff:
        address = self._all.pop(cutoff)
        here = self._waiting[address]
        here.pop(cutoff, None)
        if not here:
            del self._waiting[address]
        return cutoff

    def leave(self, cutoff: _Cutoff) -> None:
        with self._lock:
            if cutoff in self._all:
                self._drop(cutoff)

    def waiting(self) -> int:
        with self._lock:
            return len(self._all)

    def refusal(self, address: str, reason: str) -> Told | None:
        """Count a refusal; what to log of it now, or None."""
        with self._lock:
            self.refused[reason] += 1
            return self.log.refused(address, time.monotonic())


class _Connection:
    """One accepted connection's requests, served in order on its thread.

    On a MAC'd connection (`seals`) each request is verified before it counts: a write lands
    (`on_write`) only once its MAC matched, a call runs and a read is answered only then. The first
    frame that fails its MAC ends the connection's trust (`tampered`): later writes are drained
    unread, the next call or read is answered with the failure, and the connection closes."""

    def __init__(self, backend: TcpBackend, sock: socket.socket, peer: Peer, seals: Seals | None = None) -> None:
        self.backend = backend
        self.transports = backend.transports
        self.sock = sock
        self.peer = peer
        self.seals = seals
        self.pace = backend.pace
        self.failed = ""  # the first failed write since the last call: the next call reports it
        self.tampered = False  # a frame failed its MAC: nothing more is trusted
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
            header = read_sized(self.sock, _LEN.unpack_from(head, 1)[0])
            mac = None
            if self.seals is not None:
                mac = self.seals.rx.open()
                mac.update(head)
                mac.update(header)
            handler(header, mac)
            if self.tampered and handler != self.write:
                return  # the failure was answered; nothing after it is trusted

    def tamper(self, error: str) -> None:
        log.warning("from %s: %s", self.peer.name, error)
        self.tampered = True
        self.failed = self.failed or error

    def write(self, header: bytes, mac: _Mac | None = None) -> None:
        req = WriteFrame.from_bytes(header)
        total = sum(n for _, n in req.pieces)
        if self.tampered:
            self.drain(total + MAC_BYTES)
            return
        region = self.transports.region(req.region)
        spans = [(off, n) for off, n in req.pieces]
        error = ""
        if region is None:
            error = f"no region {req.region}"
        elif not region.writable:
            error = f"region {req.region} is read-only"
        else:
            error = region.bounds_error(spans)
        if error or not region.enter():
            if mac is None:
                self.drain(total + _SUM.size)
            else:
                self.drain(total, mac)
                if not sealed(self.sock, mac):  # its header too may have been changed: trust none of it
                    self.tamper(f"a write {MAC_FAILED} ({total} bytes)")
                    return
            self.landed(region, req, spans, error or f"region {req.region} is being unregistered")
            return
        try:
            h = mac if mac is not None else xxhash.xxh3_64()
            for off, n in spans:
                with region.buf[off: off + n] as part:
                    recv_into(self.sock, part, h)  # NOTE: each part hashed as it lands, while in cache
            if mac is not None:
                ok = sealed(self.sock, mac)
            else:
                ok = h.intdigest() == _SUM.unpack(recv_exactly(self.sock, _SUM.size))[0]
            error = "" if ok else (f"write {req.meta or ''} to region {req.region} "
                                   f"{MAC_FAILED if mac is not None else 'failed its checksum'} ({total} bytes)")
            if mac is not None and not ok:
                self.tampered = True
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

    def drain(self, n: int, h=None) -> None:
        while n:
            k = min(n, self._scratch.nbytes)
            recv_into(self.sock, self._scratch[:k], h)
            n -= k

    def reply(self, reply: ReplyFrame, views: Sequence[memoryview] = ()) -> None:
        body = reply.to_bytes()
        send_sealed(self.sock, _LEN.pack(len(body)) + body, views, self.seals.tx if self.seals else None, self.pace)

    def untrusted(self, what: str, mac: _Mac | None, tag: bytes | None = None) -> bool:
        """Whether a request must not be served: it failed its MAC, or an earlier frame did."""
        if mac is not None and not self.tampered and not sealed(self.sock, mac, tag):
            self.tamper(f"{what} {MAC_FAILED}")
        if self.tampered:
            self.reply(ReplyFrame(False, f"an earlier frame failed: {self.failed}"))
        return self.tampered

    def read(self, header: bytes, mac: _Mac | None = None) -> None:
        req = ReadFrame.from_bytes(header)
        if self.untrusted(f"a read of region {req.region}", mac):
            return
        region = self.transports.region(req.region)
        spans = [(off, n) for off, n in req.pieces]
        error = f"no region {req.region}" if region is None else region.bounds_error(spans)
        if error or not region.enter():
            self.reply(ReplyFrame(False, error or f"region {req.region} is gone"))
            return
        views = [region.buf[off: off + n] for off, n in spans]
        try:
            self.reply(ReplyFrame(True, nbytes=sum(n for _, n in spans)), views)
        finally:
            for v in views:
                v.release()
            region.leave()

    def call(self, header: bytes, mac: _Mac | None = None) -> None:
        req = CallFrame.from_bytes(header)
        tag = None
        if mac is not None and not self.tampered:
            got = recv_exactly(self.sock, req.nbytes + MAC_BYTES)  # the body and its tag in one read
            body, tag = got[:req.nbytes], got[req.nbytes:]
            mac.update(body)
        else:
            body = recv_exactly(self.sock, req.nbytes)
        if self.untrusted(f"call {req.op!r}", mac, tag):
            return
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
        self.reply(reply, [memoryview(out).cast("B")] if out else [])


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
