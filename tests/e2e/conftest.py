"""One real P/D deployment per test session (see :class:`vllm_kvp2p.testing.cluster.PDCluster`): a prefill
``vllm serve`` (kv_producer), a decode ``vllm serve`` (kv_consumer, test hooks on, failed loads recomputed)
and the proxy console script,
on 127.0.0.1, each vLLM worker pinned to its own core. Started once, stopped at the end of the session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm_kvp2p.testing.cluster import PDCluster
from vllm_kvp2p.testing.tiny_model import make_tiny_llama


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="package")  # stopped once this package is done: engines of other packages get the cores
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDCluster]:
    with PDCluster(
        tiny_model_dir,
        tmp_path_factory.mktemp("pd-logs"),
        prefill_env={"VLLM_KVP2P_HOLD_TIMEOUT": "60", "VLLM_KVP2P_TRANSFER_TIMEOUT": "5"},
        decode_env={"VLLM_KVP2P_TRANSFER_TIMEOUT": "5", "VLLM_KVP2P_CLAIM_WAIT": "5"},
        decode_extra_config={"test_hooks": True},
        decode_failure_policy="recompute",
    ) as cluster:
        yield cluster
