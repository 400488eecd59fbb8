"""Every operator setting of the connector, in one place.

Settings come from ``kv_connector_extra_config`` (keys below, lowercase) and from environment variables
``VLLM_KVP2P_<KEY>`` (uppercase). The extra config wins over the environment, so one ``vllm serve`` command line
states the whole truth. Values are validated once at start-up; a bad one raises :class:`ConfigError` naming the
setting, the bad value and what is allowed. The defaults work with no settings at all, on one machine or on
several: peers are given this node's address as vLLM determines it (``host``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

ENV_PREFIX = "VLLM_KVP2P_"
#: A Mooncake read that failed within this many seconds is retried once (vllm_kvp2p/pull_loop.py).
READ_RETRY_WITHIN = 1.0

PROTOCOLS = ("tcp", "rdma", "ascend")
PLATFORMS = ("auto", "cpu", "npu")
#: Addresses that mean "every interface": fine to bind (bind_host), never an address to give a peer (host).
WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]")


class ConfigError(ValueError):
    """A setting has a value the connector cannot run with."""


@dataclass(frozen=True)
class KVP2PConfig:
    """Validated connector settings (seconds for every duration)."""

    # Which platform adapter to use; "auto" picks NPU when torch_npu is importable, else CPU.
    platform: str = "auto"
    # Mooncake transport; empty means the platform's default (tcp on CPU, ascend on NPU).
    protocol: str = ""
    # Mooncake device name (e.g. an RDMA NIC, or empty to let Mooncake choose).
    device_name: str = ""
    # Address this instance advertises to its peers: the side channel's address in kv_transfer_params
    # (remote_host) and the Mooncake segment's hostname. Empty: this node's address as vLLM determines it
    # (VLLM_HOST_IP, else the source address of the default route; see advertised_host). A wildcard is refused.
    host: str = ""
    # Address P's side channel binds. Empty: the advertised address; 0.0.0.0 listens on every interface.
    bind_host: str = ""
    # Side-channel port of (dp 0, tp 0); rank r of DP rank d listens on base + d * tp_size + r.
    # Kept below Mooncake's own random RPC range [15000, 17000].
    side_channel_port: int = 14600
    # P keeps a finished prompt's blocks this long for D to claim them, then frees them.
    hold_timeout: float = 120.0
    # A D claim keeps P's blocks pinned this long unless renewed; D renews at a third of it.
    lease_timeout: float = 60.0
    # Upper bound of one Mooncake read (Mooncake's MC_TRANSFER_TIMEOUT, at least 5 s).
    transfer_timeout: float = 30.0
    # Upper bound of one side-channel round trip (handshake, claim, release).
    side_channel_timeout: float = 5.0
    # Seconds D keeps a P that did not answer as suspect: plans for it first probe it with one short round trip
    # and fail at once without an answer, instead of each paying the full side-channel timeouts.
    suspect_time: float = 10.0
    # How long D keeps retrying a claim P has not heard of yet (P learns of a hold one engine step late).
    claim_wait: float = 10.0
    # Seconds an engine step that schedules no token sleeps. vLLM keeps stepping while P holds blocks or D waits
    # for KV; at TP > 1 those empty steps (gloo collectives on every rank) take every core and starve the
    # side channel and Mooncake threads for seconds. 0 disables.
    idle_step_sleep: float = 0.005
    # Most pull threads per D worker. Each P instance is served by one thread (instances beyond this share), so a
    # frozen P delays only the instances sharing its thread; pulls from one P never overlap.
    pull_threads: int = 4
    # Allocate the KV cache from one contiguous arena (registered as one region) when the platform and build
    # have one; false registers vLLM's tensors one by one (touching ones merged), checked against the region limit.
    kv_arena: bool = True
    # Seconds vLLM's worker and engine-core processes busy-poll their queues after each message; < 0 uses the
    # platform's default (0.002 on CPU, vLLM's own 1 s on NPU). vLLM spins 1 s, and pending transfers keep engines
    # stepping, so on few cores those spinners starve the threads that move the KV (platform/worker_polling.py).
    worker_busy_poll: float = -1.0
    # Mooncake entries per batch read; Mooncake's TCP lane fails above ~2048 in flight per peer.
    max_batch_entries: int = 1024
    # Upper bound of one pull on a D rank: all its side-channel round trips and Mooncake reads together. Past it
    # the pull fails (vLLM's kv_load_failure_policy decides) and P is released within one side_channel_timeout.
    pull_timeout: float = 60.0
    # Side-channel ports D may contact, "LOW-HIGH" (a client names P's port in kv_transfer_params). Empty: every
    # port side_channel_port allows (1024..14999 and 17001..65535).
    peer_ports: str = ""
    # File holding the shared secret of this P/D deployment (the environment may give it instead, as
    # VLLM_KVP2P_SECRET). With one, P signs kv_transfer_params and the side channel authenticates every message
    # (vllm_kvp2p/auth.py); without, both are open (logged once at start-up).
    secret_file: str = ""
    # With a secret: how far P's and D's clocks may disagree (params expiry, side-channel timestamps and the
    # replay window).
    clock_skew: float = 30.0
    # The shared secret itself, from VLLM_KVP2P_SECRET or secret_file; never logged, never in extra config.
    secret: bytes = field(default=b"", repr=False)
    # Test-only: D honours "kvp2p_test_corrupt": true in a request's kv_transfer_params by overwriting the blocks
    # it pulled for that request with noise, to prove that output checks can fail. Off in production.
    test_hooks: bool = False

    @classmethod
    def from_sources(
        cls, extra_config: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None
    ) -> KVP2PConfig:
        extra = dict(extra_config or {})
        env = os.environ if env is None else env
        if "secret" in extra:
            raise ConfigError("kv_connector_extra_config must not hold the secret (command lines are logged): set "
                              "VLLM_KVP2P_SECRET or put it in a file named by secret_file / VLLM_KVP2P_SECRET_FILE")
        known = {f.name for f in fields(cls)} - {"secret"}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(
                f"unknown kv_connector_extra_config key(s) {unknown}; allowed keys: {sorted(known)}"
            )
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name == "secret":
                continue
            env_name = ENV_PREFIX + f.name.upper()
            if f.name in extra:
                raw, where = extra[f.name], f"kv_connector_extra_config[{f.name!r}]"
            elif env_name in env:
                raw, where = env[env_name], env_name
            else:
                continue
            values[f.name] = _PARSERS[f.name](raw, where)
        values["secret"] = _load_secret(env.get(ENV_PREFIX + "SECRET"), values.get("secret_file", ""))
        config = cls(**values)
        config.validate()
        return config

    def validate(self) -> None:
        _choice(self.platform, PLATFORMS, "platform")
        if self.protocol:
            _choice(self.protocol, PROTOCOLS, "protocol")
        if self.host in WILDCARD_HOSTS:
            raise ConfigError(
                f"host={self.host!r}: a wildcard is no address peers can reach; set VLLM_KVP2P_HOST (or "
                "VLLM_HOST_IP) to this node's address (e.g. 127.0.0.1 on one machine), or leave both unset to use "
                "the address vLLM detects; a wildcard belongs in bind_host (VLLM_KVP2P_BIND_HOST)"
            )
        if not 1024 <= self.side_channel_port <= 65000:
            raise ConfigError(f"side_channel_port={self.side_channel_port}: allowed values are 1024..65000")
        if 15000 <= self.side_channel_port <= 17000:
            raise ConfigError(
                f"side_channel_port={self.side_channel_port} lies in Mooncake's random RPC port range "
                "15000..17000; allowed values are 1024..14999 or 17001..65000"
            )
        for name in ("hold_timeout", "lease_timeout", "side_channel_timeout", "claim_wait", "pull_timeout",
                     "clock_skew", "suspect_time"):
            value = getattr(self, name)
            if not value > 0:
                raise ConfigError(f"{name}={value}: allowed values are numbers of seconds > 0")
        if not 0 <= self.idle_step_sleep <= 0.1:
            raise ConfigError(f"idle_step_sleep={self.idle_step_sleep}: allowed values are 0..0.1 seconds")
        if self.transfer_timeout < 5:
            raise ConfigError(
                f"transfer_timeout={self.transfer_timeout}: allowed values are >= 5 seconds (Mooncake's minimum)"
            )
        if not (self.worker_busy_poll < 0 or 0 <= self.worker_busy_poll <= 1):
            raise ConfigError(f"worker_busy_poll={self.worker_busy_poll}: allowed values are 0..1 seconds, or -1 for "
                              "the platform's default")
        if not 1 <= self.pull_threads <= 64:
            raise ConfigError(f"pull_threads={self.pull_threads}: allowed values are 1..64")
        if not 1 <= self.max_batch_entries <= 1024:
            raise ConfigError(
                f"max_batch_entries={self.max_batch_entries}: allowed values are 1..1024 "
                "(Mooncake's TCP transport rejects more than ~2048 entries in flight per peer)"
            )
        longest_read = self.transfer_timeout + READ_RETRY_WITHIN
        if self.lease_timeout <= 1.5 * longest_read:
            raise ConfigError(
                f"lease_timeout={self.lease_timeout:g} with transfer_timeout={self.transfer_timeout:g}: the lease must "
                f"exceed 1.5 x (transfer_timeout + {READ_RETRY_WITHIN:g} s) = {1.5 * longest_read:g} s. D renews it "
                "every third of it, between reads, and one read (with its retry after an immediate failure) may "
                "take transfer_timeout + 1 s: a read must never outlive its lease (P would free the blocks under "
                "it). Raise lease_timeout (VLLM_KVP2P_LEASE_TIMEOUT) or lower transfer_timeout"
            )
        if self.pull_timeout < self.side_channel_timeout:
            raise ConfigError(f"pull_timeout={self.pull_timeout}: allowed values are >= side_channel_timeout "
                              f"({self.side_channel_timeout})")
        self.peer_port_ranges()  # raises on a bad range

    def peer_port_ranges(self) -> tuple[tuple[int, int], ...]:
        """Inclusive ranges of side-channel ports D may contact."""
        if not self.peer_ports:
            return ((1024, 14999), (17001, 65535))
        low, sep, high = self.peer_ports.partition("-")
        try:
            lo, hi = int(low), int(high)
        except ValueError:
            lo = hi = -1
        if not sep or not 1 <= lo <= hi <= 65535:
            raise ConfigError(f"peer_ports={self.peer_ports!r}: expected LOW-HIGH with 1 <= LOW <= HIGH <= 65535")
        return ((lo, hi),)

    def advertised_host(self, detect: Callable[[], str]) -> str:
        """The address peers are given: ``host`` when set, else ``detect()`` (vLLM's ``get_ip``, passed in by the
        caller: vllm_kvp2p.compat.node_ip). The scheduler half (it writes ``remote_host``) and every worker (it
        names its Mooncake segment) run in different processes and each call this with the same settings."""
        if self.host:
            return self.host
        found = (detect() or "").strip()
        if not found or found in WILDCARD_HOSTS:
            raise ConfigError(
                f"host is not set and vLLM could not determine this node's address (it found {found!r}); set "
                "VLLM_KVP2P_HOST (or VLLM_HOST_IP) to the address peers reach this instance at"
            )
        return found

    def side_channel_bind_host(self, advertised: str) -> str:
        """The address P's side channel binds: ``bind_host``, else the advertised address."""
        return self.bind_host or advertised

    def side_channel_port_for(self, dp_rank: int, tp_size: int, tp_rank: int) -> int:
        """Port of one worker's side channel; distinct for every (DP rank, TP rank) of one instance."""
        return self.side_channel_port + dp_rank * tp_size + tp_rank


