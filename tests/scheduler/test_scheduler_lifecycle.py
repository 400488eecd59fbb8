"""vLLM's real ``Scheduler`` driving ``MooncakeP2PConnector`` (SCHEDULER role) through whole request lifecycles.

P (kv_producer): a remote-decode request is prefilled, finishes with one token, returns ``kv_transfer_params`` and
keeps its blocks (a HoldOrder goes to the workers) until the workers report ``finished_sending``.
D (kv_consumer): a request carrying P's params parks in WAITING_FOR_REMOTE_KVS with exactly one PullPlan, runs once
``finished_recving`` arrives, and every other path (local prefix hit, abort, load failure, preemption) ends with the
scheduler empty: no request, no queue entry, no block still referenced.
"""

from __future__ import annotations

import math

import pytest
from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus

from tests.scheduler.harness import (
    FakeWorkers,
    Spy,
    assert_scheduler_empty,
    connector_side,
    make_request,
    make_scheduler,
    make_vllm_config,
    model_runner_output,
    num_free_blocks,
    request_block_ids,
    run_until_idle,
    step,
    tokens,
)
from vllm_kvp2p.connector.metadata import HoldOrder, KVP2PWorkerMetadata, PullReport
from vllm_kvp2p.connector.scheduler import PULL_REPORT_KEY
from vllm_kvp2p.contract.protocol import RemotePrefill, prompt_digest
from vllm_kvp2p.lifecycle.consumer import PullPlan

BS = 16
NUM_BLOCKS = 100
P_ENGINE = "p-engine-0"
D_ENGINE = "d-engine-0"


# --------------------------------------------------------------------------- fixtures and helpers


def p_scheduler(num_blocks: int = NUM_BLOCKS, **kw):
    return make_scheduler(make_vllm_config("kv_producer", engine_id=P_ENGINE, **kw), num_blocks=num_blocks)


def d_scheduler(num_blocks: int = NUM_BLOCKS, **kw):
    return make_scheduler(make_vllm_config("kv_consumer", engine_id=D_ENGINE, **kw), num_blocks=num_blocks)


def remote_params(num_tokens: int, *, first_block: int = 200, request_id: str = "p-req", hold_id: str = "hold-1",
                  block_size: int = BS, prompt: list[int] | None = None) -> dict:
    """The kv_transfer_params a P engine would return for the first ``num_tokens`` of ``prompt`` (default: the
    harness's ``tokens(num_tokens)``, what ``make_request(id, num_tokens)`` prompts) held in P blocks 200, 201, ..."""
    n_blocks = math.ceil(num_tokens / block_size)
    return RemotePrefill(
        remote_engine_id=P_ENGINE,
        remote_request_id=request_id,
        remote_host="127.0.0.1",
        remote_port=14600,
        remote_block_ids=[list(range(first_block, first_block + n_blocks))],
        remote_hold_id=hold_id,
        remote_num_tokens=num_tokens,
        remote_block_size=block_size,
        remote_prompt_digest=prompt_digest((prompt or tokens(num_tokens))[:num_tokens]),
    ).to_params()


