"""P and D on two "hosts": each ``vllm serve`` in a network namespace of its own, created here.

The namespaces, the bridge and their teardown: vllm_kvp2p/testing/netns.py (roles "prefill" and "decode").

The engines run with **no host settings** (neither ``VLLM_KVP2P_HOST`` nor ``VLLM_HOST_IP``): each advertises
what vLLM detects in its namespace. A second layout forces the connector's former default on P
(``VLLM_KVP2P_HOST=127.0.0.1``) to show that the checks fail then. Each module starts its own P (the two never run
at once on the 2 cores) against the package's one D; the namespaces live for the package, and a finalizer kills
what runs in them (only processes started here run there), deletes them, the veths and the bridge, also when a
test fails.

Skipped, with the reason, when not root or when ``ip`` is missing (CI runs as root).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from tests.support.namespaces import NO_HOST_SETTINGS, namespaces
from vllm_kvp2p.testing.cluster import ProxyProcess, kv_transfer_config
from vllm_kvp2p.testing.netns import Network
from vllm_kvp2p.testing.server import VllmServer, free_port
from vllm_kvp2p.testing.tiny_model import make_tiny_llama

#: Small engines: short prompts only.
ENGINE_ARGS = ("--max-model-len", "512", "--max-num-seqs", "4")


@pytest.fixture(scope="package")
def network() -> Iterator[Network]:
    yield from namespaces(("prefill", "decode"))


@pytest.fixture(scope="package")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


class NetnsPair:
    """P in the prefill namespace (core 0), the package's D in the decode namespace, the proxy in the root
    namespace. The pair starts and stops its P and proxy; D is the package's (``decode`` below)."""

    def __init__(self, net: Network, model: Path, log_dir: Path, env: Mapping[str, str | None],
                 decode: VllmServer, prefill_env: Mapping[str, str] | None = None) -> None:
        self.net = net
        self.log_dir = log_dir
        self.side_channel_port = free_port()
        common = {"MC_LOG_LEVEL": os.environ.get("MC_LOG_LEVEL", "ERROR"), **env}
        self.prefill = VllmServer(
            model, free_port(), cpus="0", log_path=log_dir / "prefill.log",
            netns=net["prefill"].name, host=net["prefill"].address, ready_timeout=400,
            extra_args=(*ENGINE_ARGS, "--kv-transfer-config", kv_transfer_config("kv_producer")),
            env={**common, "VLLM_KVP2P_SIDE_CHANNEL_PORT": str(self.side_channel_port), **(prefill_env or {})},
        )
        self.decode = decode
        self.proxy: ProxyProcess | None = None

    @property
    def proxy_url(self) -> str:
        assert self.proxy is not None
        return self.proxy.url

    def __enter__(self) -> NetnsPair:
        try:
            self.prefill.start()
            self.decode.wait_ready()
            self.prefill.wait_ready()
            self.proxy = ProxyProcess.start([self.prefill.url], [self.decode.url], self.log_dir / "proxy.log")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        self.prefill.stop()


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


@pytest.fixture(scope="package")
def decode(network: Network, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """The package's D (core 1, no host settings, failed loads recomputed): both modules' P pull into it, so it
    starts once; test_netns_pd's killed-D test restarts it in place. Each module's prompts use seeds of their own:
    a prompt D has computed is a local prefix hit, and no pull, for the next module."""
    server = VllmServer(
        tiny_model_dir, free_port(), cpus="1", log_path=tmp_path_factory.mktemp("netns-d-logs") / "decode.log",
        netns=network["decode"].name, host=network["decode"].address, ready_timeout=400,
        extra_args=(*ENGINE_ARGS, "--kv-transfer-config", kv_transfer_config("kv_consumer", "recompute")),
        env={"MC_LOG_LEVEL": os.environ.get("MC_LOG_LEVEL", "ERROR"), **NO_HOST_SETTINGS,
             "VLLM_KVP2P_TRANSFER_TIMEOUT": f"{TRANSFER_TIMEOUT:g}"},
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def pair(network: Network, tiny_model_dir: Path, decode: VllmServer,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[NetnsPair]:
    """P and D with no host settings at all."""
    with NetnsPair(network, tiny_model_dir, tmp_path_factory.mktemp("netns-logs"), NO_HOST_SETTINGS, decode,
                   prefill_env=SHORT_P_TIMERS) as p:
        yield p


@pytest.fixture(scope="module")
def loopback_pair(network: Network, tiny_model_dir: Path, decode: VllmServer,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[NetnsPair]:
    """The same layout with the former default forced on P: it advertises 127.0.0.1, which in D's namespace is D
    itself. D's pull fails within its side-channel timeout, and P's hold expires after a few seconds."""
    with NetnsPair(
        network, tiny_model_dir, tmp_path_factory.mktemp("netns-loopback-logs"),
        {**NO_HOST_SETTINGS, "VLLM_KVP2P_HOST": "127.0.0.1"}, decode, prefill_env={"VLLM_KVP2P_HOLD_TIMEOUT": "5"},
    ) as p:
        yield p
