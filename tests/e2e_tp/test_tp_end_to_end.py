"""End to end with unequal layouts: P prefills at ``--tensor-parallel-size 2`` (each rank holds one of the tiny
model's two KV heads), D decodes at ``--pipeline-parallel-size 2`` x TP 1 (each stage holds half of the layers)
and each D stage must read both heads of its own layers from the two P ranks. Through the proxy, D's greedy tokens
and logprobs must equal those of a single instance, D must have pulled every prompt block (and computed none of
the prompt), and P must end holding no KV blocks (each P rank waits for both D stages: had D told P of fewer
readers, P would free blocks a stage still reads; of more, P would keep them until its hold timeout).

The single-instance baseline runs on P itself (plain request, own ``cache_salt``). P at TP 2 computes the same as an
instance at TP 1 (or PP 2) up to float32 noise: measured max logprob gap 3-5e-6 over the lengths below, far inside
``LOGPROB_TOL`` (1e-4); ``test_tp2_prefill_computes_what_the_decode_computes`` checks it against D on every run.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

import pytest

from tests.e2e.helpers import (
    BLOCK_SIZE,
    BYTES_PER_BLOCK,
    KV_HEADS,
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
from vllm_kvp2p.contract.protocol import GetRegistration, Registration
from vllm_kvp2p.contract.side_channel import SideChannelClient

if TYPE_CHECKING:
    from tests.e2e_tp.conftest import TPCluster

pytestmark = pytest.mark.e2e

# Shorter than one block, exactly two blocks, several blocks with a partial last one, a few hundred tokens.
LENGTHS = [10, 2 * BLOCK_SIZE, 5 * BLOCK_SIZE + 7, 300]


def test_prefill_runs_one_hold_service_per_rank_with_its_head_slice(tp_cluster: TPCluster) -> None:
    base = tp_cluster.side_channel_port
    log = tp_cluster.prefill.log_path.read_text(errors="replace")
    for rank in range(tp_cluster.prefill_tp):
        assert re.search(rf"KV hold service of rank {rank} listening on tcp://127\.0\.0\.1:{base + rank}\b", log)

    client = SideChannelClient(timeout=10)
    try:
        regs = [client.request("127.0.0.1", base + r, GetRegistration(r)) for r in range(tp_cluster.prefill_tp)]
    finally:
        client.close()
    assert all(isinstance(reg, Registration) for reg in regs)
    layouts = [(reg.registration.tp_rank, reg.registration.tp_size, reg.registration.num_kv_heads) for reg in regs]
    assert layouts == [(r, 2, KV_HEADS // 2) for r in range(2)]  # the 2 KV heads are split, one per rank
    assert len({reg.registration.engine_id for reg in regs}) == 1


def test_decode_stages_register_their_own_layers(tp_cluster: TPCluster) -> None:
    log = tp_cluster.decode.log_path.read_text(errors="replace")
    per_stage = NUM_LAYERS // 2
    for rank in range(2):
        assert re.search(rf"rank {rank}: {per_stage} layers in 1 KV-cache group", log), tp_cluster.decode.log_path


def test_tp2_prefill_computes_what_the_decode_computes(tp_cluster: TPCluster) -> None:
    """The baseline's premise: P at TP 2 and an engine at PP 2 x TP 1 (D, computing locally) agree within
    tolerance."""
    for length in (64, 300):
        prompt = prompt_ids(length, seed=length)
        on_p = baseline(tp_cluster, prompt)
        assert on_p.get("kv_transfer_params") is None  # a plain request: no KV hand-off
        on_d = post(tp_cluster.decode.url + "/v1/completions", completion_body(prompt, cache_salt="d-local"))
        assert max_logprob_gap(on_p, on_d) <= LOGPROB_TOL, (tokens_and_logprobs(on_p), tokens_and_logprobs(on_d))


def test_prefill_returns_tp_size_2_params(tp_cluster: TPCluster) -> None:
    """P's own answer to a prefill request names its TP size and rank 0's side-channel port; D finishes it."""
    prompt = prompt_ids(100, seed=100)
    p = post(tp_cluster.prefill.url + "/v1/completions",
             {"model": "tiny", "prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    params = p["kv_transfer_params"]
    assert params["tp_size"] == 2
    assert params["remote_port"] == tp_cluster.side_channel_port
    assert params["remote_num_tokens"] == len(prompt)
    assert len(params["remote_block_ids"][0]) == math.ceil(len(prompt) / BLOCK_SIZE)
    assert params["do_remote_prefill"] is True
    # Hand it to D (which also releases P's hold) and check the answer; the pull itself is judged below.
    d = post(tp_cluster.decode.url + "/v1/completions", completion_body(prompt, kv_transfer_params=params))
    assert max_logprob_gap(d, baseline(tp_cluster, prompt)) <= LOGPROB_TOL
    assert PULL_REPORT_KEY in d["kv_transfer_params"]


@pytest.mark.parametrize("length", LENGTHS)
def test_tp2_prefill_pp2_decode_equals_single_instance(tp_cluster: TPCluster, length: int) -> None:
    prompt = prompt_ids(length, seed=length)
    before = tokens_by_source(tp_cluster)

    pd = post(tp_cluster.proxy_url + "/v1/completions", completion_body(prompt))
    single = baseline(tp_cluster, prompt)
    report = pd["kv_transfer_params"][PULL_REPORT_KEY]
    moved = {s: v - before[s] for s, v in tokens_by_source(tp_cluster).items()}

    assert max_logprob_gap(pd, single) <= LOGPROB_TOL, (tokens_and_logprobs(pd), tokens_and_logprobs(single), report)
    # D pulled exactly the prompt's blocks (both heads: one from each P rank, each layer by the D stage holding it)
    # and computed none of the prompt.
    assert report["ok"], f"D's pull from the TP-2 prefill failed: {report.get('reason')!r}; report {report}"
    blocks = math.ceil(length / BLOCK_SIZE)
    assert report["blocks"] == blocks, report
    assert report["bytes"] == blocks * BYTES_PER_BLOCK, report
    # integrity=full: every block of every layer on each of P's two ranks (each read as a head slice) checked, by
    # the two D stages together
    assert report["verified"] == 2 * blocks * NUM_LAYERS and "unverified" not in report, report
    assert moved["local_compute"] == 0 and moved["external_kv_transfer"] == length, moved


def test_a_corrupted_transfer_changes_the_answer(tp_cluster: TPCluster) -> None:
    """D's answer depends on the head slices both D stages read from both P ranks: overwriting what was pulled
    (test hook, after the integrity check, so the pull itself reports ok) moves it far from the single
    instance's."""
    prompt = prompt_ids(5 * BLOCK_SIZE + 7, seed=3801)
    corrupted = prefill_then_decode(tp_cluster, prompt, kvp2p_test_corrupt=True)
    assert corrupted["kv_transfer_params"][PULL_REPORT_KEY]["ok"], corrupted["kv_transfer_params"]
    assert max_logprob_gap(corrupted, baseline(tp_cluster, prompt)) > 100 * LOGPROB_TOL


def test_a_byte_changed_in_flight_is_caught_and_d_recomputes_the_right_answer(tp_cluster: TPCluster) -> None:
    """integrity=full: one byte changed in what a D stage read from a P rank's head slice, before its check (the
    ``"in_flight"`` hook, as a faulty link would), fails the load as ``corrupted``; D recomputes the prompt and
    answers as the single instance does."""
    failed_before = tp_cluster.decode.metric("vllm:kvp2p_pull_failures_total", reason="corrupted")
    assert_in_flight_change_caught(tp_cluster, prompt_ids(4 * BLOCK_SIZE + 9, seed=3802))
    assert tp_cluster.decode.metric("vllm:kvp2p_pull_failures_total", reason="corrupted") >= failed_before + 1


def test_prefill_holds_no_blocks_afterwards(tp_cluster: TPCluster) -> None:
    """Every P rank was released (read or notified, also after the corrupted pulls above): P's KV usage returns
    to 0 well before its 60 s hold timeout would free anything."""
    assert wait_kv_idle(tp_cluster.prefill, timeout=30) == 0.0
    assert wait_kv_idle(tp_cluster.decode, timeout=30) == 0.0
