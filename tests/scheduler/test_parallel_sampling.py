"""vLLM's real ``Scheduler`` with ``n > 1``: vLLM fans a request out into n children (ids ``{index}_{parent}``)
carrying the same ``kv_transfer_params``. On D one child reads P's hold and the others wait for its blocks and take
them from D's prefix cache (vllm_kvp2p/lifecycle/shared_holds.py); on P the children offer one hold
(vllm_kvp2p/lifecycle/sibling_offers.py). Before these, D planned one pull per child (P refuses every claim of a
hold but the first) and P kept one hold per child while vLLM returned the params of only one."""

from __future__ import annotations

import pytest
from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus

from tests.scheduler.harness import (
    assert_scheduler_empty,
    connector_side,
    make_request,
    num_free_blocks,
    request_block_ids,
    run_until_idle,
    step,
    tokens,
)
from tests.scheduler.test_scheduler_lifecycle import (
    collect_plans,
    d_scheduler,
    p_scheduler,
    remote_params,
    report,
)
from vllm_kvp2p.metadata import KVP2PWorkerMetadata
from vllm_kvp2p.scheduler import PULL_REPORT_KEY

PARENT = "cmpl-abc-0-1a2b3c4d"  # vLLM's internal id of the parent: the client's id and a random suffix
CHILDREN = [f"{i}_{PARENT}" for i in range(3)]


def add_children(sched, params: dict, num_tokens: int = 40, max_tokens: int = 3) -> None:
    for child in CHILDREN:  # each child has its own copy, as after the trip from vLLM's front end to EngineCore
        sched.add_request(make_request(child, num_tokens, max_tokens=max_tokens, kv_transfer_params=dict(params)))


def test_d_children_share_one_pull_and_compute_only_the_last_partial_block():
    sched = d_scheduler()
    params = remote_params(40)  # 40 tokens: two full blocks of 16 and 8 tokens in a third
    add_children(sched, params)

    first = step(sched)
    (plan,) = first.meta.pulls  # one plan for the hold, by the first child
    assert plan.request_id == CHILDREN[0] and plan.awaiting
    assert sched.requests[CHILDREN[0]].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    for child in CHILDREN[1:]:  # the others wait for it, with no blocks and no plan
        assert sched.requests[child].status == RequestStatus.WAITING
        assert sched.kv_cache_manager.get_block_ids(child) == ([],) or not any(
            sched.kv_cache_manager.get_block_ids(child))
    assert collect_plans([step(sched) for _ in range(2)]) == []  # while the pull runs: nothing new

    meta = KVP2PWorkerMetadata({CHILDREN[0]: report(3)})
    step(sched, finished_recving={CHILDREN[0]}, worker_meta=meta)
    landed = step(sched)
    assert landed.so.num_scheduled_tokens == {CHILDREN[0]: 1}  # the reader runs with its pulled blocks
    followers = step(sched)
    # The followers find the reader's two full blocks in the prefix cache: 8 tokens computed each, nothing pulled.
    assert {c: followers.so.num_scheduled_tokens.get(c) for c in CHILDREN[1:]} == {c: 40 - 32 for c in CHILDREN[1:]}
    for child in CHILDREN[1:]:
        assert request_block_ids(sched, child)[:2] == request_block_ids(sched, CHILDREN[0])[:2]
    assert followers.meta.pulls == []

    steps = run_until_idle(sched)
    assert collect_plans(steps) == []  # no follower contacts P, not even to release at its end
    finished = {o.request_id: o for s in [first, landed, followers, *steps] for o in s.outputs
                if o.finish_reason is not None}
    assert set(finished) == set(CHILDREN)
    assert finished[CHILDREN[0]].kv_transfer_params[PULL_REPORT_KEY]["ok"] is True
    assert_scheduler_empty(sched)
    assert len(connector_side(sched).consumer.shared) == 0


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_d_followers_of_a_failed_pull_compute_the_prompt_themselves(policy):
    sched = d_scheduler(kv_load_failure_policy=policy)
    add_children(sched, remote_params(40))
    (plan,) = step(sched).meta.pulls
    meta = KVP2PWorkerMetadata({CHILDREN[0]: report(0, ok=False, reason="claim refused")})
    st = step(sched, finished_recving={CHILDREN[0]}, failed_recving={CHILDREN[0]}, worker_meta=meta)
    steps = [st, *run_until_idle(sched)]
    assert collect_plans(steps) == []
    finished = {o.request_id: o for s in steps for o in s.outputs if o.finish_reason is not None}
    assert set(finished) == set(CHILDREN)
    want_reader = FinishReason.ERROR if policy == "fail" else FinishReason.LENGTH
    assert finished[CHILDREN[0]].finish_reason == want_reader
    assert all(finished[c].finish_reason == FinishReason.LENGTH for c in CHILDREN[1:])
    assert_scheduler_empty(sched)
    assert len(connector_side(sched).consumer.shared) == 0


