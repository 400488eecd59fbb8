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
#: A Mooncake read that failed within this many seconds is retried once (vllm_kvp2p/decode/pull_loop.py).
READ_RETRY_WITHIN = 1.0
#: How long a pull waits for its P's read slot before it looks at its leases again (vllm_kvp2p/decode/pull_loop.py).
READ_SLOT_WAIT_S = 0.5
#: Time allowed for a renewal to reach P (its first attempt gets 0.5 s, then it is resent:
# vllm_kvp2p/contract/side_channel.py).
RENEWAL_REACHES_P_S = 1.0

PROTOCOLS = ("tcp", "rdma", "ascend")
PLATFORMS = ("auto", "cpu", "npu")
INTEGRITY_MODES = ("off", "sampled", "full")  # vllm_kvp2p/lifecycle/integrity.IntegrityMode
#: Addresses that mean "every interface": fine to bind (bind_host), never an address to give a peer (host).
WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]")


class ConfigError(ValueError):
    """A setting has a value the connector cannot run with."""


def setting(default: Any, doc: str, shown: str = "") -> Any:
    """A setting's default and what docs/configuration.md says of it (``shown``: its default as the table shows
    it, when that is not the value itself). The table is generated from these: ``vllm-kvp2p config-reference``."""
    return field(default=default, metadata={"doc": doc, "shown": shown})


