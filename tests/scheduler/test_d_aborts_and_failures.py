"""vLLM's real ``Scheduler`` driving the connector (SCHEDULER role) as D (kv_consumer), off the planned path: aborts
(before scheduling, while waiting for blocks or for the remote KV, after the receive), failed receives under both
``kv_load_failure_policy`` values, params that do not convert or name an incompatible block size, a request that
waits for blocks or is preempted after its load. Each gets exactly one plan (so P is released exactly once), is
never pulled twice, and ends with the scheduler empty."""

from __future__ import annotations

import pytest
from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus

from tests.scheduler.harness import (
    FakeWorkers,
    Spy,
    assert_scheduler_empty,
    make_request,
    num_free_blocks,
    request_block_ids,
    run_until_idle,
    step,
    tokens,
)
from tests.scheduler.p_and_d import BS, collect_plans, d_scheduler, remote_params, report
from vllm_kvp2p.connector.metadata import KVP2PWorkerMetadata
from vllm_kvp2p.connector.scheduler import PULL_REPORT_KEY
from vllm_kvp2p.contract.protocol import RemotePrefill
from vllm_kvp2p.lifecycle.consumer import PullPlan


def test_d_abort_while_waiting_for_remote_kvs_keeps_blocks_until_recv():
    sched = d_scheduler()
    finished = Spy(sched, "request_finished_all_groups")
    sched.add_request(make_request("d1", 40, max_tokens=2, kv_transfer_params=remote_params(40)))
    st = step(sched)
    assert len(st.meta.pulls) == 1
    free_before = num_free_blocks(sched)

    sched.finish_requests("d1", RequestStatus.FINISHED_ABORTED)
    assert finished.results("d1") == [(False, None)]
    assert "d1" in sched.requests  # the pull may still be writing into its blocks
    assert num_free_blocks(sched) == free_before
    for _ in range(2):
        st = step(sched)
        assert st.meta.pulls == []  # planned already: the running pull releases P, no second plan
    assert "d1" in sched.requests

    # The (aborted) pull ends; its report is dropped, its blocks are freed.
    step(sched, finished_recving={"d1"}, worker_meta=KVP2PWorkerMetadata({"d1": report(3)}))
    assert_scheduler_empty(sched)


def test_d_abort_before_scheduling_emits_release_only_plan():
    sched = d_scheduler()
    params = remote_params(40)
    sched.add_request(make_request("d1", 40, max_tokens=2, kv_transfer_params=params))
    sched.finish_requests("d1", RequestStatus.FINISHED_ABORTED)
    st = step(sched)
    assert st.meta.pulls == [PullPlan("d1", RemotePrefill.from_params(params), (), (), awaiting=False)]
    assert step(sched).meta.pulls == []
    assert_scheduler_empty(sched)


def test_d_failed_recv_recompute_policy_runs_locally():
    sched = d_scheduler(kv_load_failure_policy="recompute")
    matched = Spy(sched, "get_num_new_matched_tokens")
    sched.add_request(make_request("d1", 40, max_tokens=2, kv_transfer_params=remote_params(40)))
    st = step(sched)
    assert len(st.meta.pulls) == 1

    meta = KVP2PWorkerMetadata({"d1": report(0, ok=False, reason="claim refused")})
    step(sched, finished_recving={"d1"}, failed_recving={"d1"}, worker_meta=meta)
    request = sched.requests["d1"]
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert request.num_computed_tokens == 0

    st = step(sched)
    assert request.status == RequestStatus.RUNNING
    assert st.so.num_scheduled_tokens == {"d1": 40}  # whole prompt recomputed locally
    assert matched.results("d1") == [(40, True), (0, False)]  # asked again: no second pull
    assert st.meta.pulls == []

    steps = run_until_idle(sched)
    assert collect_plans(steps) == []
    out = {o.request_id: o for s in steps for o in s.outputs if o.finish_reason is not None}["d1"]
    assert out.finish_reason == FinishReason.LENGTH
    pull = out.kv_transfer_params[PULL_REPORT_KEY]
    assert pull["ok"] is False and pull["reason"] == "claim refused"
    assert_scheduler_empty(sched)


def test_d_failed_recv_fail_policy_errors_the_request():
    sched = d_scheduler(kv_load_failure_policy="fail")
    sched.add_request(make_request("d1", 40, max_tokens=2, kv_transfer_params=remote_params(40)))
    step(sched)
    meta = KVP2PWorkerMetadata({"d1": report(0, ok=False, reason="read failed")})
    st = step(sched, finished_recving={"d1"}, failed_recving={"d1"}, worker_meta=meta)
    assert st.output("d1").finish_reason == FinishReason.ERROR
    assert step(sched).meta.pulls == []
    assert_scheduler_empty(sched)


