"""Two hosts on one machine: prefill and decode in network namespaces of their own.

Production runs prefill and decode on different hosts, so the KV manager, the
bootstrap server and the probe's exchange advertise routable addresses, and a
peer on loopback is not the peer. `Hosts.make` (root only) builds

    namespace P (prefill) 10.231.N.1 <-veth-> 10.231.N.2 namespace D (decode)
                                              10.231.M.2 <-veth-> 10.231.M.1 (this namespace)

The P-D pair is the link the transfer, the bootstrap and the exchange cross.
D forwards between its two links so the driver and SGLang's router, here, reach
both servers' HTTP ports; P's return route goes through D. Each namespace has
its own loopback, so an exchange bound to 127.0.0.1 on P cannot be reached
from D: the case a default probe config meets across hosts.

`Hosts.unavailable()` says why namespaces cannot be made (not root, no `ip`,
or the kernel refuses) so a test can skip with that reason.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
from dataclasses import dataclass

#: The private /16 the rig's links are numbered from (addresses of namespaces the rig made).
NET_PREFIX = "10.231"


class NetnsError(RuntimeError):
    """A namespace or link could not be made; the message has the command and its error."""


def _ip(*args: str, netns: str | None = None) -> None:
    cmd = (["ip", "netns", "exec", netns] if netns else []) + ["ip", *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise NetnsError(f"{' '.join(cmd)}: {done.stderr.strip() or done.stdout.strip()}")


@dataclass
class Hosts:
    """The two namespaces and their addresses; `role_host` / `wrap` are what `launch` asks."""

    prefill_ns: str
    decode_ns: str
    prefill_ip: str
    decode_ip: str
    decode_outer_ip: str  # D's address on the link to this namespace
    prefill_dev: str = "veth0"  # each role's device on the P-D link (UCX_NET_DEVICES)
    decode_dev: str = "veth0"
    made: bool = False

    @staticmethod
    def unavailable() -> str | None:
        """Why namespaces cannot be made here, or None."""
        if os.geteuid() != 0:
            return "network namespaces need root (ip netns add)"
        if shutil.which("ip") is None:
            return "no `ip` command (iproute2) on this machine"
        name = f"dsv4r{os.getpid() % 100000}t"
        try:
            _ip("netns", "add", name)
        except NetnsError as exc:
            return f"the kernel refused a network namespace: {exc}"
        try:
            _ip("netns", "del", name)
        except NetnsError:
            pass
        return None

    @classmethod
    def make(cls) -> "Hosts":
        """Both namespaces and both links, up; NetnsError (everything removed) otherwise."""
        tag = f"{os.getpid() % 100000}{random.randrange(100)}"
        inner = random.randrange(0, 250, 2)
        hosts = cls(prefill_ns=f"dsv4r{tag}p", decode_ns=f"dsv4r{tag}d",
                    prefill_ip=f"{NET_PREFIX}.{inner}.1", decode_ip=f"{NET_PREFIX}.{inner}.2",
                    decode_outer_ip=f"{NET_PREFIX}.{inner + 1}.2")
        outer_here = f"{NET_PREFIX}.{inner + 1}.1"
        link, outer, outer_peer = f"dsv4r{tag}l", f"dsv4r{tag}o", f"dsv4r{tag}q"
        try:
            p, d = hosts.prefill_ns, hosts.decode_ns
            _ip("netns", "add", p)
            _ip("netns", "add", d)
            hosts.made = True
            _ip("link", "add", link, "type", "veth", "peer", "name", link + "x")
            _ip("link", "set", link, "netns", p)
            _ip("link", "set", link + "x", "netns", d)
            _ip("link", "set", link, "name", hosts.prefill_dev, netns=p)
            _ip("link", "set", link + "x", "name", hosts.decode_dev, netns=d)
            _ip("link", "add", outer, "type", "veth", "peer", "name", outer_peer)
            _ip("link", "set", outer_peer, "netns", d)
            _ip("link", "set", outer_peer, "name", "veth1", netns=d)
            for ns in (p, d):
                _ip("link", "set", "lo", "up", netns=ns)
            _ip("addr", "add", f"{hosts.prefill_ip}/24", "dev", hosts.prefill_dev, netns=p)
            _ip("link", "set", hosts.prefill_dev, "up", netns=p)
            _ip("addr", "add", f"{hosts.decode_ip}/24", "dev", hosts.decode_dev, netns=d)
            _ip("link", "set", hosts.decode_dev, "up", netns=d)
            _ip("addr", "add", f"{hosts.decode_outer_ip}/24", "dev", "veth1", netns=d)
            _ip("link", "set", "veth1", "up", netns=d)
            _ip("addr", "add", f"{outer_here}/24", "dev", outer)
            _ip("link", "set", outer, "up")
            _ip("route", "add", f"{NET_PREFIX}.{inner}.0/24", "via", hosts.decode_outer_ip)
            _ip("route", "add", "default", "via", hosts.decode_ip, netns=p)
            subprocess.run(["ip", "netns", "exec", d, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1"],
                           check=True, capture_output=True)
        except (NetnsError, subprocess.CalledProcessError) as exc:
            hosts.remove()
            raise NetnsError(str(exc)) from exc
        return hosts

    def role_host(self, role: str) -> str:
        return self.prefill_ip if role == "prefill" else self.decode_ip

    def role_device(self, role: str) -> str:
        return self.prefill_dev if role == "prefill" else self.decode_dev

    def wrap(self, role: str, args: list[str]) -> list[str]:
        """`args` run inside the role's namespace (the router runs here, in this one)."""
        if role not in ("prefill", "decode"):
            return args
        return ["ip", "netns", "exec", self.prefill_ns if role == "prefill" else self.decode_ns, *args]

    def remove(self) -> None:
        """Delete both namespaces (their links go with them; the outer end's peer too)."""
        if not self.made:
            return
        for ns in (self.prefill_ns, self.decode_ns):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.made = False
