"""One interface for every point-to-point byte: the KV handoff, block pulls, pipeline slices.

The model is RDMA's (one-sided writes and reads into registered memory); TCP emulates it:

    owner of the memory                                  a peer
    ref = transports.register(id, buf, on_write)         (ref travels over NATS or in a call's reply)
                                                         ch = transports.connect(ref.endpoints)
                                                         ch.write(ref, [(offset, bytes), ...], meta)
    on_write(meta, pieces, error) once they landed       ...one write per layer slice...
    handle(op, fn): fn(body, peer) -> reply    <------   ch.call(op, body) -> reply   (the completion notice)
                                                         ch.read(ref, [(offset, into), ...])

- `write` is one-sided: the bytes land at those offsets of the peer's region; nothing answers it.
  It returns when the pieces may be reused. Every write carries a checksum of its bytes (tcp: a
  keyed MAC of the whole frame by default, see tcp.py; xxh3-64 where TLS or no cluster secret),
  which the owner verifies once, on arrival, before `on_write(meta, pieces, None)`; a write that fails
  (no such region, out of bounds, checksum mismatch, refused by `on_write`) is reported to the
  owner as `on_write(meta, pieces, error)` and to the writer by its next `call`.
- `call` is ordered after every write sent before it on the same channel (over all of its
  connections, when tcp stripes large writes over several): its handler runs once they have all
  landed and been verified, so a call is a completion notice, not a poll. A call
  after a failed write raises `TransportError` naming the failure (the handler does not run).
- `read` copies ranges of the peer's region into local buffers (e.g. straight into the DRAM slots
  a pull reserved); the reader verifies what it read against checksums it was told.
- Regions are registered once (RDMA: one memory registration) and unregistered when their owner
  is done; `unregister` waits for operations in flight on the region, so its memory may be freed.

Backends (`--transport auto|tcp|rdma`): `tcp` (tcp.py: the cluster-secret handshake, read
deadlines, recv_into straight into the region, sendmsg of memoryviews) and `rdma` (rdma.py, when
present: pyverbs one-sided WRITE/READ, same interface). A process runs the backends its mode
allows (`auto`: rdma when this host has an RDMA device, and tcp); a region's `RegionRef.endpoints`
lists every backend that serves it, and `connect` takes the first one both ends have (rdma
before tcp), so auto means rdma exactly when both ends have an RDMA device.

A backend implements `Backend` (listen, expose/withdraw a region, connect) and `Channel` (write,
read, call, close); the region table, the call handlers and the checksums are shared here.
"""

from __future__ import annotations

import importlib
import ipaddress
import socket
import logging
import threading
import time
from abc import ABC, abstractmethod
from typing import Callable, ClassVar, Sequence

import xxhash

from schemas.transfer import RegionRef

log = logging.getLogger(__name__)

MODES = ("auto", "tcp", "rdma")
STRIPE_MIN = 4 << 20  # tcp: bytes from which a write is striped over a channel's connections (see tcp.py)
SEND_FLOOR_S = 10.0  # tcp: every send (a frame and its payload) is over within max(this, bytes / SEND_MIN_RATE);
# above the 5 s a pipeline listener may wait for its region before it reads a frame's payload
SEND_MIN_RATE = 1e6  # bytes/s: a peer reading slower is cut off (tcp.py, _Sending)
PREFERENCE = ("rdma", "tcp")  # connect() takes the first backend both ends serve
_BACKENDS = {"tcp": "common.transport.tcp:TcpBackend", "rdma": "common.transport.rdma:RdmaBackend"}

Buffer = bytes | bytearray | memoryview
Pieces = Sequence[tuple[int, Buffer]]  # (offset in the region, bytes there)
OnWrite = Callable[[dict, list[tuple[int, int]], str | None], None]  # (meta, [(offset, nbytes)], error)
Handler = Callable[[bytes, "Peer"], bytes]


class TransportError(ConnectionError):
    """Raised when a peer cannot be reached, breaks a connection midway, misses a deadline, or
    reports that an operation failed (the message says which and why)."""


class TransportRefused(TransportError):
    """Raised when a peer does not prove that it holds the cluster secret."""


