"""One soak deployment for this package: two P instances and one D behind the proxy (see
:mod:`vllm_kvp2p.testing.soak`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from vllm_kvp2p.testing.soak import SoakCluster
from vllm_kvp2p.testing.tiny_model import make_tiny_llama


@pytest.fixture(scope="package")
def soak_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SoakCluster]:
    model = make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")
    with SoakCluster(model, tmp_path_factory.mktemp("soak-logs")) as cluster:
        yield cluster