def test_d_a_follower_aborted_while_it_waits_releases_nothing():
    sched = d_scheduler()
    add_children(sched, remote_params(40))
    (plan,) = step(sched).meta.pulls
    sched.finish_requests(CHILDREN[1], RequestStatus.FINISHED_ABORTED)
    assert step(sched).meta.pulls == []  # a release by the follower would end the reader's lease on P
    steps = run_until_idle(sched, finished_recving={CHILDREN[0]},
                           worker_meta=KVP2PWorkerMetadata({CHILDREN[0]: report(3)}))
    assert collect_plans(steps) == []
    assert_scheduler_empty(sched)
    assert len(connector_side(sched).consumer.shared) == 0


def test_d_followers_wait_for_a_reader_that_finishes_first():
    """A reader that ends before its followers were admitted (one decode step) leaves the hold record to them:
    they do not claim the hold it released."""
    sched = d_scheduler(max_num_seqs=1)  # one running request at a time: the followers wait for the reader's end
    add_children(sched, remote_params(40), max_tokens=1)
    (plan,) = step(sched).meta.pulls
    steps = run_until_idle(sched, finished_recving={CHILDREN[0]},
                           worker_meta=KVP2PWorkerMetadata({CHILDREN[0]: report(3)}))
    assert collect_plans(steps) == []
    assert {o.request_id for s in steps for o in s.outputs if o.finish_reason is not None} == set(CHILDREN)
    assert_scheduler_empty(sched)


def test_d_requests_of_other_holds_are_not_held_back():
    sched = d_scheduler()
    sched.add_request(make_request("a", 40, max_tokens=2, kv_transfer_params=remote_params(40, hold_id="h-a")))
    sched.add_request(make_request("b", 40, max_tokens=2, kv_transfer_params=remote_params(40, hold_id="h-b")))
    plans = step(sched).meta.pulls
    assert sorted(p.request_id for p in plans) == ["a", "b"]


def test_p_children_offer_one_hold_and_free_the_others_blocks():
    sched = p_scheduler()
    prompt = tokens(40)
    free = num_free_blocks(sched)
    for child in CHILDREN:
        sched.add_request(make_request(child, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
    st = step(sched)
    outputs = {child: st.output(child) for child in CHILDREN}
    # vLLM 0.32 adds each child's own prefix-cache hit (remote_prefill_cached_tokens) to what the connector returns.
    params = [{k: v for k, v in out.kv_transfer_params.items() if k != "remote_prefill_cached_tokens"}
              for out in outputs.values()]
    assert all(p == params[0] for p in params)  # whichever child vLLM answers with, the same hold
    (hold,) = step(sched).meta.holds  # request_finished ran after this step's metadata: the next one carries it
    assert hold.request_id == CHILDREN[0] and params[0]["remote_hold_id"] == hold.hold_id
    assert all(out.finish_reason == FinishReason.LENGTH for out in outputs.values())
    # Only the first child's three blocks stay held; the others' were freed when they finished.
    assert set(sched.requests) == {CHILDREN[0]}
    assert num_free_blocks(sched) == free - 3
    step(sched, finished_sending={CHILDREN[0]})
    assert_scheduler_empty(sched)


def test_p_children_with_different_prompts_and_unrelated_requests_hold_their_own():
    sched = p_scheduler()
    sched.add_request(make_request(f"0_{PARENT}", tokens(40), max_tokens=1,
                                   kv_transfer_params={"do_remote_decode": True}))
    sched.add_request(make_request(f"1_{PARENT}", tokens(40, seed=5), max_tokens=1,
                                   kv_transfer_params={"do_remote_decode": True}))
    sched.add_request(make_request("0_other-parent", tokens(40), max_tokens=1,
                                   kv_transfer_params={"do_remote_decode": True}))
    st = step(sched)
    assert len({st.output(r).kv_transfer_params["remote_hold_id"] for r in sched.requests}) == 3
    assert len(step(sched).meta.holds) == 3
    step(sched, finished_sending=set(sched.requests))
    assert_scheduler_empty(sched)