def test_d_preempted_after_load_is_not_pulled_again():
    """A loaded D request preempted for blocks is re-admitted through get_num_new_matched_tokens, which now says
    (0, False): it recomputes locally (from its prefix cache) instead of pulling twice."""
    # 6 blocks = 5 usable: "local" takes 2 (30 tokens), "d1" 3 (40 tokens); local's 3rd block preempts d1.
    sched = d_scheduler(num_blocks=6)
    matched = Spy(sched, "get_num_new_matched_tokens")
    sched.add_request(make_request("local", tokens(30, seed=3), max_tokens=6))
    sched.add_request(make_request("d1", 40, max_tokens=4, kv_transfer_params=remote_params(40)))

    steps = [step(sched, finished_recving={"d1"})]
    assert len(steps[0].meta.pulls) == 1
    request = sched.requests["d1"]
    for _ in range(20):
        if request.num_preemptions:
            break
        steps.append(step(sched))
    assert request.num_preemptions == 1, "d1 was never preempted; the block budget of this test is off"
    (preempted_at,) = [i for i, s in enumerate(steps) if "d1" in (s.so.preempted_req_ids or ())]
    steps += run_until_idle(sched)
    resumed = next(s for s in steps[preempted_at + 1 :] if "d1" in s.so.num_scheduled_tokens)
    assert resumed.so.num_scheduled_tokens["d1"] < request.num_tokens  # resumed from D's own prefix cache

    results = matched.results("d1")
    assert results[0] == (40, True)
    assert len(results) >= 2 and all(r == (0, False) for r in results[1:])
    assert len(collect_plans(steps)) == 1
    finished = {o.request_id: o for s in steps for o in s.outputs if o.finish_reason is not None}
    assert finished["d1"].finish_reason == FinishReason.LENGTH
    assert finished["local"].finish_reason == FinishReason.LENGTH
    assert_scheduler_empty(sched)


def test_d_abort_after_recv_before_promotion_frees_now():
    sched = d_scheduler()
    sched.add_request(make_request("d1", 40, max_tokens=2, kv_transfer_params=remote_params(40)))
    step(sched)
    step(sched, finished_recving={"d1"}, worker_meta=KVP2PWorkerMetadata({"d1": report(3)}))
    assert "d1" in sched.finished_recving_kv_req_ids
    sched.finish_requests("d1", RequestStatus.FINISHED_ABORTED)
    assert "d1" not in sched.requests  # the pull is over: nothing can still write the blocks
    assert step(sched).meta.pulls == []
    assert_scheduler_empty(sched)


def test_d_waits_for_blocks_then_plans_once():
    """No room for the pull's blocks yet: vLLM keeps the request WAITING and asks again every step; the one plan
    is made only when the blocks are allocated."""
    # 5 blocks = 4 usable; "local" keeps 3 for its 3 steps, "d1" needs 3.
    sched = d_scheduler(num_blocks=5)
    matched = Spy(sched, "get_num_new_matched_tokens")
    sched.add_request(make_request("local", tokens(40, seed=3), max_tokens=3))
    sched.add_request(make_request("d1", 40, max_tokens=2, kv_transfer_params=remote_params(40)))
    steps = [step(sched)]
    request = sched.requests["d1"]
    while request.status == RequestStatus.WAITING:
        assert len(steps) < 10
        steps.append(step(sched))
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    results = matched.results("d1")
    assert len(results) >= 2 and set(results) == {(40, True)}  # asked repeatedly, same answer
    (plan,) = collect_plans(steps)
    assert plan.awaiting and plan.local_block_ids == (tuple(request_block_ids(sched, "d1")),)
    steps = run_until_idle(sched, finished_recving={"d1"})
    assert collect_plans(steps) == []
    assert_scheduler_empty(sched)


def test_d_abort_while_waiting_for_blocks_releases_p():
    """Asked for, but never allocated (no room): an abort still releases P through a release-only plan."""
    sched = d_scheduler(num_blocks=5)
    params = remote_params(40)
    sched.add_request(make_request("local", tokens(40, seed=3), max_tokens=3))
    sched.add_request(make_request("d1", 40, max_tokens=2, kv_transfer_params=params))
    st = step(sched)
    assert sched.requests["d1"].status == RequestStatus.WAITING and st.meta.pulls == []
    sched.finish_requests("d1", RequestStatus.FINISHED_ABORTED)
    st = step(sched)
    assert st.meta.pulls == [PullPlan("d1", RemotePrefill.from_params(params), (), (), awaiting=False)]
    run_until_idle(sched)
    assert_scheduler_empty(sched)


