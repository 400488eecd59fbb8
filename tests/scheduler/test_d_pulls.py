"""vLLM's real ``Scheduler`` driving the connector (SCHEDULER role) as D (kv_consumer), when the pull goes as
planned: a request carrying P's params parks in WAITING_FOR_REMOTE_KVS with exactly one PullPlan, runs once
``finished_recving`` arrives (only the last prompt token recomputed), and ends with the scheduler empty: no request,
no queue entry, no block still referenced. D's own prefix cache: a full hit only releases P, a partial one pulls
only the missing blocks, blocks still being loaded are never a hit; a request that computes its prompt itself
(prompt logprobs) only releases P."""

from __future__ import annotations

import math

import pytest
from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus

from tests.scheduler.harness import (
    Spy,
    assert_scheduler_empty,
    connector_side,
    make_request,
    request_block_ids,
    run_until_idle,
    step,
    tokens,
)
from tests.scheduler.p_and_d import (
    BS,
    collect_plans,
    d_scheduler,
    p_scheduler,
    prefill_on_p,
    release_on_p,
    remote_params,
    report,
)
from vllm_kvp2p.connector.metadata import KVP2PWorkerMetadata
from vllm_kvp2p.connector.scheduler import PULL_REPORT_KEY
from vllm_kvp2p.contract.protocol import RemotePrefill
from vllm_kvp2p.lifecycle.consumer import PullPlan


@pytest.mark.parametrize("num_tokens", [40, 32, 5], ids=["partial-tail", "block-aligned", "shorter-than-a-block"])
def test_d_basic_pull_lifecycle(num_tokens):
    p_sched, d_sched = p_scheduler(), d_scheduler()
    prompt = tokens(num_tokens)
    params, p_blocks = prefill_on_p(p_sched, "p1", prompt)
    n_blocks = math.ceil(num_tokens / BS)
    alloc = Spy(d_sched, "update_state_after_alloc")

    d_sched.add_request(make_request("d1", prompt, max_tokens=3, kv_transfer_params=params))
    st = step(d_sched)
    request = d_sched.requests["d1"]
    assert st.so.num_scheduled_tokens == {}
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert request.num_computed_tokens == num_tokens
    assert request in d_sched._inflight_prefills
    local = request_block_ids(d_sched, "d1")
    assert len(local) == n_blocks
    manager = d_sched.kv_cache_manager.coordinator.single_type_managers[0]
    assert all(b.block_hash is None for b in manager.req_to_blocks["d1"])  # not cached before the load
    (plan,) = st.meta.pulls
    assert plan.request_id == "d1"
    assert plan.awaiting
    assert plan.error == ""
    assert plan.local_block_ids == (tuple(local),)
    assert plan.remote_block_ids == (tuple(p_blocks[:n_blocks]),) == (tuple(params["remote_block_ids"][0]),)
    assert plan.remote.remote_hold_id == params["remote_hold_id"]

    # While the pull runs nothing is re-planned.
    steps = [step(d_sched) for _ in range(2)]
    assert collect_plans(steps) == []
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS

    # The workers finish the receive and report it.
    meta = KVP2PWorkerMetadata({"d1": report(n_blocks)})
    step(d_sched, finished_recving={"d1"}, worker_meta=meta)
    assert "d1" in d_sched.finished_recving_kv_req_ids

    st = step(d_sched)
    assert request.status == RequestStatus.RUNNING
    assert st.so.num_scheduled_tokens == {"d1": 1}  # only the last prompt token is recomputed
    assert request.num_computed_tokens == num_tokens  # N - 1 before this step, + 1 scheduled
    assert request_block_ids(d_sched, "d1") == local  # no extra block for the recomputed token
    assert sum(b.block_hash is not None for b in manager.req_to_blocks["d1"]) == num_tokens // BS
    assert st.meta.pulls == []

    # Second update_state_after_alloc (with 0) at promotion made no second plan.
    assert [args[2] for args, _ in alloc.for_request("d1")] == [num_tokens, 0]

    steps = run_until_idle(d_sched)
    assert collect_plans(steps) == []
    out = {o.request_id: o for s in steps for o in s.outputs if o.finish_reason is not None}["d1"]
    assert out.finish_reason == FinishReason.LENGTH
    assert out.kv_transfer_params[PULL_REPORT_KEY] == {
        "ok": True, "blocks": n_blocks, "bytes": n_blocks * 4096, "descriptors": 2 * n_blocks, "seconds": 0.01,
    }
    assert_scheduler_empty(d_sched)
    release_on_p(p_sched, "p1")


