"""``vllm-kvp2p check``: will an engine start with this configuration, and can its peers reach it?

It reads what an engine reads (the environment and the ``--kv-transfer-config`` JSON), resolves every setting
with its source, and runs the checks an engine would otherwise fail on at start-up or, worse, at the first pull:
the settings and their timers, the vLLM / vllm-ascend / Mooncake versions, the side-channel ports (free, on an
address of this host), the advertised address, a real Mooncake engine with the protocol and device, the C++
extension and KV arena, and on Ascend torch-npu, CANN and the HCCL settings. One finding per line, naming the
setting; problems make the exit status 1.
"""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import socket
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vllm_kvp2p.contract.config import ConfigError, KVP2PConfig
from vllm_kvp2p.transfer.timeouts import transport_timeouts

CONNECTOR_NAME = "MooncakeP2PConnector"
ROLES = ("kv_producer", "kv_consumer", "kv_both")
POLICIES = ("fail", "recompute")
MOONCAKE_RPC_PORTS = (15000, 17000)
CANN_ROOTS = ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH")
CANN_DEFAULT = "/usr/local/Ascend/ascend-toolkit/latest"
# What vllm-ascend's P/D guides have operators set on every node (docs/deploy-ascend.md): worth a warning each.
ASCEND_NETWORK_SETTINGS = ("HCCL_IF_IP", "GLOO_SOCKET_IFNAME", "HCCL_SOCKET_IFNAME")
RDMA_DEVICES = Path("/sys/class/infiniband")

PROBLEM, WARNING, OK = "problem", "warning", "ok"


@dataclass(frozen=True)
class Finding:
    level: str  # PROBLEM, WARNING or OK
    setting: str  # the setting (or package, or environment variable) it is about
    message: str

    def line(self) -> str:
        return f"{self.level.upper():<8} {self.setting}: {self.message}"


@dataclass
class CheckReport:
    role: str = ""
    tp_size: int = 1
    dp_size: int = 1
    pp_size: int = 1
    settings: list[tuple[str, str, str]] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)

    @property
    def problems(self) -> list[Finding]:
        return [f for f in self.findings if f.level == PROBLEM]

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> str:
        return json.dumps({
            "ok": self.ok, "role": self.role, "tp_size": self.tp_size, "dp_size": self.dp_size,
            "pp_size": self.pp_size,
            "settings": [{"key": k, "value": v, "source": s} for k, v, s in self.settings],
            "problems": [asdict(f) for f in self.problems],
            "warnings": [asdict(f) for f in self.findings if f.level == WARNING],
            "passed": [asdict(f) for f in self.findings if f.level == OK],
        }, indent=2)

    def to_text(self) -> str:
        layout = f"TP {self.tp_size} x PP {self.pp_size} x DP {self.dp_size}"
        lines = [f"vllm-kvp2p check: {CONNECTOR_NAME} as {self.role or '?'}, {layout}"]
        if self.settings:
            lines.append("settings:")
            width = max(len(k) for k, _, _ in self.settings)
            lines += [f"  {k:<{width}}  {v:<24} {s}" for k, v, s in self.settings]
        lines.append("checks:")
        lines += ["  " + f.line() for f in self.findings]
        warnings = sum(f.level == WARNING for f in self.findings)
        lines.append(f"{len(self.problems)} problem(s), {warnings} warning(s)")
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- the checks

def transfer_config_findings(kv_transfer_config: Mapping[str, Any]) -> list[Finding]:
    """The ``--kv-transfer-config`` fields the connector depends on."""
    found = []
    connector = kv_transfer_config.get("kv_connector")
    if connector != CONNECTOR_NAME:
        found.append(Finding(PROBLEM, "kv_connector", f"is {connector!r}; this package's connector is "
                                                      f"{CONNECTOR_NAME!r}"))
    role = kv_transfer_config.get("kv_role")
    if role not in ROLES:
        found.append(Finding(PROBLEM, "kv_role", f"is {role!r}; allowed: {', '.join(ROLES)}"))
    policy = kv_transfer_config.get("kv_load_failure_policy", "fail")
    if policy not in POLICIES:
        found.append(Finding(PROBLEM, "kv_load_failure_policy", f"is {policy!r}; allowed: {', '.join(POLICIES)}"))
    extra = kv_transfer_config.get("kv_connector_extra_config", {})
    if not isinstance(extra, dict):
        found.append(Finding(PROBLEM, "kv_connector_extra_config", f"must be a JSON object, got {extra!r}"))
    return found