def _load_secret(from_env: str | None, secret_file: str) -> bytes:
    """The shared secret (stripped of surrounding white space), or b"" for none."""
    if from_env is not None and secret_file:
        raise ConfigError(f"both {ENV_PREFIX}SECRET and secret_file={secret_file!r} are set: set one")
    if secret_file:
        try:
            secret = Path(secret_file).read_bytes().strip()
        except OSError as exc:
            raise ConfigError(f"secret_file={secret_file!r}: cannot read it: {exc.strerror}") from None
        where = f"secret_file={secret_file!r}"
    elif from_env is not None:
        secret, where = from_env.strip().encode(), f"{ENV_PREFIX}SECRET"
    else:
        return b""
    if len(secret) < 16:
        raise ConfigError(f"{where}: the secret has {len(secret)} bytes, at least 16 are needed "
                          "(e.g. python -c 'import secrets; print(secrets.token_hex(32))')")
    return secret


def _choice(value: str, allowed: tuple[str, ...], name: str) -> None:
    if value not in allowed:
        raise ConfigError(f"{name}={value!r}: allowed values are {', '.join(allowed)}")


def _as_str(raw: Any, where: str) -> str:
    if not isinstance(raw, str):
        raise ConfigError(f"{where}={raw!r}: expected a string")
    return raw.strip()


