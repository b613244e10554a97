"""The RDMA backend: the transport interface (common/transport) over pyverbs RC queue pairs.

    writer                                          owner of the region
    ch = connect(locator)   -- TCP control connection (cluster-secret handshake) --
    call "rdma-qp" {client, QPN, GID, PSN, MTU} ->  a QP for this client, connected; its endpoint
    QP connect (RTR, RTS)                           (one QP per pair of processes, made lazily, reused
                                                    by every later channel between them)
    write: RDMA WRITE of the pieces straight into the region (addr, rkey from its RegionRef, which
           travels over NATS), then call "rdma-landed" {region, pieces, meta, nonce, mac} without
           waiting for its reply:               -> verify the MAC over the landed bytes, on_write()
    call:  the replies of those notices first (a failed one fails the call, as over TCP), then the
           call itself on the control connection
    read:  RDMA READ from the region into the caller's buffers, then call "rdma-mac" {region,
           pieces, nonce}                       -> the MAC of those bytes there, checked here

Integrity. The control connection is the TCP backend's, with its keyed MAC on every frame (or TLS)
as the Transports are configured. The bytes RDMA moves pass no frame, so each write and each read
carries its own GMAC under a key of the cluster secret (tcp.derived_seal, a random nonce each):
bytes changed on the wire or in memory on the way, by a fault or by someone without the secret,
fail the write (the next call raises, as over TCP) or the read. With `link_mac=False` (to measure
its cost) a write carries the xxh3 of its bytes instead, and a read nothing; an owner that keys its
links refuses an unkeyed notice.

Memory is registered once: every region `expose`d (a slab, a handoff region) is one memory region;
a piece whose memory lies in a registered region moves zero-copy, any other piece through a
staging region registered at `listen` (copied in before a WRITE, out after a READ; two halves, so
that one is copied while the other is on the wire). Completions come through a completion channel
whose fd the backend's event loop thread watches with loop.add_reader: no busy poll.

Failover. A work request that fails (retries exceeded: the peer vanished; a broken QP; a remote
access error) or misses its deadline breaks the QP. The channel then redoes that write or read on
its control connection, which is the TCP backend's protocol served by the same region table, and
the backend fails the peer over to TCP for FAILOVER_S (later channels skip RDMA for it), reporting
it once through `Transports.on_failover(peer, reason)` when set. Where the control connection is
gone too, the operation raises TransportError: it fails, it never hangs.

NOTE: QP numbers and GIDs are exchanged on the control connection and regions' addresses and rkeys
in their RegionRef (over NATS): connect() gets only a locator, as every backend does.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import hmac
import json
import logging
import os
import queue
import threading
import time
from pathlib import Path
from typing import Callable

from common.transport import Backend, Channel, Peer, Pieces, Region, TransportError, checksum
from common.transport.rdma_verbs import QpEndpoint, RcQp, RdmaDevice, RdmaError, RdmaUnavailable, RemoteRegion, buffer_address
from common.transport.tcp import TcpBackend, TcpChannel, derived_seal, mac_of
from schemas.transfer import RegionRef

log = logging.getLogger(__name__)

STAGING_BYTES = 16 << 20  # per staging slot; two halves in flight
STAGING_SLOTS = 4  # channels copying through staging at once (more wait for a slot)
FAILOVER_S = 30.0  # after a failure, a peer is reached over TCP for this long, then RDMA is tried again
MAX_UNANSWERED = 256  # landed notices sent before their replies are read
OP_QP, OP_LANDED, OP_MAC = "rdma-qp", "rdma-landed", "rdma-mac"
NONCE_BYTES = 12
SYSFS = Path("/sys/class/infiniband")


def _active_ports() -> list[str]:
    return [str(p) for p in SYSFS.glob("*/ports/*/state") if "ACTIVE" in p.read_text()] if SYSFS.is_dir() else []


class _Loop:
    """The backend's event loop thread: it alone touches pyverbs objects (pyverbs is not thread-safe)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="rdma-completions", daemon=True)
        self.thread.start()

    def call(self, fn: Callable, *args, timeout_s: float = 30.0):
        async def run():
            return fn(*args)
        return self.submit(run(), timeout_s)

    def submit(self, coro, timeout_s: float):
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise RdmaError(f"the RDMA event loop did not answer within {timeout_s:g} s") from None

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class RdmaBackend(Backend):
    name = "rdma"

    def __init__(self, transports) -> None:
        super().__init__(transports)
        self.client_id = os.urandom(8).hex()  # this process, as peers' QP tables know it
        self.control = TcpBackend(transports)  # QP setup, landed notices, calls, and the failover path
        self.lp: _Loop | None = None
        self.device: RdmaDevice | None = None
        self.mrs: dict[str, object] = {}  # region id -> its memory registration
        self.qps: dict[str, tuple[RcQp, QpEndpoint]] = {}  # peer locator -> (our QP, its QP's endpoint)
        self.served: dict[str, RcQp] = {}  # client id -> the QP we made for that peer process
        self.failed_over: dict[str, float] = {}  # peer locator -> until when it is reached over TCP
        self.staging: queue.Queue = queue.Queue()  # free staging slots: (Region, its mapping)
        self.num_staging = 0  # allocated so far (at most STAGING_SLOTS, on demand)
        self._lock = threading.Lock()
        self._setup = threading.Lock()
        # the keyed MAC of the bytes each write and read moves (None: their xxh3, a write's only)
        keyed = transports.secret is not None and transports.link_mac
        self.seal = derived_seal(transports.secret, b"rdma bytes") if keyed else None

    @classmethod
    def available(cls) -> bool:
        """An RDMA device with an active port, and pyverbs to drive it."""
        if not _active_ports():
            return False
        try:
            from common.transport.rdma_verbs import load_pyverbs

            load_pyverbs()
        except RdmaUnavailable:
            return False
        return True

    @property
    def locator(self) -> str:
        return self.control.locator

    def listen(self, host: str, port: int, advertise: str = "") -> str:
        self._open()
        self.transports.handle(OP_QP, self._on_qp)  # served by every listener of the process
        self.transports.handle(OP_LANDED, self._on_landed)
        self.transports.handle(OP_MAC, self._on_mac)
        return self.control.listen(host, port, advertise)

    def _open(self) -> None:
        if self.device is not None:
            return
        self.lp = _Loop()
        self.device = self.lp.call(RdmaDevice)
        # NOTE: closed before the interpreter tears modules down: pyverbs objects freed by the
        # garbage collector at exit, in no particular order, can abort the process.
        atexit.register(self.close)
        self.lp.call(self.device.start, self.lp.loop)
        log.info("RDMA backend on %s port %d (GID %s, MTU code %d)", self.device.name, self.device.port,
                 self.device.gid, self.device.mtu)

    def expose(self, region: Region) -> str:
        """Register the region's memory (once); its locator "host:port/addr/rkey" carries the address
        and the rkey (host:port is empty for a region registered before `listen`: peers connect to
        the endpoints they know from heartbeats, and take only the address and rkey from here)."""
        self._open()
        mr = self.lp.call(self.device.register, region.buf, region.writable)
        self.mrs[region.id] = mr
        return f"{self.locator}/{mr.addr:x}/{mr.rkey:x}"

    def withdraw(self, region: Region) -> None:
        mr = self.mrs.pop(region.id, None)
        # NOTE: after close() there is nothing to deregister: closing the device freed its MRs
        # (a messenger closes its transports before it unregisters its slab)
        if mr is not None and self.device is not None:
            self.lp.call(self.device.deregister, mr)

    def take_staging(self, timeout_s: float):
        """A staging slot (registered once, made on first need); put it back in `staging` after use."""
        with self._lock:
            grow = self.staging.empty() and self.num_staging < STAGING_SLOTS
            self.num_staging += grow
        if grow:
            return self.lp.call(self.device.allocate, STAGING_BYTES)
        return self.staging.get(timeout=timeout_s)

    def connect(self, locator: str, timeout_s: float) -> Channel:
        peer = locator.split("/", 1)[0]
        if not peer:
            raise TransportError(f"rdma locator {locator!r} names no peer (a region registered before listen)")
        self._open()
        return RdmaChannel(self, peer, timeout_s)

    def close(self) -> None:
        self.control.close()
        if self.device is not None:
            with contextlib.suppress(Exception):
                self.lp.call(self.device.close, timeout_s=10)
            self.lp.stop()
            self.device = None

    # --- queue pairs, one per pair of processes ------------------------------------------------------
    def qp_for(self, peer: str, control: TcpChannel) -> RcQp | None:
        """Our QP to `peer`, made (or re-made, when the peer's process changed) through `control`;
        None while the peer is failed over to TCP."""
        if time.monotonic() < self.failed_over.get(peer, 0.0):
            return None
        with self._setup:  # one exchange at a time: two racing ones would replace each other's QP
            return self._exchange(peer, control)

    def _exchange(self, peer: str, control: TcpChannel) -> RcQp:
        for _ in range(2):  # a cached QP whose peer restarted is replaced once
            with self._lock:
                cached = self.qps.get(peer)
            qp = cached[0] if cached and not cached[0].broken else self.lp.call(self.device.create_qp)
            body = json.dumps({"client": self.client_id, "endpoint": qp.endpoint().__dict__}).encode()
            remote = QpEndpoint(**json.loads(control.call(OP_QP, body)))
            if cached and qp is cached[0] and remote == cached[1]:
                return qp
            if qp.connected:  # the peer made a new QP (it restarted): ours cannot be re-aimed
                self._drop_qp(peer, qp)
                continue
            self.lp.call(qp.connect, remote)
            with self._lock:
                old = self.qps.get(peer)
                self.qps[peer] = (qp, remote)
            if old and old[0] is not qp:
                self._close_qp(old[0])
            return qp
        raise TransportError(f"{peer}: the RDMA queue pair exchange did not settle")

    def _on_qp(self, body: bytes, peer: Peer) -> bytes:
        """A peer process's QP endpoint -> ours, connected to it (kept while it stays the same)."""
        request = json.loads(body)
        remote = QpEndpoint(**request["endpoint"])
        client = str(request["client"])
        with self._lock:
            qp = self.served.get(client)
        if qp is None or qp.broken or qp.remote != remote:
            fresh = self.lp.call(self.device.create_qp)
            self.lp.call(fresh.connect, remote)
            with self._lock:
                old, self.served[client] = self.served.get(client), fresh
            if old is not None:
                self._close_qp(old)
            qp = fresh
        return json.dumps(qp.endpoint().__dict__).encode()

    def _drop_qp(self, peer: str, qp: RcQp | None) -> None:
        if qp is None:
            return
        with self._lock:
            if self.qps.get(peer, (None,))[0] is qp:
                del self.qps[peer]
        self._close_qp(qp)

    def _close_qp(self, qp: RcQp) -> None:
        with contextlib.suppress(Exception):
            self.lp.call(qp.close)

    def fail_over(self, peer: str, qp: RcQp | None, why: str) -> None:
        """RDMA to `peer` failed: TCP for FAILOVER_S, reported once."""
        self._drop_qp(peer, qp)
        first = time.monotonic() >= self.failed_over.get(peer, 0.0)
        self.failed_over[peer] = time.monotonic() + FAILOVER_S
        if first:
            log.warning("RDMA to %s failed (%s): over TCP for the next %g s", peer, why, FAILOVER_S)
            hook = getattr(self.transports, "on_failover", None)
            if hook is not None:
                with contextlib.suppress(Exception):
                    hook(peer, why)

    # --- the owner's side of a write ---------------------------------------------------------------------
    def _on_landed(self, body: bytes, peer: Peer) -> bytes:
        """An RDMA WRITE into one of our regions has completed: verify it, then tell the owner."""
        note = json.loads(body)
        region, spans = self._entered(note)
        meta = note.get("meta") or {}
        error = ""
        try:
            views = [region.buf[off:off + n] for off, n in spans]
            if "mac" in note:
                if not hmac.compare_digest(bytes.fromhex(note["mac"]), self._mac(note, views)):
                    error = f"write {meta or ''} to region {region.id} failed its checksum (the link's keyed MAC)"
            elif self.seal is not None:  # no one may turn the keyed MAC off for this node's regions
                error = f"write {meta or ''} to region {region.id} came without the keyed MAC this node's links require"
            elif checksum(views) != int(note["sum"]):
                error = f"write {meta or ''} to region {region.id} failed its checksum"
            if region.on_write is not None:
                try:
                    region.on_write(meta, spans, error or None)
                except Exception as exc:  # refused by the owner
                    error = error or f"region {region.id} refused write {meta}: {exc}"
        finally:
            region.leave()
        if error:
            raise TransportError(error)
        return b""

    def _on_mac(self, body: bytes, peer: Peer) -> bytes:
        """The MAC of bytes of one of our regions that a peer has just read by RDMA."""
        note = json.loads(body)
        region, spans = self._entered(note)
        try:
            return self._mac(note, [region.buf[off:off + n] for off, n in spans])
        finally:
            region.leave()

    def _entered(self, note: dict) -> tuple[Region, list[tuple[int, int]]]:
        """The region a notice names, entered (the caller leaves it), and its spans, in bounds."""
        region = self.transports.region(note["region"])
        spans = [(int(o), int(n)) for o, n in note["pieces"]]
        error = f"no region {note['region']}" if region is None else region.bounds_error(spans)
        if error or not region.enter():
            raise TransportError(error or f"region {note['region']} is being unregistered")
        return region, spans

    def _mac(self, note: dict, views) -> bytes:
        if self.seal is None:
            raise TransportError("this node's links carry no keyed MAC (link_mac off)")
        nonce = bytes.fromhex(note["nonce"])
        if len(nonce) != NONCE_BYTES:
            raise TransportError(f"a nonce of {len(nonce)} bytes, not {NONCE_BYTES}")
        return mac_of(self.seal, nonce, views)


