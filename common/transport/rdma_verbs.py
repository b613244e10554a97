"""pyverbs for asyncio: one device per process, RC queue pairs, one-sided WRITE and READ.

    RdmaDevice   the device context, one protection domain, one completion queue fed through a
                 completion channel whose fd the event loop watches (loop.add_reader: no busy
                 poll, no thread); memory regions registered once (register / allocate)
    RcQp         one reliable-connected queue pair to one peer: endpoint() is what the peer
                 needs to connect to it (QPN, GID, PSN, MTU), connect() takes the peer's
    Region       registered memory: addr, length, lkey, rkey (RemoteRegion: a peer's, by rkey)

A WRITE or READ is cut into work requests of at most WR_BYTES, at most QP_WINDOW in flight, each
signaled, each completing a future keyed by its wr_id. A failed completion (retries exceeded, a
remote access error, the QP gone to the error state) or a deadline passing raises RdmaError and
leaves the QP `broken`: it is moved to the error state, which flushes whatever is still posted,
and its outstanding work is waited out before the error is raised, so that no WR still reads or
writes a buffer its caller is about to reuse. A broken QP is not reused; the caller makes a new
one (or fails over).

pyverbs comes from rdma-core (Debian/Ubuntu: python3-pyverbs); `import pyverbs` failing or no
active port with a RoCEv2 (or InfiniBand) GID raises RdmaUnavailable.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import mmap
import os
import random
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

WR_BYTES = 1 << 20  # one work request moves at most this much (progress and retries stay fine-grained)
QP_WINDOW = 32  # work requests in flight per QP
CQ_DEPTH = 4096
QP_TIMEOUT = 15  # local ACK timeout: 4.096 us * 2^15 = 134 ms per try
# then IBV_WC_RETRY_EXC_ERR: a vanished peer fails in about a second. NOTE: not 7, which soft-RoCE
# (rdma_rxe) takes as "retry forever"; the deadline would be all that ends the wait.
QP_RETRY_CNT = 6
DRAIN_S = 5.0  # how long a broken QP's flushed work requests are waited for


class RdmaUnavailable(RuntimeError):
    """Raised when pyverbs is not installed or no RDMA device has an active port with a usable GID."""


class RdmaError(ConnectionError):
    """Raised when a work request fails (its completion's status says why) or does not complete in
    time; the queue pair it ran on is broken from then on."""


@dataclass(frozen=True)
class QpEndpoint:
    """What a peer needs to connect its RC queue pair to ours (exchanged over NATS)."""

    gid: str  # "xxxx:...:xxxx"; for RoCEv2 the IPv4-mapped one (::ffff:a.b.c.d)
    qpn: int
    psn: int
    lid: int  # InfiniBand only (0 on RoCE)
    mtu: int  # an IBV_MTU_* value; each side uses the smaller of both


@dataclass(frozen=True)
class RemoteRegion:
    """A peer's registered memory, as far as one-sided operations need it."""

    addr: int
    rkey: int
    length: int


@dataclass(frozen=True)
class Region:
    """Registered local memory. `mr` keeps the registration alive; `keepalive` the memory."""

    addr: int
    length: int
    lkey: int
    rkey: int
    mr: object
    keepalive: object = None
    local_write: bool = True  # READs may land in it

    def remote(self) -> RemoteRegion:
        return RemoteRegion(self.addr, self.rkey, self.length)


SYSTEM_PYVERBS = "/usr/lib/python3/dist-packages"  # where Debian/Ubuntu's python3-pyverbs installs it


def load_pyverbs():
    """(device, pd, cq, qp, mr, wr, addr, enums) modules; RdmaUnavailable when pyverbs is missing.

    NOTE: a venv does not see the system's dist-packages, where python3-pyverbs lives. When its
    extension was built for this interpreter (same cpython ABI tag), that directory is appended to
    sys.path: at the end, so that the venv's own packages still win."""
    try:
        import pyverbs  # noqa: F401
    except ImportError:
        tag = sysconfig.get_config_var("SOABI") or ""
        built = list(Path(SYSTEM_PYVERBS, "pyverbs").glob(f"*.{tag}.so")) if tag else []
        if built and SYSTEM_PYVERBS not in sys.path:
            sys.path.append(SYSTEM_PYVERBS)
    try:
        import pyverbs.addr as addr
        import pyverbs.cq as cq
        import pyverbs.device as device
        import pyverbs.enums as enums
        import pyverbs.mr as mr
        import pyverbs.pd as pd
        import pyverbs.qp as qp
        import pyverbs.wr as wr
    except ImportError as exc:
        raise RdmaUnavailable(f"pyverbs is not installed ({exc}); on Debian/Ubuntu: apt-get install python3-pyverbs") from exc
    return device, pd, cq, qp, mr, wr, addr, enums


def buffer_address(buffer) -> int:
    """The address of a buffer's first byte (mmap, bytearray, bytes, memoryview); nothing is kept."""
    return int(np.frombuffer(buffer, dtype=np.uint8).ctypes.data)


class RdmaDevice:
    def __init__(self, name: str = "", port: int = 1, gid_index: int = -1) -> None:
        """Open `name` (or the first device with an active port); gid_index -1 picks the first RoCEv2
        IPv4-mapped GID (or GID 0 on InfiniBand)."""
        self.v = v = load_pyverbs()
        device, pd, cq, _, _, _, _, e = v
        names = [d.name.decode() if isinstance(d.name, bytes) else d.name for d in device.get_device_list()]
        if name and name not in names:
            raise RdmaUnavailable(f"no RDMA device {name!r} (devices: {', '.join(names) or 'none'})")
        if not names:
            raise RdmaUnavailable("no RDMA device (rdma link show lists none)")
        self.name = name or names[0]
        self.port = port
        self.ctx = device.Context(name=self.name)
        attr = self.ctx.query_port(port)
        if attr.state != e.IBV_PORT_ACTIVE:
            raise RdmaUnavailable(f"{self.name} port {port} is not active")
        self.lid = attr.lid
        self.mtu = attr.active_mtu
        self.gid_index = gid_index if gid_index >= 0 else self._pick_gid(attr.gid_tbl_len)
        self.gid = str(self.ctx.query_gid(port, self.gid_index))
        self.rd_atomic = max(1, min(16, self.ctx.query_device().max_qp_rd_atom))
        self.pd = pd.PD(self.ctx)
        before = _event_fds()
        self.channel = cq.CompChannel(self.ctx)
        # NOTE: pyverbs does not expose the channel's fd; it is the one infinibandevent fd that
        # creating the channel opened.
        opened = _event_fds() - before
        if len(opened) != 1:
            raise RdmaUnavailable(f"cannot find the completion channel's fd (new event fds: {sorted(opened)})")
        self.channel_fd = opened.pop()
        self.cq = cq.CQ(self.ctx, CQ_DEPTH, None, self.channel, 0)
        self.waiting: dict[int, asyncio.Future] = {}  # wr_id -> the future its completion resolves
        self.wr_ids = itertools.count(1)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.regions: list[Region] = []
        self.qps: list[RcQp] = []

    def _pick_gid(self, table_len: int) -> int:
        e = self.v[7]
        for index in range(table_len):
            try:
                gid = str(self.ctx.query_gid(self.port, index))
                kind = self.ctx.query_gid_type(self.port, index)
            except Exception:  # an empty slot of the table
                continue
            if kind == e.IBV_GID_TYPE_SYSFS_ROCE_V2 and gid.startswith("0000:0000:0000:0000:0000:ffff:"):
                return index
            if kind == e.IBV_GID_TYPE_SYSFS_IB_ROCE_V1 and self.lid:  # InfiniBand: LID-routed, GID 0
                return 0
        raise RdmaUnavailable(f"{self.name} port {self.port} has no RoCEv2 IPv4-mapped GID (is its netdev up "
                              "with an IPv4 address?)")

    # --- the event loop's side --------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Watch the completion channel from `loop` (the running one by default)."""
        self.loop = loop or asyncio.get_running_loop()
        self.cq.req_notify()
        self.loop.add_reader(self.channel_fd, self._on_channel)

    def _on_channel(self) -> None:
        """The channel is readable: take the event, re-arm, then drain the CQ. Re-arming before the
        last poll means a completion that lands in between raises a new event instead of waiting."""
        try:
            self.channel.get_cq_event(self.cq)
            self.cq.ack_events(1)
            self.cq.req_notify()
        except Exception:
            log.exception("RDMA %s: completion channel failed", self.name)
            return
        self.drain_cq()

    def drain_cq(self) -> None:
        e = self.v[7]
        while True:
            count, wcs = self.cq.poll(64)
            if count <= 0:
                return
            for wc in wcs[:count]:
                future = self.waiting.pop(wc.wr_id, None)
                if future is None or future.done():
                    continue
                if wc.status == e.IBV_WC_SUCCESS:
                    future.set_result(wc.byte_len)
                else:
                    future.set_exception(RdmaError(f"work request {wc.wr_id} failed: {_wc_status(wc.status)} "
                                                   f"(vendor error {wc.vendor_err})"))

    # --- memory ------------------------------------------------------------------------------------
    def register(self, buffer, remote_write: bool = True, keepalive: object = None) -> Region:
        """Register memory once (a slab, a handoff region): peers may read it, and write it if
        `remote_write`; local READs may land in it when the buffer is writable. The caller keeps the
        memory alive until `deregister` (or passes it as `keepalive`)."""
        mr_mod, e = self.v[4], self.v[7]
        view = memoryview(buffer)
        length, local_write = view.nbytes, not view.readonly
        view.release()
        access = e.IBV_ACCESS_REMOTE_READ
        if local_write:
            access |= e.IBV_ACCESS_LOCAL_WRITE
        if remote_write and local_write:
            access |= e.IBV_ACCESS_REMOTE_WRITE
        address = buffer_address(buffer)
        mr = mr_mod.MR(self.pd, length, access, address=address)
        region = Region(address, length, mr.lkey, mr.rkey, mr, keepalive, local_write)
        self.regions.append(region)
        return region

    def deregister(self, region: Region) -> None:
        """After this, the device touches the memory no more (a peer's access to it fails)."""
        if region in self.regions:
            self.regions.remove(region)
            region.mr.close()

    def find(self, address: int, nbytes: int, local_write: bool) -> Region | None:
        """The registered region holding [address, address + nbytes) (a zero-copy source, or with
        `local_write` a destination for READs), if any."""
        for region in self.regions:
            if (region.addr <= address and address + nbytes <= region.addr + region.length
                    and (region.local_write or not local_write)):
                return region
        return None

    def allocate(self, length: int) -> tuple[Region, mmap.mmap]:
        """New page-aligned anonymous memory, registered (a handoff region); (region, its mapping)."""
        mapping = mmap.mmap(-1, length)
        return self.register(mapping, keepalive=mapping), mapping

    # --- queue pairs -------------------------------------------------------------------------------
    def create_qp(self) -> "RcQp":
        qp = RcQp(self)
        self.qps.append(qp)
        return qp

    def close(self) -> None:
        """Remove the reader, fail what still waits, destroy QPs, MRs, CQ, channel, PD, context."""
        if self.loop is not None and not self.loop.is_closed():
            self.loop.remove_reader(self.channel_fd)
        for future in self.waiting.values():
            if not future.done():
                future.set_exception(RdmaError("the RDMA device was closed"))
        self.waiting.clear()
        for qp in list(self.qps):
            qp.close()
        for region in self.regions:
            region.mr.close()
        self.regions.clear()
        for obj in (self.cq, self.channel, self.pd, self.ctx):
            obj.close()


class RcQp:
    """One reliable-connected queue pair (INIT on creation; connect() takes it to RTS)."""

    def __init__(self, device: RdmaDevice) -> None:
        self.device = device
        _, _, _, qp, _, _, _, e = device.v
        cap = qp.QPCap(max_send_wr=2 * QP_WINDOW, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        init = qp.QPInitAttr(qp_type=e.IBV_QPT_RC, scq=device.cq, rcq=device.cq, cap=cap, sq_sig_all=1)
        attr = qp.QPAttr(qp_state=e.IBV_QPS_INIT, port_num=device.port)
        attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ
        attr.pkey_index = 0
        self.qp = qp.QP(device.pd, init, attr)  # left in INIT
        self.qpn = self.qp.qp_num
        self.psn = random.getrandbits(24)
        self.window = asyncio.Semaphore(QP_WINDOW)
        self.broken = ""  # why it cannot be used any more ("" while it can)
        self.connected = False
        self.remote: QpEndpoint | None = None  # what it is connected to
        self.in_flight: set[int] = set()

    def endpoint(self) -> QpEndpoint:
        d = self.device
        return QpEndpoint(d.gid, self.qpn, self.psn, d.lid, d.mtu)

    def connect(self, remote: QpEndpoint) -> None:
        """INIT -> RTR (towards `remote`) -> RTS."""
        d = self.device
        _, _, _, qp, _, _, addr, e = d.v
        attr = qp.QPAttr(qp_state=e.IBV_QPS_RTR, cur_qp_state=e.IBV_QPS_INIT, port_num=d.port,
                         path_mtu=min(d.mtu, remote.mtu))
        attr.dest_qp_num = remote.qpn
        attr.rq_psn = remote.psn
        attr.max_dest_rd_atomic = d.rd_atomic
        attr.min_rnr_timer = 12
        route = addr.GlobalRoute(dgid=addr.GID(remote.gid), sgid_index=d.gid_index, hop_limit=64)
        attr.ah_attr = addr.AHAttr(is_global=1, gr=route, dlid=remote.lid, port_num=d.port)
        self.qp.to_rtr(attr)
        attr.qp_state = e.IBV_QPS_RTS
        attr.cur_qp_state = e.IBV_QPS_RTR
        attr.timeout = QP_TIMEOUT
        attr.retry_cnt = QP_RETRY_CNT
        attr.rnr_retry = 7
        attr.sq_psn = self.psn
        attr.max_rd_atomic = d.rd_atomic
        self.qp.to_rts(attr)
        self.connected = True
        self.remote = remote

    async def write(self, local: Region, offset: int, remote: RemoteRegion, remote_offset: int, nbytes: int,
                    timeout_s: float) -> None:
        """One-sided RDMA WRITE of local[offset:offset+nbytes] to remote[remote_offset:...]."""
        await self._transfer(self.device.v[7].IBV_WR_RDMA_WRITE, local, offset, remote, remote_offset, nbytes, timeout_s)

    async def read(self, local: Region, offset: int, remote: RemoteRegion, remote_offset: int, nbytes: int,
                   timeout_s: float) -> None:
        """One-sided RDMA READ of remote[remote_offset:remote_offset+nbytes] into local[offset:...]."""
        await self._transfer(self.device.v[7].IBV_WR_RDMA_READ, local, offset, remote, remote_offset, nbytes, timeout_s)

    async def _transfer(self, opcode: int, local: Region, offset: int, remote: RemoteRegion, remote_offset: int,
                        nbytes: int, timeout_s: float) -> None:
        if self.broken or self.qp is None:
            raise RdmaError(f"queue pair is broken: {self.broken or 'closed'}")
        if not self.connected:
            raise RdmaError(f"queue pair {self.qpn} is not connected")
        if offset < 0 or offset + nbytes > local.length or remote_offset < 0 or remote_offset + nbytes > remote.length:
            raise ValueError(f"{nbytes} bytes at {offset} / {remote_offset} exceed the regions "
                             f"({local.length} / {remote.length} bytes)")
        deadline = time.monotonic() + timeout_s
        futures = []
        try:
            for start in range(0, nbytes, WR_BYTES):
                size = min(WR_BYTES, nbytes - start)
                await asyncio.wait_for(self.window.acquire(), max(0.0, deadline - time.monotonic()))
                future = self._post(opcode, local, offset + start, remote, remote_offset + start, size)
                future.add_done_callback(lambda _: self.window.release())
                futures.append(future)
            await asyncio.wait_for(asyncio.gather(*futures), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            await self.fail(f"no completion within {timeout_s:g} s")
            raise RdmaError(f"queue pair {self.qpn}: no completion within {timeout_s:g} s") from None
        except RdmaError as exc:
            await self.fail(str(exc))
            raise
        except BaseException:  # cancelled: the posted work must not outlive its caller's buffers
            await self.fail("cancelled")
            raise

    def _post(self, opcode: int, local: Region, offset: int, remote: RemoteRegion, remote_offset: int,
              size: int) -> asyncio.Future:
        d = self.device
        wr_mod, e = d.v[5], d.v[7]
        wr_id = next(d.wr_ids)
        sge = wr_mod.SGE(local.addr + offset, size, local.lkey)
        wr = wr_mod.SendWR(wr_id=wr_id, opcode=opcode, num_sge=1, sg=[sge], send_flags=e.IBV_SEND_SIGNALED)
        wr.set_wr_rdma(remote.rkey, remote.addr + remote_offset)
        future = d.loop.create_future()
        d.waiting[wr_id] = future
        self.in_flight.add(wr_id)
        future.add_done_callback(lambda _: self.in_flight.discard(wr_id))
        try:
            self.qp.post_send(wr)
        except Exception as exc:
            d.waiting.pop(wr_id, None)
            future.set_exception(RdmaError(f"post_send failed: {exc}"))
        return future

    async def fail(self, why: str) -> None:
        """Mark broken, move to the error state (flushing posted work) and wait that work out."""
        if not self.broken:
            self.broken = why
            log.warning("RDMA queue pair %d broken: %s", self.qpn, why)
        e, qp = self.device.v[7], self.device.v[3]
        try:
            if self.qp is not None:
                self.qp.modify(qp.QPAttr(qp_state=e.IBV_QPS_ERR), e.IBV_QP_STATE)
        except Exception as exc:
            log.warning("RDMA queue pair %d: cannot move to the error state: %s", self.qpn, exc)
        pending = [self.device.waiting[w] for w in self.in_flight if w in self.device.waiting]
        if pending:
            await asyncio.wait(pending, timeout=DRAIN_S)
            self.device.drain_cq()  # flushed completions may not raise a channel event
        for future in pending:
            if not future.done():
                future.set_exception(RdmaError(why))
            elif not future.cancelled():
                future.exception()  # retrieved: no "never retrieved" warning

    def close(self) -> None:
        if self.qp is not None:
            self.broken = self.broken or "closed"
            self.qp.close()
            self.qp = None
        if self in self.device.qps:
            self.device.qps.remove(self)


def _event_fds() -> set[int]:
    out = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if "infinibandevent" in os.readlink(f"/proc/self/fd/{name}"):
                out.add(int(name))
        except OSError:
            continue
    return out


def _wc_status(status: int) -> str:
    """IBV_WC_RETRY_EXC_ERR and the like, from pyverbs' enums."""
    import pyverbs.enums as e

    names = [n for n in dir(e) if n.startswith("IBV_WC_") and (n.endswith("_ERR") or n == "IBV_WC_SUCCESS")]
    return next((n for n in names if getattr(e, n) == status), f"status {status}")