def test_d_ranks_that_report_in_different_steps_give_one_merged_report():
    """D at TP 2 (or with pipeline stages): each rank reports its share of a pull in the step its own pull ended
    in; the request's report sums them, not the last one alone (found with D at TP 2 over P's stages:
    the report showed half the bytes)."""
    sched = d_scheduler()
    sched.add_request(make_request("d1", 40, max_tokens=2, kv_transfer_params=remote_params(40)))
    (plan,) = step(sched).meta.pulls
    half = report(3)
    step(sched, worker_meta=KVP2PWorkerMetadata({"d1": half}))  # rank 0 done; vLLM waits for rank 1
    steps = run_until_idle(sched, finished_recving={"d1"}, worker_meta=KVP2PWorkerMetadata({"d1": half}))
    out = {o.request_id: o for s in steps for o in s.outputs if o.finish_reason is not None}["d1"]
    merged = out.kv_transfer_params[PULL_REPORT_KEY]
    assert (merged["blocks"], merged["bytes"], merged["descriptors"]) == (3, 2 * half.bytes, 2 * half.descriptors)
    assert_scheduler_empty(sched)


def test_d_matched_tokens_is_pure():
    sched = d_scheduler()
    request = make_request("d1", 40, max_tokens=2, kv_transfer_params=remote_params(40))
    connector = sched.connector
    for _ in range(5):
        assert connector.get_num_new_matched_tokens(request, 0) == (40, True)
        assert connector.get_num_new_matched_tokens(request, 16) == (24, True)
        assert connector.get_num_new_matched_tokens(request, 48) == (0, False)
    side = connector_side(sched)
    assert side.consumer._pending == [] and not side.consumer.is_planned("d1")

    sched.add_request(request)
    st = step(sched)
    assert len(st.meta.pulls) == 1
    # Asked again once planned (e.g. after a failed load or a preemption): nothing more to load.
    assert connector.get_num_new_matched_tokens(request, 0) == (0, False)
    assert step(sched, finished_recving={"d1"}).meta.pulls == []
    run_until_idle(sched)
    assert_scheduler_empty(sched)


def test_d_full_local_prefix_hit_releases_without_pull():
    """D already holds every token P computed: no load, the request runs at once, P is only released."""
    p_sched, d_sched = p_scheduler(), d_scheduler()
    prompt = tokens(2 * BS + 1)  # P prefilled the first 32 tokens; D's block-aligned local hit is 32 too
    params, _ = prefill_on_p(p_sched, "p1", prompt[: 2 * BS])
    assert params["remote_num_tokens"] == 2 * BS

    d_sched.add_request(make_request("warm", prompt, max_tokens=1))
    run_until_idle(d_sched)
    assert_scheduler_empty(d_sched)

    matched = Spy(d_sched, "get_num_new_matched_tokens")
    d_sched.add_request(make_request("d1", prompt, max_tokens=2, kv_transfer_params=params))
    st = step(d_sched)
    assert matched.results("d1") == [(0, False)]
    request = d_sched.requests["d1"]
    assert request.status == RequestStatus.RUNNING
    assert st.so.num_scheduled_tokens == {"d1": 1}
    (plan,) = st.meta.pulls
    assert plan == PullPlan("d1", RemotePrefill.from_params(params), (), (), awaiting=False)

    steps = run_until_idle(d_sched)  # no finished_recving is ever reported
    assert collect_plans(steps) == []
    assert_scheduler_empty(d_sched)
    release_on_p(p_sched, "p1")