def test_d_incompatible_block_size_plan_fails_and_recomputes():
    sched = d_scheduler(kv_load_failure_policy="recompute")
    sched.add_request(make_request("d1", 40, max_tokens=2, kv_transfer_params=remote_params(40, block_size=24)))
    st = step(sched)
    (plan,) = st.meta.pulls
    assert plan.awaiting and "P uses 24, D uses 16; one must divide the other" in plan.error
    # The worker only releases P and reports the receive failed.
    step(sched, finished_recving={"d1"}, failed_recving={"d1"})
    st = step(sched)
    assert st.so.num_scheduled_tokens == {"d1": 40}
    run_until_idle(sched)
    assert_scheduler_empty(sched)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_d_unparseable_params_fail_the_load_under_the_policy(policy):
    """Params that ask for a remote prefill but do not convert: one failed plan that contacts no one, and vLLM's
    kv_load_failure_policy ends the request (it used to run locally as if no params had been sent, and P's hold
    waited for its timeout)."""
    sched = d_scheduler(kv_load_failure_policy=policy)
    matched = Spy(sched, "get_num_new_matched_tokens")
    sched.add_request(make_request("d1", 40, max_tokens=2, kv_transfer_params={"do_remote_prefill": True}))
    workers = FakeWorkers()
    steps = workers.run_until_empty(sched)
    assert matched.results("d1")[0] == (39, True)
    (plan,) = workers.plans
    assert plan.error.startswith("invalid kv_transfer_params") and not plan.contact_p
    finished = {o.request_id: o.finish_reason for s in steps for o in s.outputs if o.finish_reason is not None}
    assert finished == {"d1": FinishReason.LENGTH if policy == "recompute" else FinishReason.ERROR}
    assert_scheduler_empty(sched)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_d_contract_with_workers_that_follow_awaiting(policy):
    """Every D path at once, with fake workers that report a receive exactly when ``PullPlan.awaiting`` says so:
    vLLM's asserts (scheduler.py `_update_from_kv_xfer_finished`) never fire, every request gets exactly one plan
    (so P is released exactly once), and nothing leaks."""
    sched = d_scheduler(kv_load_failure_policy=policy)
    shared = tokens(2 * BS + 1, seed=1)
    sched.add_request(make_request("warm", shared, max_tokens=1))
    run_until_idle(sched)

    workers = FakeWorkers(failing={"d-fail"})
    partial = shared[:BS] + tokens(24, seed=2)
    sched.add_request(make_request("d-full", shared, max_tokens=2,
                                   kv_transfer_params=remote_params(2 * BS, prompt=shared)))
    sched.add_request(make_request("d-partial", partial, max_tokens=2,
                                   kv_transfer_params=remote_params(40, request_id="p2", prompt=partial)))
    for name, seed in (("d-pull", 3), ("d-fail", 4), ("d-early-abort", 5)):
        sched.add_request(make_request(name, tokens(40, seed=seed), max_tokens=2, kv_transfer_params=remote_params(
            40, request_id=f"p{seed - 1}" if name != "d-pull" else "p3", prompt=tokens(40, seed=seed))))
    sched.finish_requests("d-early-abort", RequestStatus.FINISHED_ABORTED)
    steps = workers.run_until_empty(sched)

    per_request = {}
    for plan in workers.plans:
        per_request.setdefault(plan.request_id, []).append(plan)
    assert set(per_request) == {"d-full", "d-partial", "d-pull", "d-fail", "d-early-abort"}
    assert all(len(plans) == 1 for plans in per_request.values())
    assert not per_request["d-full"][0].awaiting and not per_request["d-early-abort"][0].awaiting
    assert per_request["d-partial"][0].num_blocks == 2 and per_request["d-pull"][0].num_blocks == 3
    assert not any(plan.error for plans in per_request.values() for plan in plans)  # every verdict admitted
    finished = {o.request_id: o.finish_reason for s in steps for o in s.outputs if o.finish_reason is not None}
    expected_fail = FinishReason.LENGTH if policy == "recompute" else FinishReason.ERROR
    assert finished == {"d-full": FinishReason.LENGTH, "d-partial": FinishReason.LENGTH,
                        "d-pull": FinishReason.LENGTH, "d-fail": expected_fail}
    assert_scheduler_empty(sched)