def version_findings(env: Mapping[str, str]) -> list[Finding]:
    from vllm_kvp2p.connector import compat

    try:
        vllm_version = compat.installed_vllm_version()
    except ImportError as exc:
        return [Finding(PROBLEM, "vllm", f"not importable: {exc}")]
    verdict = compat.support_verdict(vllm_version, compat.allow_unsupported_from_env(env))
    ascend = compat.installed_ascend_version()
    mooncake = compat.installed_mooncake_version()
    found = [Finding(WARNING if verdict.warns else (OK if verdict.supported else PROBLEM), "vllm",
                     verdict.message if verdict.warns or not verdict.supported else
                     f"vLLM {vllm_version} ({verdict.label})")]
    pairing = compat.ascend_pairing_problem(vllm_version, ascend)
    found.append(Finding(WARNING, "vllm-ascend", pairing) if pairing else
                 Finding(OK, "vllm-ascend", ascend or "not installed (CPU)"))
    found.append(Finding(PROBLEM if mooncake == "not installed" else OK, "mooncake",
                         "no Mooncake transfer engine package installed (the cpu or ascend extra)"
                         if mooncake == "not installed" else mooncake))
    return found


def side_channel_ports(config: KVP2PConfig, tp_size: int, dp_size: int, pp_size: int = 1) -> list[int]:
    # The layout of config.side_channel_port_for, computed here: that one refuses a port in Mooncake's range, which
    # this check reports (all of them, as a finding) instead.
    ranks = tp_size * pp_size
    return [config.side_channel_port + d * ranks + r for d in range(dp_size) for r in range(ranks)]


def port_findings(config: KVP2PConfig, role: str, tp_size: int, dp_size: int, advertised: str,
                  try_bind: Callable[[str, int], OSError | None], pp_size: int = 1) -> list[Finding]:
    """P's side-channel ports: outside Mooncake's range, free, on an address this host has."""
    if role == "kv_consumer":
        return [Finding(OK, "side_channel_port", "not used by a consumer (D contacts P's ports)")]
    bind = config.side_channel_bind_host(advertised)
    setting = "bind_host" if config.bind_host else "host"
    found = []
    ports = side_channel_ports(config, tp_size, dp_size, pp_size)
    clash = [p for p in ports if MOONCAKE_RPC_PORTS[0] <= p <= MOONCAKE_RPC_PORTS[1]]
    if clash:
        found.append(Finding(PROBLEM, "side_channel_port", f"ports {clash[0]}..{clash[-1]} of this instance's "
                             f"{len(ports)} (base {config.side_channel_port} + dp_rank*pp_size*tp_size + rank) lie in "
                             "Mooncake's RPC range 15000..17000; choose a base that keeps them all outside it"))
    for port in ports:
        error = try_bind(bind, port)
        if error is None:
            continue
        if error.errno == errno.EADDRINUSE:
            found.append(Finding(PROBLEM, "side_channel_port", f"port {port} on {bind} is in use (another "
                                 "instance on this host? give each its own side_channel_port range)"))
        elif error.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
            found.append(Finding(PROBLEM, setting, f"{bind} is not an address of this host, so P's side channel "
                                 "cannot bind it; set bind_host (VLLM_KVP2P_BIND_HOST) to a local address or "
                                 "0.0.0.0, and host to the address peers reach"))
            break
        else:
            found.append(Finding(PROBLEM, "side_channel_port", f"cannot bind {bind}:{port}: {error}"))
    if not found:
        found.append(Finding(OK, "side_channel_port", f"{len(ports)} port(s) free on {bind}: "
                             f"{ports[0]}..{ports[-1]}"))
    return found