@pytest.mark.parametrize("local_blocks", [1, 2])
def test_d_partial_prefix_hit_pulls_only_missing_blocks(local_blocks):
    num_tokens = 56  # 4 blocks, the last one partial; at least one full block is always left to pull
    n_blocks = math.ceil(num_tokens / BS)
    p_sched, d_sched = p_scheduler(), d_scheduler()
    prompt = tokens(num_tokens)
    params, p_blocks = prefill_on_p(p_sched, "p1", prompt)
    # A local request sharing the first `local_blocks` blocks leaves them in D's prefix cache.
    warm = prompt[: local_blocks * BS] + tokens(8, seed=5)
    d_sched.add_request(make_request("warm", warm, max_tokens=1))
    run_until_idle(d_sched)

    matched = Spy(d_sched, "get_num_new_matched_tokens")
    d_sched.add_request(make_request("d1", prompt, max_tokens=2, kv_transfer_params=params))
    st = step(d_sched)
    assert matched.results("d1") == [(num_tokens - local_blocks * BS, True)]
    request = d_sched.requests["d1"]
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    all_local = request_block_ids(d_sched, "d1")
    assert len(all_local) == n_blocks
    (plan,) = st.meta.pulls
    assert plan.awaiting and plan.error == ""
    assert plan.local_block_ids == (tuple(all_local[local_blocks:]),)
    assert plan.remote_block_ids == (tuple(p_blocks[local_blocks:n_blocks]),)

    step(d_sched, finished_recving={"d1"})
    st = step(d_sched)
    assert st.so.num_scheduled_tokens == {"d1": 1}
    run_until_idle(d_sched)
    assert_scheduler_empty(d_sched)
    release_on_p(p_sched, "p1")


def test_d_local_hit_with_short_tail_computes_the_tail_and_releases_p():
    """D caches every full block; less than a block is left (40 = 2*16 + 8). Computing 8 tokens is cheaper than a
    round trip to P: the connector answers (0, False), the request runs at once, and P is only released."""
    p_sched, d_sched = p_scheduler(), d_scheduler()
    prompt = tokens(40)
    params, _ = prefill_on_p(p_sched, "p1", prompt)
    d_sched.add_request(make_request("warm", prompt[: 2 * BS] + tokens(8, seed=5), max_tokens=1))
    run_until_idle(d_sched)

    matched = Spy(d_sched, "get_num_new_matched_tokens")
    d_sched.add_request(make_request("d1", prompt, max_tokens=2, kv_transfer_params=params))
    st = step(d_sched)
    assert matched.results("d1") == [(0, False)]
    (plan,) = st.meta.pulls
    assert plan == PullPlan("d1", RemotePrefill.from_params(params), (), (), awaiting=False)
    assert d_sched.requests["d1"].status == RequestStatus.RUNNING
    assert st.so.num_scheduled_tokens == {"d1": 8}
    run_until_idle(d_sched)
    assert_scheduler_empty(d_sched)
    release_on_p(p_sched, "p1")


def test_d_blocks_being_loaded_are_never_prefix_hits():
    """Two D requests with the same prompt: the second must not reuse the first one's blocks while they are still
    being filled, so each plan pulls into its own blocks."""
    sched = d_scheduler()
    prompt = tokens(40)
    sched.add_request(make_request("d1", prompt, max_tokens=2, kv_transfer_params=remote_params(40)))
    sched.add_request(make_request("d2", prompt, max_tokens=2,
                                   kv_transfer_params=remote_params(40, first_block=300, request_id="p-req-2",
                                                                     hold_id="hold-2")))
    st = step(sched)
    plans = {p.request_id: p for p in st.meta.pulls}
    assert set(plans) == {"d1", "d2"}
    assert plans["d1"].num_blocks == plans["d2"].num_blocks == 3
    assert not set(plans["d1"].all_local_block_ids) & set(plans["d2"].all_local_block_ids)
    assert plans["d2"].remote_block_ids == ((300, 301, 302),)
    run_until_idle(sched, finished_recving={"d1", "d2"})
    assert_scheduler_empty(sched)


def test_d_request_with_prompt_logprobs_computes_its_prompt_and_releases_p():
    """``prompt_logprobs`` makes vLLM skip the prefix cache and compute the whole prompt: KV loaded for it would
    stand in for tokens whose logprobs it must compute. vLLM 0.32's scheduler ignores such a load itself; 0.23 took
    it, and its engine died on the request (found by tests/e2e/test_openai_surface_completions.py on 0.23)."""
    sched = d_scheduler()
    params = remote_params(40)
    sched.add_request(make_request("d1", 40, max_tokens=2, kv_transfer_params=params, prompt_logprobs=1))
    st = step(sched)
    assert st.so.num_scheduled_tokens == {"d1": 40}  # the whole prompt, on D
    assert st.meta.pulls == [PullPlan("d1", RemotePrefill.from_params(params), (), (), awaiting=False)]  # release
    steps = run_until_idle(sched)
    assert collect_plans(steps) == []
    assert_scheduler_empty(sched)