def prefill_on_p(p_sched, request_id: str, prompt: list[int]) -> tuple[dict, list[int]]:
    """Run one remote-decode request on P to completion; returns (its kv_transfer_params, its block ids).
    The blocks stay held by P until :func:`release_on_p`."""
    p_sched.add_request(make_request(request_id, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
    st = step(p_sched)
    out = st.output(request_id)
    assert out.finish_reason == FinishReason.LENGTH
    assert out.kv_transfer_params is not None
    return out.kv_transfer_params, request_block_ids(p_sched, request_id)


def release_on_p(p_sched, request_id: str) -> None:
    """P's workers report that D released the hold."""
    step(p_sched, finished_sending={request_id})
    assert_scheduler_empty(p_sched)


def collect_plans(steps) -> list[PullPlan]:
    return [plan for st in steps for plan in st.meta.pulls]


def report(blocks: int, ok: bool = True, reason: str = "") -> PullReport:
    return PullReport(ok=ok, blocks=blocks, bytes=blocks * 4096, descriptors=2 * blocks, seconds=0.01, reason=reason)


# --------------------------------------------------------------------------- P (kv_producer)


@pytest.mark.parametrize("num_tokens", [40, 32, 5], ids=["partial-tail", "block-aligned", "shorter-than-a-block"])
def test_p_remote_decode_holds_blocks_until_finished_sending(num_tokens):
    sched = p_scheduler()
    sched.add_request(make_request("p1", num_tokens, max_tokens=1, kv_transfer_params={"do_remote_decode": True}))

    st = step(sched)
    (new_req,) = st.so.scheduled_new_reqs
    (allocated,) = new_req.block_ids
    out = st.output("p1")
    assert out.finish_reason == FinishReason.LENGTH
    request = sched.requests["p1"]  # finished, but held: still known to the scheduler
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert "p1" in sched.finished_req_ids

    remote = RemotePrefill.from_params(out.kv_transfer_params)
    assert remote is not None
    n_blocks = math.ceil(num_tokens / BS)
    assert n_blocks >= 1
    assert remote.remote_block_ids == [list(allocated)[:n_blocks]]
    assert len(remote.remote_block_ids[0]) == n_blocks
    assert remote.remote_num_tokens == num_tokens
    assert remote.remote_request_id == "p1"
    assert remote.remote_engine_id == P_ENGINE
    assert remote.remote_block_size == BS
    assert remote.do_remote_prefill and not remote.do_remote_decode
    assert remote.remote_hold_id

    held = NUM_BLOCKS - 1 - n_blocks
    assert num_free_blocks(sched) == held
    # The hold is shipped to the workers with the next schedule(), exactly once.
    st = step(sched)
    # n_blocks: the gauge; the offered blocks: what P answers integrity questions about
    assert st.meta.holds == [HoldOrder("p1", remote.remote_hold_id, n_blocks,
                                       tuple(tuple(ids) for ids in remote.remote_block_ids))]
    assert st.meta.pulls == []
    st = step(sched)
    assert st.meta.holds == []
    assert "p1" in sched.requests and num_free_blocks(sched) == held

    # Workers report the hold released: blocks are freed.
    step(sched, finished_sending={"p1"})
    assert_scheduler_empty(sched)


def test_p_remote_decode_stopped_by_eos_is_held_too():
    sched = p_scheduler()
    sched.add_request(make_request("p1", 20, max_tokens=4, kv_transfer_params={"do_remote_decode": True}))
    st = step(sched, eos=True)
    assert st.output("p1").finish_reason == FinishReason.STOP
    assert RemotePrefill.from_params(st.output("p1").kv_transfer_params) is not None
    assert "p1" in sched.requests
    release_on_p(sched, "p1")


def test_p_prefix_cache_hit_advertises_all_blocks():
    """A second request with the same prompt shares P's cached blocks; both hold them (ref counts) until sent."""
    sched = p_scheduler()
    prompt = tokens(40)
    params1, _ = prefill_on_p(sched, "p1", prompt)
    params2, _ = prefill_on_p(sched, "p2", prompt)
    (ids1,), (ids2,) = params1["remote_block_ids"], params2["remote_block_ids"]
    assert len(ids1) == len(ids2) == 3
    assert ids1[:2] == ids2[:2]  # the two full blocks are shared through the prefix cache
    assert ids1[2] != ids2[2]  # the partial tail is each request's own
    assert params2["remote_num_tokens"] == 40
    step(sched, finished_sending={"p1"})
    assert "p2" in sched.requests and num_free_blocks(sched) == NUM_BLOCKS - 1 - 3
    release_on_p(sched, "p2")


def test_p_abort_before_scheduling_frees_now_without_params():
    sched = p_scheduler()
    finished = Spy(sched, "request_finished_all_groups")
    sched.add_request(make_request("p1", 40, max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
    sched.finish_requests("p1", RequestStatus.FINISHED_ABORTED)
    assert finished.results("p1") == [(False, None)]
    st = step(sched)
    assert st.meta.holds == []
    assert_scheduler_empty(sched)


def test_p_abort_mid_prefill_frees_now_without_params():
    """Aborted while its (chunked) prefill is in flight: no hold, blocks freed at once."""
    sched = p_scheduler(max_num_batched_tokens=32)
    finished = Spy(sched, "request_finished_all_groups")
    sched.add_request(make_request("p1", 100, max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"p1": 32}
    assert num_free_blocks(sched) < NUM_BLOCKS - 1
    sched.finish_requests("p1", RequestStatus.FINISHED_ABORTED)
    assert finished.results("p1") == [(False, None)]
    assert "p1" not in sched.requests
    outputs = sched.update_from_output(so, model_runner_output(["p1"]))
    assert all(o.kv_transfer_params is None for eco in outputs.values() for o in eco.outputs)
    st = step(sched)
    assert st.meta.holds == []
    assert_scheduler_empty(sched)


def test_p_abort_after_finish_keeps_blocks_until_sent():
    """An abort that arrives while D may be reading does not free P's blocks; finished_sending does."""
    sched = p_scheduler()
    prefill_on_p(sched, "p1", tokens(40))
    assert sched.finish_requests("p1", RequestStatus.FINISHED_ABORTED) == []  # already finished: ignored
    assert step(sched).meta.holds != []
    assert "p1" in sched.requests and num_free_blocks(sched) == NUM_BLOCKS - 1 - 3
    release_on_p(sched, "p1")


def test_p_plain_request_is_not_held():
    sched = p_scheduler()
    sched.add_request(make_request("plain", 20, max_tokens=1))
    st = step(sched)
    assert st.output("plain").kv_transfer_params is None
    assert st.meta.holds == []
    assert step(sched).meta.holds == []
    assert_scheduler_empty(sched)


# --------------------------------------------------------------------------- D (kv_consumer)


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


def test_kv_both_serves_as_p_and_d_at_once():
    sched = make_scheduler(make_vllm_config("kv_both", engine_id="both-0"), num_blocks=NUM_BLOCKS)
    sched.add_request(make_request("p1", 40, max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
    sched.add_request(make_request("d1", tokens(40, seed=9), max_tokens=2,
                                   kv_transfer_params=remote_params(40, prompt=tokens(40, seed=9))))
    st = step(sched)
    assert RemotePrefill.from_params(st.output("p1").kv_transfer_params).remote_engine_id == "both-0"
    assert sched.requests["d1"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert len(st.meta.pulls) == 1
    st = step(sched, finished_recving={"d1"})
    assert len(st.meta.holds) == 1
    run_until_idle(sched, finished_sending={"p1"})
    assert_scheduler_empty(sched)


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


def test_d_request_with_prompt_logprobs_computes_its_prompt_and_releases_p():
    """``prompt_logprobs`` makes vLLM skip the prefix cache and compute the whole prompt: KV loaded for it would
    stand in for tokens whose logprobs it must compute. vLLM 0.32's scheduler ignores such a load itself; 0.23 took
    it, and its engine died on the request (found by tests/e2e/test_openai_surface.py on 0.23)."""
    sched = d_scheduler()
    params = remote_params(40)
    sched.add_request(make_request("d1", 40, max_tokens=2, kv_transfer_params=params, prompt_logprobs=1))
    st = step(sched)
    assert st.so.num_scheduled_tokens == {"d1": 40}  # the whole prompt, on D
    assert st.meta.pulls == [PullPlan("d1", RemotePrefill.from_params(params), (), (), awaiting=False)]  # release
    steps = run_until_idle(sched)
    assert collect_plans(steps) == []
    assert_scheduler_empty(sched)
