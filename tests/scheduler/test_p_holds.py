"""vLLM's real ``Scheduler`` driving the connector (SCHEDULER role) as P (kv_producer): a remote-decode request is
prefilled, finishes with one token, returns ``kv_transfer_params`` and keeps its blocks (a HoldOrder goes to the
workers) until the workers report ``finished_sending``; an abort before the params exist frees at once, one after
them does not; a plain request is never held. And kv_both: one scheduler serving as P and D at once."""

from __future__ import annotations

import math

import pytest
from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus

from tests.scheduler.harness import (
    Spy,
    assert_scheduler_empty,
    make_request,
    make_scheduler,
    make_vllm_config,
    model_runner_output,
    num_free_blocks,
    run_until_idle,
    step,
    tokens,
)
from tests.scheduler.p_and_d import (
    BS,
    NUM_BLOCKS,
    P_ENGINE,
    p_scheduler,
    prefill_on_p,
    release_on_p,
    remote_params,
)
from vllm_kvp2p.connector.metadata import HoldOrder
from vllm_kvp2p.contract.protocol import RemotePrefill

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


# --------------------------------------------------------------------------- kv_both: P and D at once


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
