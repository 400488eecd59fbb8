"""One real P/D deployment with data parallelism, per test module: a prefill ``vllm serve`` at
``--data-parallel-size 2`` (two independent engines behind one API server, each with its own connector, engine id
``<id>_dp<r>`` and side-channel port ``base + r``), a decode ``vllm serve`` at DP 1 and the proxy, on 127.0.0.1.

vLLM runs the DP ranks of a dense model as independent engines and resets their ``data_parallel_rank`` to 0; the
connector derives ports from ``data_parallel_index`` (before that fix this deployment failed at start-up with
"cannot listen on side-channel port ... Address already in use"). Start-up took 50 s here.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from vllm_kvp2p.testing.cluster import ProxyProcess, kv_transfer_config
from vllm_kvp2p.testing.server import VllmServer, free_port, free_port_run
from vllm_kvp2p.testing.tiny_model import make_tiny_llama

PREFILL_DP = 2


@dataclass
class DPCluster:
    """Same attributes as PDCluster (``prefill``, ``decode``, ``proxy_url``) so tests.e2e.helpers work with it."""

    prefill: VllmServer
    decode: VllmServer
    side_channel_port: int
    proxy: ProxyProcess | None = None

    @property
    def proxy_url(self) -> str:
        assert self.proxy is not None
        return self.proxy.url

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        self.decode.stop()
        self.prefill.stop()


@pytest.fixture(scope="module")
def dp_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DPCluster]:
    model = make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")
    logs = tmp_path_factory.mktemp("dp-logs")
    base = free_port_run(PREFILL_DP)  # DP rank r listens on base + r
    prefill = VllmServer(
        model, free_port(), cpus="0|1", log_path=logs / "prefill.log",  # one CPU list per DP rank's worker
        extra_args=("--kv-transfer-config", kv_transfer_config("kv_producer"),
                    "--data-parallel-size", str(PREFILL_DP)),
        env={"VLLM_KVP2P_SIDE_CHANNEL_PORT": str(base), "VLLM_KVP2P_HOLD_TIMEOUT": "60", "MC_LOG_LEVEL": "ERROR"},
        ready_timeout=400,
    )
    decode = VllmServer(
        model, free_port(), cpus="1", log_path=logs / "decode.log",
        extra_args=("--kv-transfer-config", kv_transfer_config("kv_consumer", "recompute", integrity="full",
                                                          test_hooks=True)),
        env={"MC_LOG_LEVEL": "ERROR"}, ready_timeout=400,
    )
    cluster = DPCluster(prefill, decode, base)
    try:
        prefill.start()
        decode.start()
        prefill.wait_ready()
        decode.wait_ready()
        cluster.proxy = ProxyProcess.start([prefill.url], [decode.url], logs / "proxy.log")
        yield cluster
    finally:
        cluster.stop()