class TransportTurnedAway(TransportError):
    """Raised when a listener took the connection and closed it before the handshake ended: its
    door was crowded (tcp.py's `_Door` lets the oldest waiting handshake give way to a newcomer),
    it is going away, or it refused this end's secret (it does not say which: a stranger learns
    nothing). Unlike a port no one listens on, trying again may succeed."""


class RegionBusy(TransportError):
    """Raised by `unregister` when operations on the region did not end within the timeout."""


def checksum(pieces: Sequence[Buffer]) -> int:
    """xxh3-64 of the pieces' bytes, in order (equal to `common.kv.blocks.checksum` of their concatenation)."""
    h = xxhash.xxh3_64()
    for piece in pieces:
        h.update(piece)
    return h.intdigest()


class Region:
    """Local memory peers may write into (if `writable`) or read from, by id."""

    def __init__(self, region_id: str, buf: Buffer, on_write: OnWrite | None, writable: bool) -> None:
        self.id = region_id
        self.buf = memoryview(buf).cast("B")
        if writable and self.buf.readonly:
            raise ValueError(f"region {region_id}: a writable region needs writable memory")
        self.on_write = on_write
        self.writable = writable
        self.locators: dict[str, str] = {}  # backend -> how peers address this region there
        self._users = 0
        self._retired = False
        self._cond = threading.Condition()

    @property
    def nbytes(self) -> int:
        return self.buf.nbytes

    def enter(self) -> bool:
        """Start an operation on the region; False once it is being unregistered."""
        with self._cond:
            if self._retired:
                return False
            self._users += 1
            return True

    def leave(self) -> None:
        with self._cond:
            self._users -= 1
            self._cond.notify_all()

    def retire(self, timeout_s: float) -> None:
        with self._cond:
            self._retired = True
            if not self._cond.wait_for(lambda: self._users == 0, timeout_s):
                raise RegionBusy(f"region {self.id}: {self._users} operations still running after {timeout_s:g} s")
        self.buf.release()

    def bounds_error(self, pieces: Sequence[tuple[int, int]]) -> str:
        for offset, nbytes in pieces:
            if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
                return f"[{offset}, {offset + nbytes}) is outside region {self.id} of {self.nbytes} bytes"
        return ""


class Peer:
    """The far end of one connection, as a call handler sees it: `defer(fn)` runs fn when the
    connection ends (how a handler ties what it holds for the peer, e.g. pins, to the connection)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.state: dict = {}  # what handlers keep per connection
        self._on_close: list[Callable[[], None]] = []

    def defer(self, fn: Callable[[], None]) -> None:
        self._on_close.append(fn)

    def closed(self) -> None:
        for fn in reversed(self._on_close):
            try:
                fn()
            except Exception:  # one cleanup failing must not skip the others
                log.exception("cleanup after the connection from %s failed", self.name)
        self._on_close.clear()


class Channel(ABC):
    """One connection to a peer, used from one thread at a time (blocking calls)."""

    transport: ClassVar[str]

    @abstractmethod
    def write(self, dest: RegionRef, pieces: Pieces, meta: dict | None = None) -> None:
        """Put each piece at its offset of `dest`; returns when the pieces may be reused."""

    @abstractmethod
    def read(self, src: RegionRef, pieces: Pieces) -> None:
        """Fill each (writable) piece with the bytes at its offset of `src`."""

    @abstractmethod
    def call(self, op: str, body: bytes = b"") -> bytes:
        """The peer's handler for `op`, after every write before it has landed; its reply."""

    @abstractmethod
    def close(self) -> None:
        """Close the connection (the peer runs what its handlers deferred)."""

    def __enter__(self) -> "Channel":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Backend(ABC):
    """One way of moving bytes. It serves the shared region table and handlers of `transports`."""

    name: ClassVar[str]

    def __init__(self, transports: "Transports") -> None:
        self.transports = transports

    @classmethod
    def available(cls) -> bool:
        """Whether this host can use the backend at all (rdma: an RDMA device is present)."""
        return True

    @abstractmethod
    def listen(self, host: str, port: int, advertise: str = "") -> str:
        """Start serving peers; returns this process's locator for the backend (tcp: host:port)."""

    @abstractmethod
    def connect(self, locator: str, timeout_s: float) -> Channel:
        """A channel to the peer at `locator` (its secret proven both ways)."""

    def expose(self, region: Region) -> str:
        """Make a region reachable (rdma: register the memory); returns its locator for RegionRef."""
        return self.locator

    def withdraw(self, region: Region) -> None:
        """Undo `expose` (the region's operations have ended)."""

    @property
    @abstractmethod
    def locator(self) -> str:
        """This process's locator ('' before `listen`)."""

    def close(self) -> None:
        """Stop serving; connections still open end at their next read."""


