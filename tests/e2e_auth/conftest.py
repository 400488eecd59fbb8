"""One real P/D deployment with the shared secret on both sides (VLLM_KVP2P_SECRET on P, a secret file on D, as
an operator may deploy it), D recomputing failed loads. Started once for the package."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from vllm_kvp2p.testing.cluster import PDCluster
from vllm_kvp2p.testing.tiny_model import make_tiny_llama

SECRET = "e2e-shared-secret-0123456789abcdef"


@pytest.fixture(scope="package")
def secured_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDCluster]:
    model = make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")
    secret_file = tmp_path_factory.mktemp("secret") / "kvp2p.secret"
    secret_file.write_text(SECRET + "\n")
    secret_file.chmod(0o600)
    with PDCluster(
        model,
        tmp_path_factory.mktemp("auth-logs"),
        # Refused params make D contact no one, not even to release: their holds end at this hold timeout.
        prefill_env={"VLLM_KVP2P_SECRET": SECRET, "VLLM_KVP2P_TRANSFER_TIMEOUT": "5", "VLLM_KVP2P_HOLD_TIMEOUT": "8"},
        decode_env={"VLLM_KVP2P_SECRET_FILE": str(secret_file), "VLLM_KVP2P_TRANSFER_TIMEOUT": "5"},
        decode_failure_policy="recompute",
    ) as cluster:
        yield cluster
