"""End to end with data parallelism: P runs two DP engines behind one API server; each must advertise its own engine
id and side-channel port, D must pull from whichever engine prefilled a request, outputs must equal a single
instance's, and neither P engine may end holding KV blocks."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import pytest

from tests.e2e.helpers import (
    BLOCK_SIZE,
    BYTES_PER_BLOCK,
    LOGPROB_TOL,
    NUM_LAYERS,
    assert_in_flight_change_caught,
    baseline,
    completion_body,
    max_logprob_gap,
    post,
    prefill_then_decode,
    prompt_ids,
    tokens_and_logprobs,
    tokens_by_source,
    wait_kv_idle,
)
from vllm_kvp2p.connector.scheduler import PULL_REPORT_KEY

if TYPE_CHECKING:
    from tests.e2e_dp.conftest import DPCluster

pytestmark = pytest.mark.e2e

def test_each_dp_engine_advertises_its_own_engine_id_and_port(dp_cluster: DPCluster) -> None:
    """Prefill directly on P until both DP engines answered (vLLM sends a request to the less loaded engine, and a
    prefilled request stays on its engine until D releases it), then let D finish every request from its params:
    D must read from the engine that holds the blocks."""
    held: list[tuple[list[int], dict]] = []
    for i in range(6):  # bounded
        prompt = prompt_ids(40 + i, seed=1000 + i)
        p = post(dp_cluster.prefill.url + "/v1/completions",
                 {"model": "tiny", "prompt": prompt, "max_tokens": 1,
                  "kv_transfer_params": {"do_remote_decode": True}})
        held.append((prompt, p["kv_transfer_params"]))
        if len({params["remote_engine_id"] for _, params in held}) == 2:
            break
    seen = {params["remote_engine_id"]: params["remote_port"] for _, params in held}
    for prompt, params in held:
        d = post(dp_cluster.decode.url + "/v1/completions", completion_body(prompt, kv_transfer_params=params))
        report = d["kv_transfer_params"][PULL_REPORT_KEY]
        assert report["ok"] and report["blocks"] == math.ceil(len(prompt) / BLOCK_SIZE), report
        assert max_logprob_gap(d, baseline(dp_cluster, prompt)) <= LOGPROB_TOL
    assert len(seen) == 2, f"only {seen} answered {len(held)} requests"
    by_rank = {int(eid.rsplit("_dp", 1)[1]): port for eid, port in seen.items()}
    assert by_rank == {0: dp_cluster.side_channel_port, 1: dp_cluster.side_channel_port + 1}


@pytest.mark.parametrize("length", [10, 5 * BLOCK_SIZE + 7, 300])
def test_dp2_prefill_dp1_decode_equals_single_instance(dp_cluster: DPCluster, length: int) -> None:
    prompt = prompt_ids(length, seed=length)
    before = tokens_by_source(dp_cluster)
    pd = post(dp_cluster.proxy_url + "/v1/completions", completion_body(prompt))
    single = baseline(dp_cluster, prompt)
    report = pd["kv_transfer_params"][PULL_REPORT_KEY]
    moved = {s: v - before[s] for s, v in tokens_by_source(dp_cluster).items()}
    assert max_logprob_gap(pd, single) <= LOGPROB_TOL, (tokens_and_logprobs(pd), tokens_and_logprobs(single))
    assert report["ok"], report
    blocks = math.ceil(length / BLOCK_SIZE)
    assert report["blocks"] == blocks and report["bytes"] == blocks * BYTES_PER_BLOCK, report
    assert report["verified"] == blocks * NUM_LAYERS and "unverified" not in report, report  # integrity=full
    assert moved["local_compute"] == 0 and moved["external_kv_transfer"] == length, moved


def test_a_corrupted_transfer_changes_the_answer(dp_cluster: DPCluster) -> None:
    """D's answer depends on what it pulled from the DP engine: overwriting it (test hook, after the integrity
    check, so the pull itself reports ok) moves it far from the single instance's."""
    prompt = prompt_ids(5 * BLOCK_SIZE + 7, seed=3901)
    corrupted = prefill_then_decode(dp_cluster, prompt, kvp2p_test_corrupt=True)
    assert corrupted["kv_transfer_params"][PULL_REPORT_KEY]["ok"], corrupted["kv_transfer_params"]
    assert max_logprob_gap(corrupted, baseline(dp_cluster, prompt)) > 100 * LOGPROB_TOL


def test_a_byte_changed_in_flight_is_caught_and_d_recomputes_the_right_answer(dp_cluster: DPCluster) -> None:
    """integrity=full: one byte changed in what D read from a DP engine, before its check (the ``"in_flight"``
    hook, as a faulty link would), fails the load as ``corrupted``; D recomputes and answers as the single
    instance does."""
    failed_before = dp_cluster.decode.metric("vllm:kvp2p_pull_failures_total", reason="corrupted")
    assert_in_flight_change_caught(dp_cluster, prompt_ids(4 * BLOCK_SIZE + 9, seed=3902))
    assert dp_cluster.decode.metric("vllm:kvp2p_pull_failures_total", reason="corrupted") == failed_before + 1


def test_no_dp_engine_holds_blocks_afterwards(dp_cluster: DPCluster) -> None:
    assert wait_kv_idle(dp_cluster.prefill, timeout=30) == 0.0
    assert wait_kv_idle(dp_cluster.decode, timeout=30) == 0.0