def backend_class(name: str) -> type[Backend] | None:
    """The backend's class, or None where its module is absent or cannot load on this host."""
    module_name, _, cls_name = _BACKENDS[name].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return None
    return getattr(module, cls_name)


AUTO_PEERS = "auto"  # --link-peers auto: the networks this host is on (its interfaces', loopback included)


def networks(text: str) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    """'10.0.0.0/8,127.0.0.1' as networks, `auto` standing for this host's own (local_networks);
    raises ValueError naming what is not one."""
    found: list = []
    try:
        for part in (p.strip() for p in text.split(",")):
            if part == AUTO_PEERS:
                found += local_networks()
            elif part:
                found.append(ipaddress.ip_network(part, strict=False))
    except ValueError as exc:
        raise ValueError(f"link peers must be addresses or networks (CIDR) or 'auto', comma-separated: {exc}") from None
    return tuple(dict.fromkeys(found))


def local_networks() -> list:
    """The networks of this host's interfaces (a container's: its own networks; loopback too): the
    cluster's nodes on one machine, a compose network or a LAN segment, and no one beyond a router."""
    import psutil

    found = []
    for addresses in psutil.net_if_addrs().values():
        for a in addresses:
            if a.family not in (socket.AF_INET, socket.AF_INET6) or not a.netmask:
                continue
            try:  # an IPv6 netmask is given as an address: its prefix is its count of ones
                prefix = bin(int(ipaddress.ip_address(a.netmask))).count("1")
                found.append(ipaddress.ip_network(f"{a.address.split('%')[0]}/{prefix}", strict=False))
            except ValueError:
                continue
    return found


def admitted(address: str, allow: Sequence) -> bool:
    """Whether a peer at `address` may connect (an empty list admits any)."""
    if not allow:
        return True
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return any(ip in net for net in allow)


def resolve(mode: str) -> list[str]:
    """The backends a process runs under `--transport mode`, in preference order.

    auto: rdma (when this host has an RDMA device) and tcp; tcp: tcp only; rdma: rdma only (an
    error where this host cannot use it: the operator asked for it)."""
    if mode not in MODES:
        raise ValueError(f"transport must be one of {', '.join(MODES)}; got {mode!r}")
    names = []
    for name in PREFERENCE:
        if mode not in ("auto", name):
            continue
        cls = backend_class(name)
        if cls is not None and cls.available():
            names.append(name)
        elif mode == name:
            raise ValueError(f"--transport {name}: this host cannot use it (no backend or no device)")
    return names