def address_findings(config: KVP2PConfig, advertised: str, is_local: Callable[[str], bool]) -> list[Finding]:
    """The address peers are given: a local one, or (behind NAT) one this host does not have."""
    source = "host" if config.host else "vLLM's detection (VLLM_HOST_IP or the default route)"
    if advertised.startswith("127.") or advertised == "::1":
        return [Finding(WARNING, "host", f"{advertised} (from {source}) is loopback: only peers on this machine "
                        "can reach it")]
    if not is_local(advertised):
        return [Finding(WARNING, "host", f"{advertised} (from {source}) is not an address of this host: fine "
                        "behind NAT or a service name, else peers cannot reach this instance")]
    return [Finding(OK, "host", f"peers are given {advertised} (from {source})")]


def transport_findings(config: KVP2PConfig, protocol: str, rdma_devices: Path = RDMA_DEVICES) -> list[Finding]:
    """Mooncake initialises with a transport it cannot use and falls back to TCP without a word (an RDMA
    protocol on a host without a NIC moves data all the same): what the protocol needs, checked here."""
    if protocol == "rdma":
        devices = sorted(p.name for p in rdma_devices.iterdir()) if rdma_devices.is_dir() else []
        if not devices:
            return [Finding(PROBLEM, "protocol", f"rdma, but this host has no RDMA device ({rdma_devices} is empty "
                            "or missing): Mooncake would fall back to TCP silently; set protocol=tcp or fix the NIC")]
        wanted = [d.strip() for d in config.device_name.split(",") if d.strip()]
        missing = [d for d in wanted if d not in devices]
        if missing:
            return [Finding(PROBLEM, "device_name", f"{', '.join(missing)} not among this host's RDMA devices "
                            f"({', '.join(devices)})")]
        return [Finding(OK, "protocol", f"rdma with {', '.join(wanted) or 'any of ' + ', '.join(devices)}")]
    if protocol == "ascend":
        from vllm_kvp2p.connector.compat import _distribution_version

        if _distribution_version("mooncake-transfer-engine-npu") is None:
            return [Finding(PROBLEM, "protocol", "ascend needs Mooncake's NPU build, mooncake-transfer-engine-npu "
                            "(pip install 'vllm-kvp2p[ascend]'); another build falls back to TCP")]
    return [Finding(OK, "protocol", f"{protocol}: a transport Mooncake has")]


