"""Hosts on one machine: a bridge, and per host a network namespace joined to it by a veth pair.

    root namespace                       namespace <tag>-<host>
    bridge <tag>br  10.213.N.1/24  ---- veth <tag>v<i> <====> eth0  10.213.N.(10 + i)/24

Every name starts with a per-run tag, so runs never collide and a leftover is recognisable;
`teardown` removes all of it and is safe to call twice or after a half-made network. The root
namespace keeps an address on the bridge: the test process reaches every host from there.
Cutting a host sets its veth down (its packets are lost, nothing is reset: a real cable pulled).

dockerd, while it runs, sets the FORWARD policy to DROP, which with br_netfilter drops bridged
traffic; an ACCEPT rule for this bridge (removed on teardown) keeps the hosts talking anyway.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


class NetnsUnavailable(RuntimeError):
    """Raised when namespaces cannot be made here (not root, no `ip`, no permission)."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def usable() -> str:
    """'' if this machine can make namespaces and bridges, else why not (for a test's skip)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no `ip` (iproute2) on PATH"
    probe = f"mbprobe{secrets.token_hex(3)}"
    made = ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    ip("netns", "del", probe, check=False)
    return ""


@dataclass
class Network:
    """One bridge and one namespace per host; `address[host]` is the host's IPv4 address."""

    hosts: tuple[str, ...]
    tag: str = field(default_factory=lambda: f"mb{secrets.token_hex(2)}")
    address: dict[str, str] = field(default_factory=dict)  # host -> its address
    _made: list[tuple[str, str]] = field(default_factory=list)  # (kind, name) in creation order

    @property
    def bridge(self) -> str:
        return f"{self.tag}br"

    def namespace(self, host: str) -> str:
        return f"{self.tag}-{host}"

    def veth(self, host: str) -> str:
        return f"{self.tag}v{self.hosts.index(host)}"  # <= 15 characters, the kernel's limit

    def exec_prefix(self, host: str) -> list[str]:
        """argv prefix that runs a command on `host` (ip execs it: the pid is the command's)."""
        return ["ip", "netns", "exec", self.namespace(host)]

    def create(self) -> None:
        why = usable()
        if why:
            raise NetnsUnavailable(why)
        try:
            subnet = self._free_subnet()
            ip("link", "add", self.bridge, "type", "bridge")
            self._made.append(("link", self.bridge))
            ip("addr", "add", f"{subnet}.1/24", "dev", self.bridge)
            ip("link", "set", self.bridge, "up")
            self._accept_forwarding(True)
            for i, host in enumerate(self.hosts):
                ns, veth = self.namespace(host), self.veth(host)
                ip("netns", "add", ns)
                self._made.append(("netns", ns))
                ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
                ip("link", "set", veth, "master", self.bridge)
                ip("link", "set", veth, "up")
                self.address[host] = f"{subnet}.{10 + i}"
                ip("-n", ns, "addr", "add", f"{self.address[host]}/24", "dev", "eth0")
                ip("-n", ns, "link", "set", "eth0", "up")
                ip("-n", ns, "link", "set", "lo", "up")
        except subprocess.CalledProcessError as exc:
            self.teardown()
            raise NetnsUnavailable(f"{' '.join(exc.cmd)}: {exc.stderr.strip()}") from exc
        except BaseException:
            self.teardown()
            raise

    def cut(self, host: str) -> None:
        """Pull the host's cable: its veth goes down, packets to and from it are lost."""
        ip("link", "set", self.veth(host), "down")

    def restore(self, host: str) -> None:
        ip("link", "set", self.veth(host), "up")

    def teardown(self) -> None:
        """Remove everything made (namespaces take their veth pairs with them), newest first."""
        for kind, name in reversed(self._made):
            result = ip(kind, "del", name, check=False)
            if result.returncode != 0:
                log.warning("could not remove %s %s: %s", kind, name, result.stderr.strip())
        if self._made:
            self._accept_forwarding(False)
        self._made.clear()

    def _free_subnet(self) -> str:
        """10.213.N with no route through it yet (another run may hold one)."""
        routes = ip("-4", "route", "show").stdout
        start = int(self.tag[2:], 16) % 250
        for k in range(250):
            candidate = f"10.213.{(start + k) % 250}"
            if f"{candidate}.0/24" not in routes:
                return candidate
        raise NetnsUnavailable("no free 10.213.N.0/24 subnet")

    def _accept_forwarding(self, on: bool) -> None:
        if shutil.which("iptables") is None:
            return
        rule = ["FORWARD", "-i", self.bridge, "-o", self.bridge, "-j", "ACCEPT"]
        subprocess.run(["iptables", "-I" if on else "-D", *rule], capture_output=True, check=False)
