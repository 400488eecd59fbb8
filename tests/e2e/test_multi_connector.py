"""Under vLLM's MultiConnector (here wrapping only this connector), a D engine pulls, serves, and exports the
connector's metrics: MultiConnector's Prometheus logger asserts that every sub-connector sending stats built its
metrics, so a connector that sends stats without them makes every later stats record raise (and vLLM's output
handler die). tests/unit/test_metrics.py shows that crash with vLLM's MultiConnector and a connector without
metrics."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.helpers import LOGPROB_TOL, Cluster, baseline, completion_body, max_logprob_gap, post, prompt_ids
from tests.e2e.test_metrics_end_to_end import settle
from vllm_kvp2p.testing.server import VllmServer, free_port

pytestmark = pytest.mark.e2e

MULTI = {"kv_connector": "MultiConnector", "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute",
         "kv_connector_extra_config": {"connectors": [{"kv_connector": "MooncakeP2PConnector",
                                                       "kv_role": "kv_consumer"}]}}


@pytest.fixture(scope="module")
def multi_decode(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    server = VllmServer(cluster.model_path, free_port(), cpus="1",
                        log_path=tmp_path_factory.mktemp("multi") / "decode.log",
                        extra_args=("--kv-transfer-config", json.dumps(MULTI)))
    with server:
        yield server


def test_pulls_and_metrics_under_multiconnector(cluster: Cluster, multi_decode: VllmServer) -> None:
    d = multi_decode
    for i in range(3):  # several stats records: the assert would fire on the first
        prompt = prompt_ids(4 * 32 + i, seed=4040 + i)
        params = post(cluster.prefill.url + "/v1/completions",
                      {"model": "tiny", "prompt": prompt, "max_tokens": 1,
                       "kv_transfer_params": {"do_remote_decode": True}})["kv_transfer_params"]
        out = post(d.url + "/v1/completions", completion_body(prompt, kv_transfer_params=params))
        assert out["kv_transfer_params"]["kvp2p_pull"]["ok"], out["kv_transfer_params"]
        assert max_logprob_gap(out, baseline(cluster, prompt)) <= LOGPROB_TOL
    assert settle(lambda: d.metric("vllm:kvp2p_pull_seconds_count"), 3.0) == 3.0
    assert httpx.get(d.url + "/health", timeout=10).status_code == 200
    log = Path(d.log_path).read_text(errors="replace")
    assert "AssertionError" not in log and "output_handler failed" not in log, d.log_path
