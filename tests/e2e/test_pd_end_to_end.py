"""End to end on real engines: prompts go through the proxy to P (prefill) and D (decode); D's greedy tokens and
logprobs must equal those of a single instance that computed everything itself, D must not have recomputed the
prompt, and P must end holding no KV blocks. A deliberately corrupted transfer must break the equality, which
shows the comparison can fail.

The single-instance baseline runs on P itself, as a plain request with its own ``cache_salt`` so that it shares
no prefix-cache blocks with the disaggregated requests.
"""

from __future__ import annotations

import json
import math

import httpx
import pytest

from tests.e2e.helpers import (
    BLOCK_SIZE,
    BYTES_PER_BLOCK,
    LOGPROB_TOL,
    NUM_LAYERS,
    baseline,
    completion_body,
    max_logprob_gap,
    metric,
    post,
    prompt_ids,
    tokens_and_logprobs,
    wait_kv_idle,
)
from vllm_kvp2p.connector.scheduler import PULL_REPORT_KEY
from vllm_kvp2p.testing.cluster import PDCluster as Cluster
from vllm_kvp2p.testing.sse import sse_lines

pytestmark = pytest.mark.e2e

# Shorter than one block, exactly two blocks, several blocks with a partial last one, a few hundred tokens.
LENGTHS = [10, 2 * BLOCK_SIZE, 5 * BLOCK_SIZE + 7, 300]


@pytest.mark.parametrize("length", LENGTHS)
def test_disaggregated_output_equals_single_instance(cluster: Cluster, length: int) -> None:
    prompt = prompt_ids(length, seed=length)
    local_before = metric(cluster.decode, "vllm:prompt_tokens_by_source_total", source="local_compute")
    external_before = metric(cluster.decode, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")

    pd = post(cluster.proxy_url + "/v1/completions", completion_body(prompt))
    single = baseline(cluster, prompt)

    assert max_logprob_gap(pd, single) <= LOGPROB_TOL, (tokens_and_logprobs(pd), tokens_and_logprobs(single))

    # D pulled exactly the prompt's blocks and computed none of the prompt itself.
    report = pd["kv_transfer_params"][PULL_REPORT_KEY]
    blocks = math.ceil(length / BLOCK_SIZE)
    assert report["ok"] and report["blocks"] == blocks
    assert report["bytes"] == blocks * BYTES_PER_BLOCK
    assert report["verified"] == blocks * NUM_LAYERS and "unverified" not in report  # integrity=full: every unit
    local_after = metric(cluster.decode, "vllm:prompt_tokens_by_source_total", source="local_compute")
    external_after = metric(cluster.decode, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    assert local_after - local_before == 0
    assert external_after - external_before == length


def test_streaming_and_chat_through_the_proxy(cluster: Cluster) -> None:
    prompt = prompt_ids(90, seed=7)
    chunks: list[str] = []
    with httpx.stream("POST", cluster.proxy_url + "/v1/completions",
                      json={**completion_body(prompt), "stream": True, "logprobs": None}, timeout=120) as r:
        assert r.status_code == 200
        for line in sse_lines(r):
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:])["choices"][0]["text"])
    assert "".join(chunks) == baseline(cluster, prompt)["choices"][0]["text"]

    chat = post(cluster.proxy_url + "/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": "alpha beta gamma delta " * 10}],
        "max_tokens": 8, "temperature": 0,
    })
    assert chat["choices"][0]["message"]["content"]
    assert chat["kv_transfer_params"][PULL_REPORT_KEY]["ok"]


def test_prefill_holds_no_blocks_after_requests(cluster: Cluster) -> None:
    for seed in range(3):
        post(cluster.proxy_url + "/v1/completions", completion_body(prompt_ids(200, seed=100 + seed)))
    assert wait_kv_idle(cluster.prefill) == 0.0
    assert wait_kv_idle(cluster.decode) == 0.0


def test_corrupted_transfer_changes_the_output(cluster: Cluster) -> None:
    """Negative control: with the pulled blocks overwritten (test hook), the equality check must fail."""
    prompt = prompt_ids(160, seed=4242)
    p = post(cluster.prefill.url + "/v1/completions",
             {"model": "tiny", "prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    params = {**p["kv_transfer_params"], "kvp2p_test_corrupt": True}
    corrupted = post(cluster.decode.url + "/v1/completions", completion_body(prompt, kv_transfer_params=params))
    assert corrupted["kv_transfer_params"][PULL_REPORT_KEY]["ok"]
    assert max_logprob_gap(corrupted, baseline(cluster, prompt)) > 100 * LOGPROB_TOL


def test_kv_cache_of_all_layers_is_one_registered_arena(cluster: Cluster) -> None:
    """The connector's get_mem_pool_context put every layer's KV cache in one arena, registered once."""
    for server in (cluster.prefill, cluster.decode):
        log = server.log_path.read_text()
        assert "registered as 1 region(s) (one arena)" in log, server.log_path