class RdmaChannel(Channel):
    """A channel to one peer: bytes by RDMA, control (and the fallback) on its TCP connection."""

    transport = "rdma"

    def __init__(self, backend: RdmaBackend, peer: str, timeout_s: float) -> None:
        self.backend = backend
        self.peer = peer
        self.timeout_s = timeout_s
        # the TCP backend's channel, keyed (or TLS) as the Transports are: the notices and the fallback
        self.control: TcpChannel = backend.control.connect(peer, timeout_s)
        self.unanswered = 0  # landed notices whose replies are not read yet
        self.failed = ""  # the first failed notice since the last call
        self.qp: RcQp | None = None
        try:
            self.qp = backend.qp_for(peer, self.control)
        except (RdmaError, TransportError, ValueError, KeyError, TypeError) as exc:
            self._fall_back(f"queue pair setup failed: {exc}")
        if self.qp is None:
            self.transport = "tcp"

    def _fall_back(self, why: str) -> None:
        qp, self.qp = self.qp, None
        self.transport = "tcp"
        self.backend.fail_over(self.peer, qp, why)

    # --- the interface -------------------------------------------------------------------------------------
    def write(self, dest: RegionRef, pieces: Pieces, meta: dict | None = None) -> None:
        remote = _remote(dest)
        if self.qp is not None and remote is not None:
            try:
                proof = self._rdma(self.qp.write, remote, pieces, to_remote=True)
            except RdmaError as exc:
                self._fall_back(str(exc))
            else:
                self._notice(dest, pieces, meta, proof)
                return
        self.control.write(dest, pieces, meta)

    def read(self, src: RegionRef, pieces: Pieces) -> None:
        remote = _remote(src)
        if self.qp is not None and remote is not None:
            try:
                self._rdma(self.qp.read, remote, pieces, to_remote=False)
            except RdmaError as exc:
                self._fall_back(str(exc))
            else:
                self._check_read(src, pieces)
                return
        self._collect()
        self.control.read(src, pieces)

    def call(self, op: str, body: bytes = b"") -> bytes:
        self._collect()
        if self.failed:
            failed, self.failed = self.failed, ""
            raise TransportError(f"{self.peer}: an earlier write failed: {failed}")
        return self.control.call(op, body)

    def close(self) -> None:
        self.control.close()

    # --- internals ---------------------------------------------------------------------------------------
    def _check_read(self, src: RegionRef, pieces: Pieces) -> None:
        """Bytes read by RDMA are what the owner holds: its MAC of them against ours."""
        if self.backend.seal is None:
            return
        nonce = os.urandom(NONCE_BYTES)
        spans = [[off, memoryview(buf).nbytes] for off, buf in pieces]
        theirs = self.call(OP_MAC, json.dumps({"region": src.region, "pieces": spans, "nonce": nonce.hex()}).encode())
        if not hmac.compare_digest(theirs, mac_of(self.backend.seal, nonce, [memoryview(b).cast("B") for _, b in pieces])):
            raise TransportError(f"{self.peer}: a read of region {src.region} failed its checksum (the link's keyed MAC)")

    def _rdma(self, op, remote: RemoteRegion, pieces: Pieces, to_remote: bool) -> dict:
        """Move every piece (zero-copy where its memory is registered, else through staging); for a
        write, what proves its bytes: {nonce, mac} (keyed) or {sum} (xxh3)."""
        backend = self.backend
        moved: list[memoryview] = []
        in_flight: list[concurrent.futures.Future] = []
        slot = None
        try:
            for offset, buf in pieces:
                view = memoryview(buf).cast("B")
                if offset < 0 or offset + view.nbytes > remote.length:
                    raise TransportError(f"[{offset}, {offset + view.nbytes}) is outside the peer's region "
                                         f"of {remote.length} bytes")
                moved.append(view)
                if not view.nbytes:
                    continue
                local = backend.device.find(buffer_address(view), view.nbytes, local_write=not to_remote)
                if local is not None:
                    in_flight.append(self._post(op, local, buffer_address(view) - local.addr, remote, offset,
                                                view.nbytes))
                    continue
                if slot is None:
                    slot = backend.take_staging(self.timeout_s)
                self._staged(op, slot, remote, offset, view, to_remote, in_flight)
            self._wait(in_flight)
        except queue.Empty:
            raise RdmaError(f"no staging slot free within {self.timeout_s:g} s") from None
        finally:
            concurrent.futures.wait(in_flight, timeout=self.timeout_s + 10)  # nothing outlives its buffers
            if slot is not None:
                backend.staging.put(slot)
        if not to_remote:
            return {}
        if backend.seal is None:
            return {"sum": checksum(moved)}
        nonce = os.urandom(NONCE_BYTES)
        return {"nonce": nonce.hex(), "mac": mac_of(backend.seal, nonce, moved).hex()}

    def _staged(self, op, slot, remote: RemoteRegion, offset: int, view: memoryview, to_remote: bool,
                in_flight: list) -> None:
        """view <-> remote through the staging slot's two halves: one is copied while the other moves."""
        region, mapping = slot
        half = region.length // 2
        halves: list[concurrent.futures.Future | None] = [None, None]
        for i, start in enumerate(range(0, view.nbytes, half)):
            size = min(half, view.nbytes - start)
            which = i % 2
            if halves[which] is not None:
                self._wait([halves[which]])
            base = which * half
            if to_remote:
                mapping[base:base + size] = view[start:start + size]
                halves[which] = self._post(op, region, base, remote, offset + start, size)
            else:  # NOTE: reads are not overlapped: the copy out needs the bytes in first
                self._wait([self._post(op, region, base, remote, offset + start, size)])
                view[start:start + size] = mapping[base:base + size]
            if halves[which] is not None:
                in_flight.append(halves[which])
        self._wait([f for f in halves if f is not None])

    def _post(self, op, local, local_offset: int, remote: RemoteRegion, offset: int, size: int):
        coro = op(local, local_offset, remote, offset, size, self.timeout_s)
        return asyncio.run_coroutine_threadsafe(coro, self.backend.lp.loop)

    def _wait(self, futures: list) -> None:
        done, pending = concurrent.futures.wait(futures, timeout=self.timeout_s + 5)
        if pending:
            raise RdmaError(f"RDMA operations to {self.peer} did not finish within {self.timeout_s:g} s")
        for future in done:
            exc = future.exception()
            if exc is not None:
                raise exc if isinstance(exc, RdmaError) else RdmaError(str(exc))

    def _notice(self, dest: RegionRef, pieces: Pieces, meta: dict | None, proof: dict) -> None:
        """Tell the owner what landed (its reply is read later: writes stay one-sided)."""
        spans = [[off, memoryview(buf).nbytes] for off, buf in pieces]
        self.control.post(OP_LANDED, json.dumps({"region": dest.region, "pieces": spans, "meta": meta or {}} | proof).encode())
        self.unanswered += 1
        if self.unanswered >= MAX_UNANSWERED:
            self._collect()

    def _collect(self) -> None:
        """Read the replies to the landed notices sent so far (in order: the peer serves them in order)."""
        while self.unanswered:
            reply, _ = self.control.answer()
            self.unanswered -= 1
            if not reply.ok and not self.failed:
                self.failed = reply.error


def _remote(ref: RegionRef) -> RemoteRegion | None:
    """The region's address and rkey, from its rdma locator "host:port/addr/rkey" (None: not exposed)."""
    locator = ref.endpoints.get("rdma", "")
    parts = locator.split("/")
    if len(parts) != 3:
        return None
    return RemoteRegion(int(parts[1], 16), int(parts[2], 16), ref.nbytes)
