"""P and D on two "hosts": each ``vllm serve`` in a network namespace of its own, created here.

The namespaces, the bridge and their teardown: vllm_kvp2p/testing/netns.py (roles "prefill" and "decode").

The engines run with **no host settings** (neither ``VLLM_KVP2P_HOST`` nor ``VLLM_HOST_IP``): each advertises
what vLLM detects in its namespace. A second layout forces the connector's former default
(``VLLM_KVP2P_HOST=127.0.0.1`` on both) to show that the checks fail then. Each pair is module-scoped, so the two
pairs never run at once on the 2 cores; the namespaces live for the package, and a finalizer kills what runs in
them (only processes started here run there), deletes them, the veths and the bridge, also when a test fails.

Skipped, with the reason, when not root or when ``ip`` is missing (CI runs as root).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from tests.support.namespaces import NO_HOST_SETTINGS, namespaces
from vllm_kvp2p.testing.cluster import ProxyProcess, kv_transfer_config, start_deployment, stop_deployment
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
    """P in the prefill namespace (core 0), D in the decode namespace (core 1), the proxy in the root namespace."""

    def __init__(self, net: Network, model: Path, log_dir: Path, env: Mapping[str, str | None],
                 prefill_env: Mapping[str, str] | None = None, decode_env: Mapping[str, str] | None = None) -> None:
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
        self.decode = VllmServer(
            model, free_port(), cpus="1", log_path=log_dir / "decode.log",
            netns=net["decode"].name, host=net["decode"].address, ready_timeout=400,
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