def mooncake_findings(config: KVP2PConfig, advertised: str, protocol: str) -> list[Finding]:
    """A real Mooncake engine with this protocol and device, and one read through it from its own segment:
    Mooncake starts with a transport it cannot use (an RDMA protocol without a NIC initialises fine), so only
    moving bytes shows the pair works."""
    import ctypes

    from vllm_kvp2p.transfer.descriptors import Descriptors
    from vllm_kvp2p.transfer.engine import MooncakeEngine

    setting = "device_name" if config.device_name else "protocol"
    saved = {name: os.environ.get(name) for name in ("MC_TRANSFER_TIMEOUT", "ASCEND_TRANSFER_TIMEOUT")}
    try:
        engine = MooncakeEngine(advertised, protocol, config.device_name, min(config.transfer_timeout, 10))
    except Exception as exc:  # noqa: BLE001 - whatever Mooncake says is the finding
        return [Finding(PROBLEM, setting, f"a Mooncake engine with protocol {protocol!r} and device "
                        f"{config.device_name!r} on {advertised} does not start: {exc}")]
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    size = 1 << 16
    src, dst = ctypes.create_string_buffer(bytes(range(256)) * (size // 256), size), ctypes.create_string_buffer(size)
    try:
        engine.register([(ctypes.addressof(src), size), (ctypes.addressof(dst), size)], "cpu:0")
        engine.read(engine.segment, Descriptors([ctypes.addressof(dst)], [ctypes.addressof(src)], [size]))
        moved = dst.raw == src.raw
        error = "" if moved else "the bytes read differ from those written"
    except Exception as exc:  # noqa: BLE001
        moved, error = False, str(exc)
    finally:
        engine.close()
    if not moved:
        return [Finding(PROBLEM, setting, f"a Mooncake engine with protocol {protocol!r} and device "
                        f"{config.device_name!r} starts but cannot move data (a 64 KiB read from its own segment: "
                        f"{error}); check the protocol and device_name (VLLM_KVP2P_PROTOCOL, "
                        "VLLM_KVP2P_DEVICE_NAME)")]
    return [Finding(OK, "mooncake engine", f"starts and reads 64 KiB from its own segment {engine.segment}")]


def extension_findings(config: KVP2PConfig, platform: Any) -> list[Finding]:
    found = []
    if importlib.util.find_spec("vllm_kvp2p._C") is None:
        found.append(Finding(WARNING, "vllm_kvp2p._C", "C++ extension not built: descriptors are built in Python "
                             "(slower for large pulls); reinstall without VLLM_KVP2P_SKIP_EXT"))
    else:
        found.append(Finding(OK, "vllm_kvp2p._C", "C++ extension loads"))
    if not config.kv_arena:
        found.append(Finding(OK, "kv_arena", "off: KV tensors are registered one by one"))
        return found
    try:
        arena = platform.kv_arena(2 << 20)
    except Exception as exc:  # noqa: BLE001
        return [*found, Finding(PROBLEM, "kv_arena", f"the KV arena cannot be created: {exc}; set kv_arena=false "
                                "(VLLM_KVP2P_KV_ARENA=0) to register tensors one by one")]
    if arena is None:
        found.append(Finding(WARNING, "kv_arena", "no arena on this platform/build: KV tensors are registered one "
                             "by one (within the platform's region limit)"))
    else:
        found.append(Finding(OK, "kv_arena", "the KV arena can be created"))
    return found


def timeout_findings(config: KVP2PConfig, protocol: str, env: Mapping[str, str]) -> list[Finding]:
    """What an engine would warn about Mooncake's timeouts (the same decision: transfer/timeouts.py)."""
    decided = transport_timeouts(config.transfer_timeout, protocol, env)
    return [Finding(WARNING, "transfer_timeout", warning) for warning in decided.warnings] or [
        Finding(OK, "transfer_timeout", "Mooncake's timeouts from it: " + ", ".join(
            f"{name}={value}" for name, value in decided.env.items()))]


def ascend_findings(env: Mapping[str, str], protocol: str) -> list[Finding]:
    found = []
    if importlib.util.find_spec("torch_npu") is None:
        found.append(Finding(PROBLEM, "torch_npu", "not installed: install the ascend extra "
                             "(pip install 'vllm-kvp2p[ascend]')"))
    roots = [env[name] for name in CANN_ROOTS if env.get(name)] + [CANN_DEFAULT]
    cann = next((r for r in roots if (Path(r) / "include" / "acl" / "acl.h").is_file() or Path(r).is_dir()), None)
    if cann is None:
        found.append(Finding(PROBLEM, "ASCEND_TOOLKIT_HOME", "no CANN toolkit found (source set_env.sh of CANN: "
                             f"it sets ASCEND_TOOLKIT_HOME; looked in {', '.join(roots)})"))
    else:
        found.append(Finding(OK, "ASCEND_TOOLKIT_HOME", f"CANN at {cann}"))
    if protocol != "ascend":
        found.append(Finding(WARNING, "protocol", f"{protocol!r} on an NPU: Mooncake's ascend transport moves KV "
                             "between NPUs directly; others stage it through the host"))
    for name in ASCEND_NETWORK_SETTINGS:
        if not env.get(name):
            found.append(Finding(WARNING, name, "not set: HCCL and gloo pick an interface themselves "
                                 "(docs/deploy-ascend.md)"))
    return found


# ---------------------------------------------------------------------------------------------- I/O helpers

def try_bind(host: str, port: int) -> OSError | None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZMQ binds: TIME_WAIT is no conflict
        sock.bind((host.strip("[]"), port))
        sock.listen(1)
    except OSError as exc:
        return exc
    finally:
        sock.close()
    return None


def is_local_address(host: str) -> bool:
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    for family, _, _, _, addr in infos:
        sock = socket.socket(family, socket.SOCK_DGRAM)
        try:
            sock.bind((addr[0], 0))
            return True
        except OSError:
            continue
        finally:
            sock.close()
    return False


def run(kv_transfer_config: Mapping[str, Any], env: Mapping[str, str], tp_size: int = 1, dp_size: int = 1,
        *, engine: bool = True, pp_size: int = 1) -> CheckReport:
    """Every check, in the order an engine meets them; ``engine=False`` skips starting Mooncake."""
    report = CheckReport(role=str(kv_transfer_config.get("kv_role", "")), tp_size=tp_size, dp_size=dp_size,
                         pp_size=pp_size)
    add = report.findings.extend
    add(transfer_config_findings(kv_transfer_config))
    add(version_findings(env))
    extra = kv_transfer_config.get("kv_connector_extra_config") or {}
    try:
        config = KVP2PConfig.from_sources(extra if isinstance(extra, dict) else {}, env)
    except ConfigError as exc:
        report.findings.append(Finding(PROBLEM, _setting_named(str(exc)), str(exc)))
        return report
    report.settings = config.resolved()
    if not config.secret:
        report.findings.append(Finding(WARNING, "secret", "not set: kv_transfer_params are unsigned and the side "
                                       "channel is open to anyone who reaches it; set VLLM_KVP2P_SECRET (or "
                                       "secret_file) on every P and D of this deployment (docs/security.md)"))
    report.findings.append(Finding(OK, "timers", "settings valid, timers consistent (lease_timeout outlasts a "
                                   "pull's longest action: 1.5 x (max(transfer_timeout + 1.5 s, side_channel_timeout)"
                                   " + 1 s); pull_timeout >= side_channel_timeout)"))
    from vllm_kvp2p.connector.compat import node_ip
    from vllm_kvp2p.platform import get_platform

    try:
        advertised = config.advertised_host(node_ip)
    except ConfigError as exc:
        report.findings.append(Finding(PROBLEM, "host", str(exc)))
        return report
    platform = get_platform(config.platform)
    protocol = config.protocol or platform.default_protocol
    add(address_findings(config, advertised, is_local_address))
    add(port_findings(config, report.role, tp_size, dp_size, advertised, try_bind, pp_size))
    add(transport_findings(config, protocol))
    add(timeout_findings(config, protocol, env))
    if engine:
        add(mooncake_findings(config, advertised, protocol))
    add(extension_findings(config, platform))
    if type(platform).__name__.startswith("Npu"):
        add(ascend_findings(env, protocol))
    else:
        report.findings.append(Finding(OK, "platform", "cpu (no torch_npu): the Ascend checks do not apply"))
    return report


def _setting_named(message: str) -> str:
    """The setting a ConfigError names first (its messages start with ``name=value`` or a variable)."""
    head = message.split("=", 1)[0].split(":", 1)[0].strip()
    return head if head and " " not in head else "configuration"


def parse_kv_transfer_config(text: str | None, path: Iterable[str] = ()) -> dict[str, Any]:
    """``--kv-transfer-config`` as vLLM takes it: JSON text (or, with ``@file``, a JSON file)."""
    if not text:
        return {"kv_connector": CONNECTOR_NAME, "kv_role": "kv_both"}
    if text.startswith("@"):
        text = Path(text[1:]).read_text()
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError("--kv-transfer-config must be a JSON object")
    return value
