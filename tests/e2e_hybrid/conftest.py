"""Real P/D pairs (with the proxy) serving a tiny Llama whose layers alternate sliding-window and full attention,
as gpt-oss's do: vLLM's hybrid allocator gives it two KV-cache groups. One pair per test module (module scope),
so only one pair runs at a time: with the hybrid allocator, and with it turned off on both engines. On a vLLM
that cannot recover a failed load with several groups (0.23), D refuses the first configuration at start-up and
only the second runs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm_kvp2p.connector.compat import REPORTS_FAILED_REQUESTS
from vllm_kvp2p.testing.cluster import PDCluster
from vllm_kvp2p.testing.tiny_model import make_tiny_llama

WINDOW = 64  # tokens: two blocks of 32, so a sliding layer needs at most cdiv(64, 32) + 1 = 3 blocks
LAYER_TYPES = ("sliding_attention", "full_attention", "sliding_attention", "full_attention")


@pytest.fixture(scope="package")
def sliding_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama-sliding", num_layers=len(LAYER_TYPES),
                           sliding_window=WINDOW, layer_types=LAYER_TYPES)


@pytest.fixture(scope="module")
def hybrid_cluster(sliding_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDCluster]:
    if not REPORTS_FAILED_REQUESTS:
        pytest.skip("this vLLM refuses a decoder with the hybrid allocator's two groups "
                    "(test_refused_where_vllm_cannot_recover.py)")
    with PDCluster(sliding_model, tmp_path_factory.mktemp("hybrid-logs"), decode_failure_policy="recompute",
                   decode_extra_config={"test_hooks": True, "integrity": "full"}) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def no_hma_cluster(sliding_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDCluster]:
    """The same model with vLLM's hybrid allocator turned off on both engines (one KV-cache group)."""
    with PDCluster(sliding_model, tmp_path_factory.mktemp("no-hma-logs"),
                   engine_args=("--disable-hybrid-kv-cache-manager",)) as cluster:
        yield cluster
