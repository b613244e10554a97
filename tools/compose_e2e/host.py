"""What a Docker daemon changes on the host, captured before it starts and put back after it stops.

dockerd (20.10, as Debian ships it) changes, when it runs with its defaults: iptables (its own
chains, the FORWARD policy set to DROP), net.ipv4.ip_forward (set to 1), interfaces (docker0,
br-<id> per network, veth pairs), mounts (a bind mount of its data-root on itself, the
network-namespace files under /run/docker/netns) and runtime files (/run/docker, its socket and
pid file); after it exits, the netns mount and /run/docker stay. The engine we start avoids most
of that (engine.py: --iptables=false --ip-forward=false --bridge=none); HostState checks the rest
and undoes it, and the test asserts that the host equals the snapshot afterwards.

Only what dockerd could have done is undone: interfaces with Docker's names (added ones
deleted; bridges that were there before and that the daemon removed, e.g. a docker0 left by an
earlier engine, recreated with their MTU and addresses), mounts and files under Docker's paths,
the sysctls it writes, and the iptables tables (restored from the snapshot only when they differ
from it). `obstacles()` says what on the host would keep the test's containers from talking.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

# sysctls dockerd writes (forwarding for its NAT, bridge netfilter for its isolation rules)
SYSCTLS = (
    "/proc/sys/net/ipv4/ip_forward",
    "/proc/sys/net/ipv6/conf/all/forwarding",
    "/proc/sys/net/ipv6/conf/default/forwarding",
    "/proc/sys/net/bridge/bridge-nf-call-iptables",
    "/proc/sys/net/bridge/bridge-nf-call-ip6tables",
)
# runtime paths dockerd creates (/var/run is /run on Debian)
# (containerd's shims put their sockets under /run/containerd/s whatever its state dir is;
# /run/mount is util-linux's, left by the mount commands debootstrap runs for a base image)
RUNTIME_PATHS = ("/run/docker", "/run/docker.sock", "/run/docker.pid", "/run/containerd", "/run/mount")
IPTABLES = {"ipv4": ("iptables-save", "iptables-restore", "ip"), "ipv6": ("ip6tables-save", "ip6tables-restore", "ip6")}
MNT_DETACH = 2
DOCKER_LINK = re.compile(r"^(docker0|docker_gwbridge|br-[0-9a-f]{12}|veth[0-9a-f]{7})$")
BRIDGE_NF = "/proc/sys/net/bridge/bridge-nf-call-iptables"


class HostNotRestored(RuntimeError):
    """Raised when the host still differs from its snapshot after restore() did what it could."""


@dataclass(frozen=True)
class HostState:
    iptables: dict[str, str] = field(default_factory=dict)  # family -> normalized *-save output
    sysctls: dict[str, str] = field(default_factory=dict)  # /proc/sys path -> value
    links: tuple[str, ...] = ()  # network interface names
    link_details: dict[str, dict] = field(default_factory=dict)  # Docker-named link -> kind, mtu, up, addresses
    mounts: tuple[str, ...] = ()  # mount points under Docker's paths
    paths: tuple[str, ...] = ()  # RUNTIME_PATHS that exist
    watched: tuple[str, ...] = ()  # the mount prefixes this snapshot looked under

    @classmethod
    def capture(cls, data_root: Path) -> "HostState":
        """The host now; mounts are looked for under Docker's paths and `data_root`."""
        return cls.capture_under(tuple(sorted({"/run/docker", "/var/lib/docker", str(data_root)})))

    @classmethod
    def capture_under(cls, watched: tuple[str, ...]) -> "HostState":
        return cls(
            iptables={family: text for family, (save, _, _) in IPTABLES.items()
                      if (text := _iptables_save(save)) is not None},
            sysctls={path: Path(path).read_text().strip() for path in SYSCTLS if os.path.exists(path)},
            links=tuple(sorted(os.listdir("/sys/class/net"))),
            link_details=_docker_links(),
            mounts=_mounts_under(watched),
            paths=tuple(p for p in RUNTIME_PATHS if os.path.lexists(p)),
            watched=watched,
        )

    def differences(self, other: "HostState") -> list[str]:
        """What `other` (the host now) changed relative to this snapshot, in words; [] if nothing."""
        diffs = []
        for family in sorted(set(self.iptables) | set(other.iptables)):
            if self.iptables.get(family) != other.iptables.get(family):
                diffs.append(f"{family} iptables: was {self.iptables.get(family)!r}, now {other.iptables.get(family)!r}")
        for path in sorted(set(self.sysctls) | set(other.sysctls)):
            if self.sysctls.get(path) != other.sysctls.get(path):
                diffs.append(f"{path}: was {self.sysctls.get(path)}, now {other.sysctls.get(path)}")
        for kind in ("links", "mounts", "paths"):
            before, now = set(getattr(self, kind)), set(getattr(other, kind))
            if kind == "links":  # other work on this host may add its own; only Docker's count
                before, now = ({n for n in names if DOCKER_LINK.match(n)} for names in (before, now))
            if before != now:
                diffs.append(f"{kind}: added {sorted(now - before)}, removed {sorted(before - now)}")
        return diffs

    def restore(self) -> None:
        """Undo what a Docker daemon changed since this snapshot. Run it after the daemon exited."""
        now = HostState.capture_under(self.watched)
        for mount in sorted(set(now.mounts) - set(self.mounts), key=len, reverse=True):
            _umount(mount)
        for link in sorted(set(now.links) - set(self.links)):
            if DOCKER_LINK.match(link):
                _run(["ip", "link", "delete", link])
        for link in sorted(set(self.links) - set(now.links)):  # there before, removed since (a dockerd's cleanup)
            if DOCKER_LINK.match(link) and link in self.link_details:
                _recreate_link(link, self.link_details[link])
        for path, value in self.sysctls.items():
            if now.sysctls.get(path) != value:
                Path(path).write_text(value + "\n")
        for family, text in self.iptables.items():
            if now.iptables.get(family) != text:
                _restore_iptables(family, text, now.iptables.get(family, ""))
        for path in sorted(set(now.paths) - set(self.paths), key=len, reverse=True):
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):  # gone meanwhile (its daemon's own exit removed it)
                    os.unlink(path)
        diffs = self.differences(HostState.capture_under(self.watched))
        if diffs:
            raise HostNotRestored("; ".join(diffs))

    def obstacles(self) -> list[str]:
        """What on this host would keep containers on one bridge from talking, in words: the
        FORWARD chain's policy DROP while bridge netfilter passes bridged frames through iptables
        (what a Docker engine started with its defaults leaves behind after it exits)."""
        forward_drop = any(line.startswith(":FORWARD DROP") for line in self.iptables.get("ipv4", "").splitlines())
        if forward_drop and self.sysctls.get(BRIDGE_NF) == "1":
            return ["the iptables FORWARD policy is DROP and net.bridge.bridge-nf-call-iptables is 1 (both left, "
                    "most likely, by a Docker engine started earlier with its defaults): frames between containers "
                    "on one bridge go through iptables and would be dropped"]
        return []

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "HostState":
        raw = json.loads(text)
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})


