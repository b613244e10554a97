"""The receiving end of the streamed handoff: a request's KV lands in this node's memory, slice by slice.

    prefill (node P)                         messenger of node D (this)                 decode (node D)
    NATS accept(request, attempt, tokens,
         holder, decode instance) ---------> reserve the destination: a file in the node's
                                             shared memory, .in-<decode>__<request>-a<n>.kv.tmp,
                                             [L, 2, H, S, D] in the KV dtype, allocated at once,
                                             mapped and registered with the transports (RDMA:
                                <----------- one registration); AcceptKvReply(region)
    per layer slice, as soon as computed
    (the reused prefix too): write ------->  lands in place (TCP: recv_into the mapping); its
                                             checksum verified on arrival; counted (Coverage);
                                             each layer, once whole, fed in order to the
                                             file's checksum
    after the last layer: call "complete" -> ordered after the writes: every layer covered and
                                             no write failed -> unregister, the checksum's last
                                             layers, rename to
                                <----------- in-<decode>__<request>-a<n>.kv; KvHandle(checksum, verified);
                                             unmap after the reply
    NATS DecodeTask(handle) -------------------------------------------------------------> reads the file,
                                                                                          checking the checksum
                                                                                          as it reads

The decode checks the whole file again (common/kvfiles.py read_into) because it may change
between landing and reading. The messenger's checksum of it is taken layer by layer as each lands
whole, on the connection threads, so the tail pays one layer's hash (measured at 24 MB, 30 layers:
0.02 ms, where the whole file at completion would be 0.5 ms).

So decode starts on a completion notice, not a poll, and the tail after the last layer's compute
is one slice's transfer plus the notice's round trip, whatever the prompt's length.

Nothing leaks. A reservation is dropped (region unregistered, mapping closed, file removed) on:
abort (NATS, from its prefill: it failed, was cancelled, or finished at its first token; named by
request, attempt and decode instance, so it also covers a reservation whose reply was lost, and
an accept it overtook is refused); a
failed completion (a slice missing, corrupt or out of place); its prefill process leaving,
restarting or going silent past the peer timeout (heartbeats); its decode instance leaving or
restarting; no write for `idle_s` (a prefill that never finishes); a restart of this messenger
(its predecessor's temporary files are swept at start). Once complete, the file is a landed
`in-` file under common/kvfiles.py's rules (the decode reads and removes it, or sweeps it).

Threads: accept, abort and sweep run on the messenger's event loop; writes and the completion
notice arrive on the transport's connection threads. The table is guarded by a lock; dropping a
region waits for the operations on it, so callers on the loop run it in a worker thread.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from common import kvfiles, security
from common.kv.blocks import KvLayout
from common.kv.slices import Coverage, SliceGeometry
from common.transport import Peer, Transports
from schemas.transfer import AcceptKv, CompleteKv, CompleteKvReply, KvHandle, RegionRef

log = logging.getLogger(__name__)
TOMBSTONE_S = 600.0  # an aborted attempt's name is remembered this long: its late accept is refused


class HandoffRefused(ValueError):
    """Raised when a reservation cannot be made (a size outside the model's KV) or completed
    (unknown region, a slice missing, corrupt or out of place)."""


@dataclass
class Reservation:
    request: AcceptKv
    src_node: str
    name: str  # the landed file's name
    tmp: Path
    mapping: mmap.mmap
    region: str
    coverage: Coverage
    error: str = ""  # the first failed write
    created: float = field(default_factory=time.monotonic)
    last_write: float = field(default_factory=time.monotonic)
    hasher: Any = field(default_factory=xxhash.xxh3_64)  # the landed file's checksum, layers [0, hashed)
    hashed: int = 0
    hashing: threading.Lock = field(default_factory=threading.Lock)

    def on_write(self, meta: dict, pieces: list[tuple[int, int]], error: str | None) -> None:
        """A write landed (connection thread): count it, or remember why it failed."""
        self.last_write = time.monotonic()
        if error:
            self.error = self.error or error
            return
        try:
            self.coverage.add(meta, pieces)
        except ValueError as exc:  # not a slice of this request: the write (and the completion) fail
            self.error = self.error or str(exc)
            raise
        self.hash_layers()

    def hash_layers(self, rest: bool = False) -> int:
        """Feed the file's checksum the next layers that landed whole, in order (layers are
        contiguous in the file), or with `rest` every layer left (at completion, all landed);
        the checksum so far. A slice landing again after its layer was hashed, with other bytes,
        makes the decode refuse the file: never a silent difference."""
        geometry = self.coverage.geometry
        layer_nbytes = geometry.nbytes // geometry.num_layers
        with self.hashing:
            while self.hashed < geometry.num_layers and (rest or _whole(self.coverage.spans[self.hashed],
                                                                        geometry.num_tokens)):
                start = self.hashed * layer_nbytes
                with memoryview(self.mapping) as whole, whole[start:start + layer_nbytes] as layer:
                    self.hasher.update(layer)
                self.hashed += 1
            return self.hasher.intdigest()


class Reservations:
    """Destinations reserved on this node for streamed handoffs (region id -> Reservation)."""

    def __init__(self, node: str, shm_dir: Path, layout: KvLayout, max_tokens: int, transports: Transports,
                 idle_s: float, on_bytes=None) -> None:
        self.node = node
        self.shm_dir = shm_dir
        self.layout = layout
        self.max_tokens = max_tokens
        self.transports = transports
        self.idle_s = idle_s
        self.on_bytes = on_bytes  # (src node, nbytes) of each completed handoff, for metrics
        self.held: dict[str, Reservation] = {}  # region id -> reservation
        self.aborted: dict[str, float] = {}  # landed file name -> when its prefill aborted (monotonic)
        self._lock = threading.Lock()
        self._unmapper = ThreadPoolExecutor(1, thread_name_prefix="kv-unmap")  # completed mappings, off the reply's path
        transports.handle("complete", self.complete)

    # --- the loop's side --------------------------------------------------------------------------
    def accept(self, req: AcceptKv, src_node: str = "") -> RegionRef:
        """Reserve and register the destination of one request's KV."""
        if not 0 < req.num_tokens <= self.max_tokens:
            raise HandoffRefused(f"{req.num_tokens} tokens: this model's KV has 1 to {self.max_tokens}")
        shape = self.layout.request_shape(req.num_tokens)
        geometry = SliceGeometry(shape, self.layout.itemsize)
        name = landed_name(req.request_id, req.attempt, req.dest_instance)
        kvfiles.path_of(self.shm_dir, name)  # validates the name
        if name in self.aborted:  # NOTE: an abort may overtake its accept (both run in worker threads)
            raise HandoffRefused(f"request {req.request_id} attempt {req.attempt} was aborted by its prefill")
        with self._lock:
            again = [r.region for r in self.held.values() if r.name == name]
        for region in again:  # the same attempt asked again (its prefill was dispatched twice)
            self.drop(region, "reserved again")
        self.shm_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # checked private at the messenger's start
        tmp = self.shm_dir / f".{name}.tmp"
        # new, never through a link: anything already there (a link, another reservation's file) is refused
        fd = security.open_own(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL)
        try:
            os.posix_fallocate(fd, 0, geometry.nbytes)  # NOTE: out of shared memory fails here, not as a SIGBUS later
            mapping = mmap.mmap(fd, geometry.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        region = f"kv{secrets.token_hex(12)}"
        res = Reservation(req, src_node, name, tmp, mapping, region, Coverage(geometry))
        with self._lock:
            self.held[region] = res
        try:
            return self.transports.register(region, mapping, res.on_write)
        except BaseException:
            self.drop(region, "registration failed")
            raise

    def drop(self, region: str, why: str) -> bool:
        """Unregister, unmap and remove a reservation (waits for writes in flight on it)."""
        with self._lock:
            res = self.held.pop(region, None)
        if res is None:
            return False
        log.info("request %s: KV reservation %s dropped (%s)", res.request.request_id, region, why)
        try:
            self.transports.unregister(region)
        finally:
            _close(res.mapping)
            res.tmp.unlink(missing_ok=True)
        return True

    def abort(self, request_id: str, attempt: int, dest_instance: str) -> bool:
        """The prefill gave up on this attempt: drop its reservation, made or still to come."""
        name = landed_name(request_id, attempt, dest_instance)
        now = time.monotonic()
        with self._lock:
            self.aborted[name] = now
            for old in [n for n, t in self.aborted.items() if now - t > TOMBSTONE_S]:
                del self.aborted[old]
            regions = [r for r, res in self.held.items() if res.name == name]
        dropped = any([self.drop(region, "aborted by its prefill") for region in regions])
        # completed although its prefill gave up (the notice's reply was lost): no decode will read it
        (self.shm_dir / name).unlink(missing_ok=True)
        return dropped

    def expired(self, alive_holders: set[str] | None, live_decodes: set[str] | None) -> list[tuple[str, str]]:
        """(region, why) of reservations to drop: idle past `idle_s`, or whose prefill process
        (when `alive_holders` is given) or decode instance (when `live_decodes` is) is gone."""
        now = time.monotonic()
        out = []
        with self._lock:
            for region, res in self.held.items():
                if now - res.last_write > self.idle_s:
                    out.append((region, f"no write for {self.idle_s:g} s"))
                elif alive_holders is not None and res.request.holder not in alive_holders:
                    out.append((region, f"its prefill process {res.request.holder} is gone"))
                elif live_decodes is not None and res.request.dest_instance not in live_decodes:
                    out.append((region, f"its decode instance {res.request.dest_instance} is gone"))
        return out

    def of_holder(self, holder: str) -> list[str]:
        with self._lock:
            return [r for r, res in self.held.items() if res.request.holder == holder]

    def of_decode(self, instance_id: str) -> list[str]:
        with self._lock:
            return [r for r, res in self.held.items() if res.request.dest_instance == instance_id]

    def holders(self) -> set[str]:
        with self._lock:
            return {res.request.holder for res in self.held.values()}

    # --- the completion notice (a connection thread) ----------------------------------------------
    def complete(self, body: bytes, peer: Peer) -> bytes:
        req = CompleteKv.from_bytes(body)
        with self._lock:
            res = self.held.get(req.region)
        if res is None:
            raise HandoffRefused(f"no reservation {req.region} (dropped, or never made)")
        problem = res.error or res.coverage.missing()
        if problem:
            self.drop(req.region, f"incomplete: {problem}")
            raise HandoffRefused(f"request {res.request.request_id}: the KV did not land whole: {problem}")
        with self._lock:
            self.held.pop(req.region, None)
        try:
            self.transports.unregister(req.region)
            checksum = res.hash_layers(rest=True)  # no write comes after the unregistration
            os.replace(res.tmp, self.shm_dir / res.name)  # the decode never sees a partial file
        except BaseException:
            _close(res.mapping)
            res.tmp.unlink(missing_ok=True)
            raise
        # NOTE: unmapping costs time in proportion to the whole KV (4.7 ms at 47 MB, 63 ms at
        # 377 MB, measured), so it happens after the reply: the tail stays one slice plus a constant
        self._unmapper.submit(_close, res.mapping)
        if self.on_bytes is not None:
            self.on_bytes(res.src_node, res.coverage.nbytes)
        handle = KvHandle(self.node, res.name, list(self.layout.request_shape(res.request.num_tokens)), self.layout.dtype,
                          checksum, verified=True)  # its slices were; the decode checks the file as it reads
        return CompleteKvReply(True, handle).to_bytes()


def _whole(spans: list[tuple[int, int]], num_tokens: int) -> bool:
    """Whether token spans (in any order, overlapping or not) cover [0, num_tokens)."""
    covered = 0
    for a, b in sorted(list(spans)):  # a copy: a connection thread may be adding one
        if a > covered:
            break
        covered = max(covered, b)
    return covered >= num_tokens


def landed_name(request_id: str, attempt: int, dest_instance: str) -> str:
    return kvfiles.incoming_name(kvfiles.outgoing_name(request_id, attempt), dest_instance)


def _close(mapping: mmap.mmap) -> None:
    try:
        mapping.close()
    except BufferError:  # a view is still alive somewhere: the GC unmaps it later
        log.debug("a KV reservation's mapping still has views; left to the GC")
