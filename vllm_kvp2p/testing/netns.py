"""Hosts of their own for tests: network namespaces on one bridge, created and deleted here (root only).

Layout (names carry this process's id, the subnet is the first free 10.231.X.0/24)::

    root namespace: bridge kvbr<id> 10.231.X.1/24 (forwarding off), the proxy on 127.0.0.1, pytest
      veth kv<i><id> ── eth0 10.231.X.(2+i)/24 in namespace kvp2p-<role>-<id>: lo up, default route via X.1

The default route is what vLLM's ``get_ip()`` needs to find the namespace's address (it connects a UDP socket to
8.8.8.8 and sends nothing). Nothing leaves the machine: the namespaces reach only the bridge, and the root
namespace forwards nothing from it (``ip_forward`` is left as it is, the bridge's own ``forwarding`` is 0), so
traffic stays on 127.0.0.0/8 and on the bridge's subnet. :meth:`Network.teardown` kills what still runs in the
namespaces (only processes a test started run there), then deletes them, the veths and the bridge.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Namespace", "Network", "create_network", "listening_sockets", "unavailable_reason"]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


@dataclass(frozen=True)
class Namespace:
    name: str
    veth: str  # its root-namespace end, a port of the bridge
    address: str


@dataclass
class Network:
    bridge: str
    gateway: str
    hosts: dict[str, Namespace]  # by role, e.g. "prefill", "decode"

    def __getitem__(self, role: str) -> Namespace:
        return self.hosts[role]

    def teardown(self) -> None:
        """Kill what still runs in the namespaces (servers are stopped by their fixtures first), then delete the
        namespaces (their eth0 ends go with them), the root-side veths and the bridge. Never raises."""
        for ns in self.hosts.values():
            pids = _ip("netns", "pids", ns.name, check=False).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError, PermissionError):
                    os.kill(int(pid), signal.SIGKILL)
            deadline = time.monotonic() + 10
            while pids and time.monotonic() < deadline:
                pids = _ip("netns", "pids", ns.name, check=False).stdout.split()
                time.sleep(0.1)
            _ip("netns", "del", ns.name, check=False)
            _ip("link", "del", ns.veth, check=False)
        _ip("link", "del", self.bridge, check=False)


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if shutil.which("ip") is None:
        return "needs iproute2's `ip` to create network namespaces (apt-get install iproute2)"
    if os.geteuid() != 0:
        return "needs root to create network namespaces, a bridge and veth pairs (CI runs as root)"
    return None


def _free_subnet() -> int:
    used = _ip("-4", "-o", "addr", "show").stdout + _ip("-4", "route", "show", "table", "all").stdout
    for x in range(256):
        if f"10.231.{x}." not in used:
            return x
    raise RuntimeError("no free 10.231.X.0/24 on this machine")


def create_network(roles: Sequence[str]) -> Network:
    """One namespace per role (at most 8), all on one new bridge. Raises ``subprocess.CalledProcessError`` when
    the kernel refuses (what was made is deleted again)."""
    if not 1 <= len(roles) <= 8 or len(set(roles)) != len(roles):
        raise ValueError(f"roles must be 1..8 distinct names, got {roles!r}")
    tag = str(os.getpid())[-6:]
    x = _free_subnet()
    net = Network(bridge=f"kvbr{tag}", gateway=f"10.231.{x}.1", hosts={
        role: Namespace(f"kvp2p-{role[:6]}-{tag}", f"kv{i}{tag}", f"10.231.{x}.{2 + i}")
        for i, role in enumerate(roles)
    })
    try:
        _ip("link", "add", net.bridge, "type", "bridge")
        # Belt and braces next to ip_forward (untouched): nothing received on the bridge is routed onwards.
        Path(f"/proc/sys/net/ipv4/conf/{net.bridge}/forwarding").write_text("0")
        _ip("addr", "add", f"{net.gateway}/24", "dev", net.bridge)
        _ip("link", "set", net.bridge, "up")
        for ns in net.hosts.values():
            _ip("netns", "add", ns.name)
            _ip("link", "add", ns.veth, "type", "veth", "peer", "name", "eth0", "netns", ns.name)
            _ip("link", "set", ns.veth, "master", net.bridge)
            _ip("link", "set", ns.veth, "up")
            _ip("-n", ns.name, "link", "set", "lo", "up")
            _ip("-n", ns.name, "addr", "add", f"{ns.address}/24", "dev", "eth0")
            _ip("-n", ns.name, "link", "set", "eth0", "up")
            _ip("-n", ns.name, "route", "add", "default", "via", net.gateway)
    except BaseException:
        net.teardown()
        raise
    return net


def listening_sockets(namespace: str) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket listening in ``namespace``; wildcards read "0.0.0.0" and "::"."""
    out = subprocess.run(["ip", "netns", "exec", namespace, "cat", "/proc/net/tcp", "/proc/net/tcp6"],
                         capture_output=True, text=True, check=True, timeout=30).stdout
    found: set[tuple[str, int]] = set()
    for line in out.splitlines():
        fields = line.split()
        if len(fields) < 4 or fields[3] != "0A" or ":" not in fields[1]:  # 0A: LISTEN
            continue
        addr_hex, port_hex = fields[1].split(":")
        if len(addr_hex) == 8:
            addr = ".".join(str(b) for b in reversed(bytes.fromhex(addr_hex)))
        else:
            addr = "::" if int(addr_hex, 16) == 0 else f"v6:{addr_hex}"
        found.add((addr, int(port_hex, 16)))
    return found