def _docker_links() -> dict[str, dict]:
    """Each Docker-named link's kind, MTU, whether it is up and its addresses (`ip -j -d addr`)."""
    if shutil.which("ip") is None:
        return {}
    done = subprocess.run(["ip", "-j", "-d", "addr", "show"], capture_output=True, text=True, timeout=30)
    try:
        links = json.loads(done.stdout or "[]")
    except json.JSONDecodeError:
        return {}
    return {link["ifname"]: {"kind": link.get("linkinfo", {}).get("info_kind", ""), "mtu": link.get("mtu", 1500),
                             "up": "UP" in link.get("flags", []),
                             "addresses": [f"{a['local']}/{a['prefixlen']}" for a in link.get("addr_info", [])
                                           if a.get("family") in ("inet", "inet6") and a.get("scope") != "link"]}
            for link in links if DOCKER_LINK.match(link.get("ifname", ""))}


def _recreate_link(name: str, details: dict) -> None:
    """Put back a bridge that was there before and is gone (a veth cannot be: its peer went with its
    container, and the final comparison says so)."""
    if details.get("kind") != "bridge":
        log.warning("cannot recreate %s (a %s link, not a bridge)", name, details.get("kind") or "plain")
        return
    if not _run(["ip", "link", "add", name, "type", "bridge"]):
        return
    _run(["ip", "link", "set", name, "mtu", str(details.get("mtu", 1500))])
    for address in details.get("addresses", []):
        _run(["ip", "addr", "add", address, "dev", name])
    if details.get("up"):
        _run(["ip", "link", "set", name, "up"])


def _iptables_save(tool: str) -> str | None:
    """The ruleset without comments and counters (they change by themselves); None if no tool."""
    if shutil.which(tool) is None:
        return None
    out = subprocess.run([tool], capture_output=True, text=True, timeout=30).stdout
    lines = [re.sub(r"\[\d+:\d+\]", "[0:0]", line) for line in out.splitlines() if not line.startswith("#")]
    return "\n".join(_without_empty_tables(lines))


def _without_empty_tables(lines: list[str]) -> list[str]:
    """Drop tables that filter nothing (only built-in chains, each ACCEPT, no rules): they act as
    no table at all, and where nft is missing an emptied table cannot be deleted."""
    kept, table = [], []
    for line in lines:
        table.append(line)
        if line == "COMMIT":
            body = table[1:-1]
            if not all(re.fullmatch(r":[A-Z]+ ACCEPT \[0:0\]", row) for row in body):
                kept.extend(table)
            table = []
    return kept + table


def _tables(save_text: str) -> set[str]:
    return {line[1:] for line in save_text.splitlines() if line.startswith("*")}


def _restore_iptables(family: str, text: str, now_text: str) -> None:
    """Put the snapshot's tables back, and drop the tables that appeared since.

    iptables-restore replaces only the tables its input names; a table that did not exist in the
    snapshot is deleted with nft where it is installed (iptables-nft cannot delete a table), else
    emptied (which leaves its empty built-in chains: the final comparison then says so).
    """
    save, restore, nft_family = IPTABLES[family]
    if text:
        subprocess.run([restore], input=text + "\n", text=True, check=True, timeout=30)
    for table in sorted(_tables(now_text) - _tables(text)):
        if shutil.which("nft") and _run(["nft", "delete", "table", nft_family, table]):
            continue
        tool = save.replace("-save", "")
        _run([tool, "-t", table, "-F"])
        _run([tool, "-t", table, "-X"])


def _mounts_under(prefixes: tuple[str, ...]) -> tuple[str, ...]:
    points = set()
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = re.sub(r"\\(\d{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4])
        if any(point == p or point.startswith(p.rstrip("/") + "/") for p in prefixes):
            points.add(point)
    return tuple(sorted(points))


def _umount(point: str) -> None:
    # umount(2) itself: the umount command would leave util-linux's /run/mount behind
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if libc.umount2(point.encode(), 0) != 0 and libc.umount2(point.encode(), MNT_DETACH) != 0:
        log.warning("cannot unmount %s: %s", point, os.strerror(ctypes.get_errno()))


def _run(argv: list[str]) -> bool:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        log.warning("%s failed: %s", " ".join(argv), result.stderr.strip())
    return result.returncode == 0