def _as_lower_str(raw: Any, where: str) -> str:
    return _as_str(raw, where).lower()


def _as_int(raw: Any, where: str) -> int:
    try:
        if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
            raise ValueError
        return int(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}={raw!r}: expected an integer") from None


def _as_float(raw: Any, where: str) -> float:
    try:
        if isinstance(raw, bool):
            raise ValueError
        return float(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}={raw!r}: expected a number of seconds") from None


def _as_bool(raw: Any, where: str) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"{where}={raw!r}: allowed values are true/false (or 1/0)")


_PARSERS: dict[str, Callable[[Any, str], Any]] = {
    "platform": _as_lower_str,
    "protocol": _as_lower_str,
    "device_name": _as_str,
    "host": _as_str,
    "bind_host": _as_str,
    "side_channel_port": _as_int,
    "hold_timeout": _as_float,
    "lease_timeout": _as_float,
    "transfer_timeout": _as_float,
    "side_channel_timeout": _as_float,
    "claim_wait": _as_float,
    "idle_step_sleep": _as_float,
    "max_batch_entries": _as_int,
    "pull_threads": _as_int,
    "worker_busy_poll": _as_float,
    "kv_arena": _as_bool,
    "pull_timeout": _as_float,
    "suspect_time": _as_float,
    "peer_ports": _as_str,
    "secret_file": _as_str,
    "clock_skew": _as_float,
    "test_hooks": _as_bool,
}