@dataclass(frozen=True)
class KVP2PConfig:
    """Validated connector settings (seconds for every duration)."""

    platform: str = setting(
        "auto",
        "`cpu`, `npu`, or `auto` (NPU when `torch_npu` is installed)",
    )
    protocol: str = setting(
        "",
        "Mooncake transport: `tcp` (CPU default), `ascend` (NPU default), `rdma`",
        shown="platform's",
    )
    device_name: str = setting(
        "",
        "Mooncake device (RDMA NIC / NPU device list); empty lets Mooncake choose",
    )
    host: str = setting(
        "",
        "address this instance **advertises**: P's side-channel address in `kv_transfer_params` (`remote_host`) "
        "and the hostname of every rank's Mooncake segment. Empty: vLLM's `get_ip()`, i.e. `VLLM_HOST_IP` when "
        "set, else the source address of the route to a public address (a UDP socket is connected; nothing is "
        "sent). A host name is resolved once, at start-up, and its address advertised (D accepts only addresses). "
        "`0.0.0.0` / `::` are refused, and so is a detection that finds no address or a name that does not "
        "resolve: set `VLLM_KVP2P_HOST` or `VLLM_HOST_IP`",
        shown="`\"\"` (this node's address as vLLM determines it)",
    )
    bind_host: str = setting(
        "",
        "address P's side channel **binds**; `0.0.0.0` listens on every interface (behind NAT, or when peers "
        "reach P under a name that is not a local address)",
        shown="`\"\"` (the advertised address)",
    )
    side_channel_port: int = setting(
        14600,
        "side-channel port of DP rank 0, rank 0; rank *r* of DP rank *d* listens on `port + d*pp_size*tp_size + r` "
        "(*r* = pipeline stage x tp_size + TP rank). 1024..65000, never inside Mooncake's random RPC range "
        "15000..17000. Give each instance on one host its own range",
    )
    hold_timeout: float = setting(
        120.0,
        "seconds P keeps a finished prompt's blocks for D to claim; then it frees them (logged). D reads it too: "
        "how long a hold its n > 1 children share stays known after its reader ended (give P and D the same value)",
    )
    lease_timeout: float = setting(
        60.0,
        "seconds a D claim pins P's blocks without renewal; D renews every lease it holds a third of the way "
        "through, between reads and round trips. Must exceed 1.5 × (the longest single action of a pull + 1 s): "
        "`transfer_timeout` + 1.5 s for a read, or `side_channel_timeout`, whichever is longer, so that no lease "
        "lapses during a pull (checked at start-up, naming the settings)",
    )
    transfer_timeout: float = setting(
        30.0,
        "upper bound of one Mooncake read; the one source of Mooncake's `MC_TRANSFER_TIMEOUT` and of its `ascend` "
        "transport's `ASCEND_TRANSFER_TIMEOUT` (one second less, in ms; a different value in the environment is "
        "replaced, with a WARNING; the values in force are logged). Mooncake's minimum is 5",
    )
    side_channel_timeout: float = setting(
        5.0,
        "upper bound of one side-channel request (split over 3 attempts on fresh sockets)",
    )
    suspect_time: float = setting(
        10.0,
        "seconds D keeps a P that did not answer as suspect: a plan for it first probes it with one short round "
        "trip (0.5 s) and fails at once without an answer, instead of paying the full timeouts again; an answer "
        "trusts it again",
    )
    claim_wait: float = setting(
        10.0,
        "how long D retries a claim P has not heard of yet (P learns of a hold one engine step after it answers "
        "the proxy)",
    )
    idle_step_sleep: float = setting(
        0.005,
        "seconds an engine step that schedules nothing sleeps (vLLM keeps stepping while P holds blocks or D "
        "waits for KV; at TP > 1 those empty steps otherwise starve the transfer threads). 0..0.1",
    )
    pull_threads: int = setting(
        4,
        "pull threads per D worker, 1..64; each P instance is served by 2 of them (1 below 4 threads; more "
        "instances share), so its pulls overlap their round trips while its reads take turns, and a frozen P "
        "delays only the instances sharing its threads",
    )
    kv_arena: bool = setting(
        True,
        "allocate the KV cache from the connector's contiguous arena (one registered region) where the platform "
        "and build have one; `false` registers vLLM's tensors one by one, touching ones merged, and checks the "
        "platform's region limit (256 on Ascend) at start-up",
    )
    worker_busy_poll: float = setting(
        -1.0,
        "seconds vLLM's worker and engine-core processes busy-poll their shared-memory queues after each message,"
        " 0..1. vLLM spins for 1 s and a pending transfer keeps the engine stepping every `idle_step_sleep`, so "
        "on few cores every worker would spin a core and starve the side channel and Mooncake (P TP 2 + D TP 1 on"
        " 2 cores: round trips up to 64 s, most pulls failed; at 0.002: every pull ~10 ms)",
        shown="`-1` (platform default: `0.002` on CPU, vLLM's own 1 s on NPU)",
    )
    max_batch_entries: int = setting(
        1024,
        "Mooncake entries per batch read, 1..1024 (Mooncake's TCP lane fails above ~2048 in flight per peer)",
    )
    pull_timeout: float = setting(
        60.0,
        "upper bound of one pull on a D rank: all its side-channel round trips and Mooncake reads together (a "
        "read in progress still ends within `transfer_timeout`). Past it the pull fails and P's ranks are "
        "released within one more `side_channel_timeout`. At least `side_channel_timeout`",
    )
    peer_ports: str = setting(
        "",
        "side-channel ports D may contact, `LOW-HIGH`: `remote_port` .. `remote_port + tp_size*pp_size - 1` of any "
        "params must lie inside, else D contacts no one (docs/security.md)",
        shown="`\"\"` (1024..14999 and 17001..65535)",
    )
    secret_file: str = setting(
        "",
        "file holding the deployment's shared secret (or give the secret itself as `VLLM_KVP2P_SECRET`, "
        "environment only; not both). With one, P signs `kv_transfer_params` and every side-channel frame is "
        "authenticated; at least 16 bytes; never logged (docs/security.md)",
    )
    clock_skew: float = setting(
        30.0,
        "with a secret: seconds P's and D's clocks may disagree (params expiry, frame timestamps; nonces are kept"
        " twice as long)",
    )
    # The shared secret itself, from VLLM_KVP2P_SECRET or secret_file; never logged, never in extra config.
    secret: bytes = field(default=b"", repr=False)
    # Where each setting came from (key -> "default", "VLLM_KVP2P_<KEY>" or "kv_connector_extra_config"), for the
    # start-up line and `vllm-kvp2p check`; set by from_sources.
    sources: tuple[tuple[str, str], ...] = field(default=(), repr=False, compare=False)
    integrity: str = setting(
        "sampled",
        "KV integrity digest of pulled blocks (docs/reliability.md): `off`, `sampled` (a few blocks of a share of "
        "the pulls, always including a pull's last block) or `full` (every block of every pull, up to about 3,400 "
        "block-layers per P rank and pull). D sums the bytes it read, P the same bytes of its held blocks, "
        "compared in the release's round trip; a mismatch fails the load as `corrupted`",
    )
    integrity_sampled_units: int = setting(
        4,
        "with `integrity=sampled`: blocks (of one layer plane each) verified per sampled pull besides its last, "
        "1..1024",
    )
    integrity_sampled_pulls: float = setting(
        0.1,
        "with `integrity=sampled`: the share of pulls verified, chosen by request id (every D rank makes the same "
        "choice), above 0 and at most 1",
    )
    test_hooks: bool = setting(
        False,
        "test only: D honours `\"kvp2p_test_corrupt\": true` in a request's `kv_transfer_params` by overwriting "
        "what it pulled (`\"layer:NAME\"`: only that layer's blocks; `\"in_flight\"`: one byte, before the "
        "integrity check)",
    )


    @classmethod
    def from_sources(
        cls, extra_config: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None
    ) -> KVP2PConfig:
        extra = dict(extra_config or {})
        env = os.environ if env is None else env
        if "secret" in extra:
            raise ConfigError("kv_connector_extra_config must not hold the secret (command lines are logged): set "
                              "VLLM_KVP2P_SECRET or put it in a file named by secret_file / VLLM_KVP2P_SECRET_FILE")
        known = set(setting_names())
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(
                f"unknown kv_connector_extra_config key(s) {unknown}; allowed keys: {sorted(known)}"
            )
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        for name in setting_names():
            env_name = ENV_PREFIX + name.upper()
            if name in extra:
                raw, where = extra[name], f"kv_connector_extra_config[{name!r}]"
                sources[name] = "kv_connector_extra_config"
            elif env_name in env:
                raw, where, sources[name] = env[env_name], env_name, env_name
            else:
                sources[name] = "default"
                continue
            values[name] = _PARSERS[name](raw, where)
        values["secret"] = _load_secret(env.get(ENV_PREFIX + "SECRET"), values.get("secret_file", ""))
        sources["secret"] = (f"secret_file {values['secret_file']}" if values.get("secret_file")
                             else f"{ENV_PREFIX}SECRET" if values["secret"] else "default")
        config = cls(**values, sources=tuple(sources.items()))
        config.validate()
        return config

    def resolved(self) -> list[tuple[str, str, str]]:
        """Every setting as (key, value as text, where it came from); the secret only as set or not."""
        origin = dict(self.sources)
        rows = [(name, setting_text(getattr(self, name)), origin.get(name, "default")) for name in setting_names()]
        rows.append(("secret", "set" if self.secret else "not set", origin.get("secret", "default")))
        return rows

    def describe(self) -> str:
        """One line of every resolved setting and its source (non-defaults marked), for the start-up INFO line."""
        return ", ".join(f"{k}={v}" + ("" if src == "default" else f" ({src})") for k, v, src in self.resolved())

    def validate(self) -> None:
        _choice(self.platform, PLATFORMS, "platform")
        _choice(self.integrity, INTEGRITY_MODES, "integrity")
        if not 1 <= self.integrity_sampled_units <= 1024:
            raise ConfigError(f"integrity_sampled_units={self.integrity_sampled_units}: allowed values are 1..1024")
        if not 0 < self.integrity_sampled_pulls <= 1:
            raise ConfigError(f"integrity_sampled_pulls={self.integrity_sampled_pulls}: allowed values are above 0 "
                              "and at most 1 (integrity=off verifies nothing)")
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
        # What can make a lease lapse while its pull goes on: a pull renews every lease it holds a third of the way
        # through, between two actions (so pull_timeout, however long, is no bound on it), so the longest single
        # action plus the renewal after it must fit in the other two thirds.
        longest_read = READ_SLOT_WAIT_S + self.transfer_timeout + READ_RETRY_WITHIN
        longest_action = max(longest_read, self.side_channel_timeout)
        needed = 1.5 * (longest_action + RENEWAL_REACHES_P_S)
        if self.lease_timeout <= needed:
            raise ConfigError(
                f"lease_timeout={self.lease_timeout:g} with transfer_timeout={self.transfer_timeout:g} and "
                f"side_channel_timeout={self.side_channel_timeout:g}: the lease must exceed 1.5 x (the longest "
                f"action of a pull + {RENEWAL_REACHES_P_S:g} s) = {needed:g} s. D renews each lease a third of the "
                f"way through, between actions; the longest, {longest_action:g} s, is a Mooncake read "
                f"(transfer_timeout, + {READ_RETRY_WITHIN:g} s for its retry after an immediate failure, + "
                f"{READ_SLOT_WAIT_S:g} s waiting for the read slot) or a side-channel call (side_channel_timeout), "
                f"and the renewal after it may take {RENEWAL_REACHES_P_S:g} s to reach P. A lease that lapses during "
                "a read lets P free the blocks under it (the pull fails as lease_lost). Raise lease_timeout "
                "(VLLM_KVP2P_LEASE_TIMEOUT) or lower transfer_timeout / side_channel_timeout"
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
        caller: vllm_kvp2p.connector.compat.node_ip). The scheduler half (it writes ``remote_host``) and every worker
        (it
        names its Mooncake segment) run in different processes and each call this with the same settings.

        Always an IP address: a host name is resolved here, once, at start-up. D accepts only addresses in
        params, so nothing on the request path waits for a resolver, and the segment a registration names is
        compared with the params' host as an address."""
        if self.host:
            return _address_of(self.host)
        found = (detect() or "").strip()
        if not found or found in WILDCARD_HOSTS:
            raise ConfigError(
                f"host is not set and vLLM could not determine this node's address (it found {found!r}); set "
                "VLLM_KVP2P_HOST (or VLLM_HOST_IP) to the address peers reach this instance at"
            )
        return _address_of(found)

    def side_channel_bind_host(self, advertised: str) -> str:
        """The address P's side channel binds: ``bind_host``, else the advertised address."""
        return self.bind_host or advertised

    def side_channel_port_for(self, dp_rank: int, engine_ranks: int, rank: int) -> int:
        """Port of one worker's side channel; distinct for every (DP rank, rank) of one instance, where ``rank`` is
        the worker's rank within its engine (``stage * tp_size + tp rank``) and ``engine_ranks`` = ``pp_size *
        tp_size``. The base is checked at start-up; a rank's port beyond it is checked here, where the layout is
        known."""
        port = self.side_channel_port + dp_rank * engine_ranks + rank
        if 15000 <= port <= 17000 or port > 65535:
            where = "inside Mooncake's RPC range 15000..17000" if port <= 17000 else "above 65535"
            raise ConfigError(
                f"side_channel_port={self.side_channel_port}: DP rank {dp_rank} rank {rank} (of {engine_ranks} per "
                f"engine: pp_size x tp_size) would listen on {port}, {where}; choose a base that keeps base + "
                "dp_size * pp_size * tp_size - 1 outside it"
            )
        return port