class Transports:
    """A process's backends, with one region table and one set of call handlers shared by all."""

    def __init__(self, mode: str = "auto", secret: bytes | None = None, timeout_s: float = 30.0,
                 region_grace_s: float = 0.0, tcp_streams: int = 1, tcp_stripe_min: int = STRIPE_MIN,
                 tls=None, allow: str = "", link_mac: bool = True, send_floor_s: float = SEND_FLOOR_S,
                 send_min_rate: float = SEND_MIN_RATE) -> None:
        self.mode = mode
        self.secret = secret  # peers prove they hold it (the cluster secret); None: no proof asked
        self.tls = tls  # common.security.LinkTls: tcp connections are TLS with the link CA's certificates; None: plain
        # tcp without TLS: every frame this process sends on a connection it opens, and every answer,
        # carries a keyed MAC (tcp.py); False only to measure its cost (moonbus bench transfer)
        self.link_mac = link_mac
        self.send_floor_s, self.send_min_rate = send_floor_s, send_min_rate  # tcp: each send's deadline
        self.allow = networks(allow)  # the addresses tcp listeners take connections from (none listed: any)
        self.timeout_s = timeout_s  # connect, and every read of a frame (a deadline: a silent peer cannot hold on)
        self.region_grace_s = region_grace_s  # how long a write may wait for its region to be registered
        self.tcp_streams = tcp_streams  # connections per tcp channel a large write is striped over
        self.tcp_stripe_min = tcp_stripe_min  # bytes from which it is (parts of at least half)
        self.names = resolve("tcp" if tls is not None and mode == "auto" else mode)  # TLS is tcp's alone
        self.backends: dict[str, Backend] = {name: backend_class(name)(self) for name in self.names}
        self.regions: dict[str, Region] = {}  # region id -> Region
        self.handlers: dict[str, Handler] = {}  # call op -> handler
        self.on_refused: Callable[[str, str], None] | None = None  # (peer, why): a peer failed the handshake
        self._cond = threading.Condition()

    @property
    def label(self) -> str:
        """What heartbeats and events report, e.g. 'tcp' or 'rdma,tcp'."""
        return ",".join(self.names)

    def listen(self, host: str, port: int = 0, advertise: str = "") -> dict[str, str]:
        """Serve peers on every backend; returns backend -> locator. `port` is tcp's (0 = any free)."""
        return {name: b.listen(host, port if name == "tcp" else 0, advertise) for name, b in self.backends.items()}

    @property
    def endpoints(self) -> dict[str, str]:
        return {name: b.locator for name, b in self.backends.items() if b.locator}

    # --- regions (the owner's side) ---------------------------------------------------------------
    def register(self, region_id: str, buf: Buffer, on_write: OnWrite | None = None,
                 writable: bool = True) -> RegionRef:
        """Let peers write into (or only read from) `buf` as region `region_id`."""
        region = Region(region_id, buf, on_write, writable)
        for name, backend in self.backends.items():
            region.locators[name] = backend.expose(region)
        with self._cond:
            if region_id in self.regions:
                raise ValueError(f"region {region_id} is already registered")
            self.regions[region_id] = region
            self._cond.notify_all()
        return RegionRef(region_id, region.nbytes, {k: v for k, v in region.locators.items() if v})

    def unregister(self, region_id: str, timeout_s: float | None = None) -> bool:
        """Withdraw a region; waits for the operations on it to end. False if it was not registered."""
        with self._cond:
            region = self.regions.pop(region_id, None)
        if region is None:
            return False
        region.retire(self.timeout_s if timeout_s is None else timeout_s)
        for name, backend in self.backends.items():
            backend.withdraw(region)
        return True

    def region(self, region_id: str) -> Region | None:
        """A registered region, waiting up to `region_grace_s` for one not registered yet (a peer may
        start writing a moment before the owner has registered it, e.g. a pipeline stage)."""
        deadline = time.monotonic() + self.region_grace_s
        with self._cond:
            while region_id not in self.regions:
                left = deadline - time.monotonic()
                if left <= 0 or not self._cond.wait(left):
                    return self.regions.get(region_id)
            return self.regions[region_id]

    def handle(self, op: str, handler: Handler) -> None:
        """Answer peers' `call(op, body)` with `handler(body, peer) -> reply` (run on the connection's thread)."""
        self.handlers[op] = handler

    # --- the peer's side ------------------------------------------------------------------------------
    def choose(self, endpoints: dict[str, str]) -> str:
        for name in self.names:
            if endpoints.get(name):
                return name
        raise TransportError(f"no common transport: the peer offers {sorted(endpoints) or 'none'}, "
                             f"this process runs {self.names}")

    def connect(self, endpoints: dict[str, str], timeout_s: float | None = None) -> Channel:
        """A channel over the first backend both ends have (blocking: call it from a worker thread)."""
        name = self.choose(endpoints)
        return self.backends[name].connect(endpoints[name], self.timeout_s if timeout_s is None else timeout_s)

    def close(self) -> None:
        for backend in self.backends.values():
            backend.close()
