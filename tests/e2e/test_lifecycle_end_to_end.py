"""Request lifecycle on real engines: prefix-cache hits on D and a client cancelling mid-stream. After each, the
answer is right, D stays up, and both sides' KV usage returns to idle. A P that fails D mid-request (its hold
expired, frozen, killed): test_prefill_faults_end_to_end.py."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.helpers import (
    BLOCK_SIZE,
    LOGPROB_TOL,
    baseline,
    completion_body,
    max_logprob_gap,
    moved_since,
    post,
    prompt_ids,
    tokens_by_source,
    wait_kv_idle,
)
from vllm_kvp2p.connector.scheduler import PULL_REPORT_KEY
from vllm_kvp2p.testing.cluster import PDCluster as Cluster
from vllm_kvp2p.testing.sse import sse_lines

pytestmark = pytest.mark.e2e


def test_same_prompt_twice_second_is_a_full_local_hit(cluster: Cluster) -> None:
    prompt = prompt_ids(300, seed=31)
    first = post(cluster.proxy_url + "/v1/completions", completion_body(prompt))
    before = tokens_by_source(cluster)
    second = post(cluster.proxy_url + "/v1/completions", completion_body(prompt))
    moved = moved_since(cluster, before)

    single = baseline(cluster, prompt)
    assert max_logprob_gap(first, single) <= LOGPROB_TOL
    assert max_logprob_gap(second, single) <= LOGPROB_TOL
    # All 9 full blocks came from D's own cache; the 12-token tail was computed locally, nothing was pulled.
    assert moved == {"local_cache_hit": 288, "local_compute": 12, "external_kv_transfer": 0}
    assert PULL_REPORT_KEY not in (second.get("kv_transfer_params") or {})
    assert wait_kv_idle(cluster.prefill) == 0.0  # P was released although D pulled nothing


def test_shared_prefix_different_tails_pulls_only_the_tail(cluster: Cluster) -> None:
    prefix = prompt_ids(8 * BLOCK_SIZE, seed=41)
    a = prefix + prompt_ids(100, seed=42)
    b = prefix + prompt_ids(100, seed=43)
    post(cluster.proxy_url + "/v1/completions", completion_body(a))
    before = tokens_by_source(cluster)
    out = post(cluster.proxy_url + "/v1/completions", completion_body(b))
    moved = moved_since(cluster, before)

    assert max_logprob_gap(out, baseline(cluster, b)) <= LOGPROB_TOL
    report = out["kv_transfer_params"][PULL_REPORT_KEY]
    assert report["ok"] and report["blocks"] == -(-len(b) // BLOCK_SIZE) - 8
    assert moved == {"local_cache_hit": 8 * BLOCK_SIZE, "local_compute": 0, "external_kv_transfer": 100}


def test_client_cancelling_mid_stream_leaks_nothing(cluster: Cluster) -> None:
    prompt = prompt_ids(200, seed=51)
    with httpx.stream("POST", cluster.proxy_url + "/v1/completions",
                      json={**completion_body(prompt), "max_tokens": 1500, "stream": True, "logprobs": None},
                      timeout=60) as r:
        assert r.status_code == 200
        for line in sse_lines(r):
            if line.startswith("data: "):
                break  # the client goes away after the first token
    assert wait_kv_idle(cluster.decode) == 0.0
    assert wait_kv_idle(cluster.prefill) == 0.0
    again = post(cluster.proxy_url + "/v1/completions", completion_body(prompt))
    assert max_logprob_gap(again, baseline(cluster, prompt)) <= LOGPROB_TOL