def setting_names() -> tuple[str, ...]:
    """The settings an operator gives (extra-config keys; VLLM_KVP2P_<KEY> in the environment)."""
    return tuple(f.name for f in fields(KVP2PConfig) if "doc" in f.metadata)


def setting_text(value: Any) -> str:
    """A setting's value as the docs and ``describe`` show it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value) if value != "" else '""'


def secret_from_environment(env: Mapping[str, str]) -> tuple[bytes, float]:
    """The shared secret and ``clock_skew`` as the engines read them from the environment (``VLLM_KVP2P_SECRET`` or
    ``VLLM_KVP2P_SECRET_FILE``, ``VLLM_KVP2P_CLOCK_SKEW``), for processes without a KV-transfer config: the proxy.
    Raises :class:`ConfigError` naming the setting."""
    defaults = {f.name: f.default for f in fields(KVP2PConfig)}

    def read(name: str) -> Any:  # as from_sources reads it, with the setting's default
        env_name = ENV_PREFIX + name.upper()
        return _PARSERS[name](env[env_name], env_name) if env_name in env else defaults[name]

    clock_skew = read("clock_skew")
    if not clock_skew > 0:
        raise ConfigError(f"clock_skew={clock_skew}: allowed values are numbers of seconds > 0")
    return _load_secret(env.get(ENV_PREFIX + "SECRET"), read("secret_file")), clock_skew


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
    "integrity": _as_lower_str,
    "integrity_sampled_units": _as_int,
    "integrity_sampled_pulls": _as_float,
    "test_hooks": _as_bool,
}


def _address_of(host: str) -> str:
    """``host`` itself when it is an IP address, else the first address it resolves to (ConfigError if none)."""
    import ipaddress
    import socket

    try:
        return str(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        pass
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ConfigError(f"host={host!r} does not resolve to an address ({exc}); set VLLM_KVP2P_HOST (or "
                          "VLLM_HOST_IP) to the IP address peers reach this instance at") from None
    return str(found[0][4][0])
