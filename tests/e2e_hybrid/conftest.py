"""One real P/D pair (with the proxy) serving a tiny Llama whose layers alternate sliding-window and full
attention, as gpt-oss's do: vLLM's hybrid allocator gives it two KV-cache groups. Started once for this package."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from vllm_kvp2p.testing.cluster import PDCluster
from vllm_kvp2p.testing.tiny_model import make_tiny_llama

WINDOW = 64  # tokens: two blocks of 32, so a sliding layer needs at most cdiv(64, 32) + 1 = 3 blocks
LAYER_TYPES = ("sliding_attention", "full_attention", "sliding_attention", "full_attention")


@pytest.fixture(scope="package")
def hybrid_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDCluster]:
    model = make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama-sliding", num_layers=len(LAYER_TYPES),
                            sliding_window=WINDOW, layer_types=LAYER_TYPES)
    with PDCluster(
        model, tmp_path_factory.mktemp("hybrid-logs"),
        decode_extra_config={"test_hooks": True},
    ) as cluster:
        yield cluster
