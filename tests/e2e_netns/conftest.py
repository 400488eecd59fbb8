"""P and D on two "hosts": each ``vllm serve`` in a network namespace of its own, created here.

Layout (names carry this process's id, the subnet is the first free 10.231.X.0/24)::

    root namespace: bridge kvbr<id> 10.231.X.1/24 (no IPv4 forwarding), the proxy on 127.0.0.1, pytest
      veth kvp<id> ── eth0 10.231.X.2/24 in namespace kvp2p-p-<id>: lo up, default route via 10.231.X.1, P
      veth kvd<id> ── eth0 10.231.X.3/24 in namespace kvp2p-d-<id>: lo up, default route via 10.231.X.1, D

The default route is what vLLM's ``get_ip()`` needs to find the namespace's address (it connects a UDP socket to
8.8.8.8 and sends nothing). Nothing leaves the machine: the namespaces reach only the bridge, and the root
namespace forwards nothing from it (``ip_forward`` is left as it is, the bridge's own ``forwarding`` is 0), so
traffic stays on 127.0.0.0/8 and on the bridge's subnet.

The engines run with **no host settings** (neither ``VLLM_KVP2P_HOST`` nor ``VLLM_HOST_IP``): each advertises
what vLLM detects in its namespace. A second layout forces the connector's former default
(``VLLM_KVP2P_HOST=127.0.0.1`` on both) to show that the checks fail then. Each pair is module-scoped, so the two
pairs never run at once on the 2 cores; the namespaces live for the package, and a finalizer kills what runs in
them (only processes started here run there), deletes them, the veths and the bridge, also when a test fails.

Skipped, with the reason, when not root or when ``ip`` is missing (CI runs as root).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

from vllm_kvp2p.testing.cluster import ProxyProcess, kv_transfer_config, start_deployment, stop_deployment
from vllm_kvp2p.testing.server import VllmServer, free_port
from vllm_kvp2p.testing.tiny_model import make_tiny_llama

#: Small engines: short prompts only.
ENGINE_ARGS = ("--max-model-len", "512", "--max-num-seqs", "4")
#: Nothing that names an address: the connector must find it itself.
NO_HOST_SETTINGS: dict[str, str | None] = {"VLLM_KVP2P_HOST": None, "VLLM_HOST_IP": None,
                                           "VLLM_KVP2P_BIND_HOST": None}


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
    prefill: Namespace
    decode: Namespace

    def teardown(self) -> None:
        """Kill what still runs in the namespaces (servers are stopped by their fixtures first), then delete the
        namespaces (their eth0 ends go with them), the root-side veths and the bridge. Never raises."""
        for ns in (self.prefill, self.decode):
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


def _free_subnet() -> int:
    used = _ip("-4", "-o", "addr", "show").stdout + _ip("-4", "route", "show", "table", "all").stdout
    for x in range(256):
        if f"10.231.{x}." not in used:
            return x
    raise RuntimeError("no free 10.231.X.0/24 on this machine")


def _setup_network() -> Network:
    tag = str(os.getpid())[-6:]
    x = _free_subnet()
    net = Network(
        bridge=f"kvbr{tag}", gateway=f"10.231.{x}.1",
        prefill=Namespace(f"kvp2p-p-{tag}", f"kvp{tag}", f"10.231.{x}.2"),
        decode=Namespace(f"kvp2p-d-{tag}", f"kvd{tag}", f"10.231.{x}.3"),
    )
    try:
        _ip("link", "add", net.bridge, "type", "bridge")
        # Belt and braces next to ip_forward (untouched): nothing received on the bridge is routed onwards.
        Path(f"/proc/sys/net/ipv4/conf/{net.bridge}/forwarding").write_text("0")
        _ip("addr", "add", f"{net.gateway}/24", "dev", net.bridge)
        _ip("link", "set", net.bridge, "up")
        for ns in (net.prefill, net.decode):
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


@pytest.fixture(scope="package")
def network() -> Iterator[Network]:
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2's `ip` to create network namespaces (apt-get install iproute2)")
    if os.geteuid() != 0:
        pytest.skip("needs root to create network namespaces, a bridge and veth pairs (CI runs as root)")
    try:
        net = _setup_network()
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot create network namespaces here: {' '.join(exc.cmd)}: {exc.stderr.strip()}")
    try:
        yield net
    finally:
        net.teardown()


@pytest.fixture(scope="package")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


class NetnsPair:
    """P in the prefill namespace (core 0), D in the decode namespace (core 1), the proxy in the root namespace."""

    def __init__(self, net: Network, model: Path, log_dir: Path, env: Mapping[str, str | None],
                 prefill_env: Mapping[str, str] | None = None, decode_env: Mapping[str, str] | None = None) -> None:
        self.net = net
        self.log_dir = log_dir
        self.side_channel_port = free_port()
        common = {"MC_LOG_LEVEL": os.environ.get("MC_LOG_LEVEL", "ERROR"), **env}
        self.prefill = VllmServer(
            model, free_port(), cpus="0", log_path=log_dir / "prefill.log",
            netns=net.prefill.name, host=net.prefill.address, ready_timeout=400,
            extra_args=(*ENGINE_ARGS, "--kv-transfer-config", kv_transfer_config("kv_producer")),
            env={**common, "VLLM_KVP2P_SIDE_CHANNEL_PORT": str(self.side_channel_port), **(prefill_env or {})},
        )
        self.decode = VllmServer(
            model, free_port(), cpus="1", log_path=log_dir / "decode.log",
            netns=net.decode.name, host=net.decode.address, ready_timeout=400,
            extra_args=(*ENGINE_ARGS, "--kv-transfer-config", kv_transfer_config("kv_consumer", "recompute")),
            env={**common, **(decode_env or {})},
        )
        self.proxy: ProxyProcess | None = None

    @property
    def proxy_url(self) -> str:
        assert self.proxy is not None
        return self.proxy.url

    def __enter__(self) -> NetnsPair:
        self.proxy = start_deployment([self.prefill], [self.decode], self.log_dir / "proxy.log")
        return self

    def __exit__(self, *exc: object) -> None:
        stop_deployment(self.proxy, [self.prefill, self.decode])


# The cut-off test's hold expires after hold_timeout; a claim that D sent while the link was down may still
# reach P from the kernel's send buffer once the link is back (D gave up on it long before), and its lease then
# pins the blocks for lease_timeout. Both as short as the configuration's own check allows (the lease must exceed
# 1.5 x (a read of transfer_timeout + 1.5 s + a renewal's 1 s) = 11.25 s at Mooncake's minimum transfer_timeout
# of 5 s), so that the fault tests that wait for them (test_both_engines_end_idle, the lease-expiry and the
# killed-D tests) wait 24 s at most instead of the defaults' 3 minutes.
TRANSFER_TIMEOUT = 5.0
HOLD_TIMEOUT = 12.0
LEASE_TIMEOUT = 12.0
SHORT_P_TIMERS = {"VLLM_KVP2P_HOLD_TIMEOUT": f"{HOLD_TIMEOUT:g}", "VLLM_KVP2P_LEASE_TIMEOUT": f"{LEASE_TIMEOUT:g}",
                  "VLLM_KVP2P_TRANSFER_TIMEOUT": f"{TRANSFER_TIMEOUT:g}"}
#: The longest a hold of the pair's P pins its blocks: hold_timeout + lease_timeout.
P_LONGEST_PIN_S = HOLD_TIMEOUT + LEASE_TIMEOUT


@pytest.fixture(scope="module")
def pair(network: Network, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NetnsPair]:
    """P and D with no host settings at all."""
    with NetnsPair(network, tiny_model_dir, tmp_path_factory.mktemp("netns-logs"), NO_HOST_SETTINGS,
                   prefill_env=SHORT_P_TIMERS,
                   decode_env={"VLLM_KVP2P_TRANSFER_TIMEOUT": f"{TRANSFER_TIMEOUT:g}"}) as p:
        yield p


@pytest.fixture(scope="module")
def loopback_pair(network: Network, tiny_model_dir: Path,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[NetnsPair]:
    """The same layout with the former default forced: both advertise 127.0.0.1. D cannot reach P, so its pull
    fails fast (short side-channel bounds) and P's hold expires after a few seconds."""
    with NetnsPair(
        network, tiny_model_dir, tmp_path_factory.mktemp("netns-loopback-logs"),
        {**NO_HOST_SETTINGS, "VLLM_KVP2P_HOST": "127.0.0.1"},
        prefill_env={"VLLM_KVP2P_HOLD_TIMEOUT": "5"},
        decode_env={"VLLM_KVP2P_SIDE_CHANNEL_TIMEOUT": "2", "VLLM_KVP2P_CLAIM_WAIT": "2"},
    ) as p:
        yield p


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
