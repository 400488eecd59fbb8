"""The integrity digest on real engines (the shared cluster's D runs ``integrity=full``): a byte changed in what D
read, before its check (the ``"in_flight"`` test hook, as a faulty link would), fails the load as ``corrupted``,
D recomputes, and its answer equals the single instance's; the metrics count it. Every good pull is counted as
verified. (tests/worker/test_integrity.py shows the same corruption passing unnoticed without the digest.)"""

from __future__ import annotations

import math

import pytest

from tests.e2e.helpers import (
    BLOCK_SIZE,
    LOGPROB_TOL,
    NUM_LAYERS,
    baseline,
    max_logprob_gap,
    metric,
    prefill_then_decode,
    prompt_ids,
    wait_kv_idle,
)
from vllm_kvp2p.connector.scheduler import PULL_REPORT_KEY
from vllm_kvp2p.testing.cluster import PDCluster as Cluster

pytestmark = pytest.mark.e2e


def test_a_good_pull_is_verified_and_counted(cluster: Cluster) -> None:
    before = metric(cluster.decode, "vllm:kvp2p_pulls_verified_total")
    prompt = prompt_ids(3 * BLOCK_SIZE + 5, seed=2301)
    out = prefill_then_decode(cluster, prompt)
    report = out["kv_transfer_params"][PULL_REPORT_KEY]
    assert report["ok"] and report["verified"] == math.ceil(len(prompt) / BLOCK_SIZE) * NUM_LAYERS, report
    assert max_logprob_gap(out, baseline(cluster, prompt)) <= LOGPROB_TOL
    assert metric(cluster.decode, "vllm:kvp2p_pulls_verified_total") >= before + 1


def test_a_byte_changed_in_flight_fails_the_load_and_d_recomputes_the_right_answer(cluster: Cluster) -> None:
    corrupted_before = metric(cluster.decode, "vllm:kvp2p_pull_failures_total", reason="corrupted")
    prompt = prompt_ids(4 * BLOCK_SIZE + 9, seed=2302)
    out = prefill_then_decode(cluster, prompt, kvp2p_test_corrupt="in_flight")
    report = out["kv_transfer_params"][PULL_REPORT_KEY]
    assert not report["ok"] and report["failure"] == "corrupted", report
    assert "differ from P's" in report["reason"] and "P block" in report["reason"], report
    assert max_logprob_gap(out, baseline(cluster, prompt)) <= LOGPROB_TOL  # recomputed: the right answer
    assert metric(cluster.decode, "vllm:kvp2p_pull_failures_total", reason="corrupted") == corrupted_before + 1
    log = cluster.decode.log_path.read_text(errors="replace")
    assert "failed (corrupted)" in log and "TEST HOOK: changed the byte" in log
    assert wait_kv_idle(cluster.prefill) == 0.0 and wait_kv_idle(cluster.decode) == 0.0
