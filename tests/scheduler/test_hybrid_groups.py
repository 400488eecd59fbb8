"""vLLM's real ``Scheduler`` with its hybrid allocator (HMA): a full-attention group and a sliding-window group.

The connector declares ``SupportsHMA``, so vLLM keeps HMA on; block ids then come and go per KV-cache group. For
a sliding window of ``w`` tokens P offers, and D pulls, only the blocks inside the window (at most
``cdiv(w, block_size) + 1``); full attention moves every block; everything ends with both schedulers empty.
"""

from __future__ import annotations

import math

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
from vllm.v1.request import RequestStatus

from tests.scheduler.harness import (
    assert_scheduler_empty,
    make_request,
    make_scheduler,
    make_vllm_config,
    run_until_idle,
    step,
    tokens,
)
from vllm_kvp2p.connector import compat
from vllm_kvp2p.transfer.kv_groups import UnsupportedKVCacheError

BS = 16
WINDOW = 40  # tokens: cdiv(40, 16) + 1 = 4 blocks at most
MAX_WINDOW_BLOCKS = math.ceil(WINDOW / BS) + 1
NUM_BLOCKS = 200


def hybrid_scheduler(role: str, engine_id: str, window: int | None = WINDOW):
    if role != "kv_producer" and window is not None and not compat.REPORTS_FAILED_REQUESTS:
        pytest.skip("this vLLM refuses a decoder with several KV-cache groups "
                    "(test_a_decoder_with_several_groups_is_refused_where_vllm_takes_failures_only_as_block_ids)")
    return make_scheduler(make_vllm_config(role, engine_id=engine_id, block_size=BS), num_blocks=NUM_BLOCKS,
                          sliding_window=window)


def group_block_ids(sched, request_id: str) -> tuple[list[int], ...]:
    return tuple(list(g) for g in sched.kv_cache_manager.get_block_ids(request_id))


def prefill(p_sched, request_id: str, prompt: list[int]) -> tuple[dict, tuple[list[int], ...]]:
    p_sched.add_request(make_request(request_id, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
    st = step(p_sched)
    out = st.output(request_id)
    assert out.kv_transfer_params is not None
    return out.kv_transfer_params, group_block_ids(p_sched, request_id)


def test_connector_keeps_vllms_hybrid_allocator_on() -> None:
    sched = hybrid_scheduler("kv_producer", "p")
    assert isinstance(sched.connector, SupportsHMA)
    assert sched.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False
    assert len(sched.kv_cache_manager.kv_cache_config.kv_cache_groups) == 2


def test_a_decoder_with_several_groups_is_refused_where_vllm_takes_failures_only_as_block_ids(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.23's case, on any vLLM: D's engine does not start, with the way out named; P and a one-group D do."""
    monkeypatch.setattr(compat, "REPORTS_FAILED_REQUESTS", False)
    with pytest.raises(UnsupportedKVCacheError, match="--disable-hybrid-kv-cache-manager"):
        make_scheduler(make_vllm_config("kv_consumer", engine_id="d", block_size=BS), num_blocks=NUM_BLOCKS,
                       sliding_window=WINDOW)
    with pytest.raises(UnsupportedKVCacheError, match="2 KV-cache groups"):
        make_scheduler(make_vllm_config("kv_both", engine_id="d", block_size=BS), num_blocks=NUM_BLOCKS,
                       sliding_window=WINDOW)
    make_scheduler(make_vllm_config("kv_producer", engine_id="p", block_size=BS), num_blocks=NUM_BLOCKS,
                   sliding_window=WINDOW)
    make_scheduler(make_vllm_config("kv_consumer", engine_id="d", block_size=BS), num_blocks=NUM_BLOCKS)


@pytest.mark.skipif(compat.REPORTS_FAILED_REQUESTS, reason="this vLLM takes failed loads as request ids")
def test_without_the_refusal_one_failed_pull_stops_this_vllms_scheduler(monkeypatch: pytest.MonkeyPatch) -> None:
    """Why the refusal exists: with the check bypassed, the block ids of one failed pull make vLLM 0.23's own
    scheduler raise (its engine core dies with it)."""
    p_sched = hybrid_scheduler("kv_producer", "p")
    monkeypatch.setattr(compat, "REPORTS_FAILED_REQUESTS", True)  # only the start-up check reads it
    d_sched = hybrid_scheduler("kv_consumer", "d")
    prompt = tokens(100)
    params, _ = prefill(p_sched, "p1", prompt)
    d_sched.add_request(make_request("d1", prompt, max_tokens=2, kv_transfer_params=params))
    step(d_sched)
    with pytest.raises(ValueError, match="too many values to unpack"):
        step(d_sched, finished_recving={"d1"}, failed_recving={"d1"})


@pytest.mark.parametrize("num_tokens", [100, 33, 20], ids=["beyond-window", "just-under-window", "one-block-plus"])
def test_p_offers_full_group_whole_and_sliding_group_window_only(num_tokens: int) -> None:
    p_sched = hybrid_scheduler("kv_producer", "p")
    params, (full, sliding) = prefill(p_sched, "p1", tokens(num_tokens))
    n_blocks = math.ceil(num_tokens / BS)
    offered_full, offered_sliding = params["remote_block_ids"]
    assert offered_full == full[:n_blocks]
    assert len(offered_sliding) == min(n_blocks, MAX_WINDOW_BLOCKS)
    assert offered_sliding == sliding[:n_blocks][-len(offered_sliding):]  # the tail: the window
    assert 0 not in offered_sliding  # never vLLM's null block
    if num_tokens > WINDOW + BS:
        assert sliding[0] == 0  # vLLM already dropped P's blocks before the window: they are not offered
    step(p_sched, finished_sending={"p1"})
    assert_scheduler_empty(p_sched)


def test_d_pulls_every_full_block_and_only_the_window_of_sliding_layers() -> None:
    p_sched, d_sched = hybrid_scheduler("kv_producer", "p"), hybrid_scheduler("kv_consumer", "d")
    prompt = tokens(100)
    params, _ = prefill(p_sched, "p1", prompt)
    d_sched.add_request(make_request("d1", prompt, max_tokens=3, kv_transfer_params=params))
    st = step(d_sched)
    request = d_sched.requests["d1"]
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (plan,) = st.meta.pulls
    assert plan.awaiting and plan.error == ""
    d_full, d_sliding = group_block_ids(d_sched, "d1")
    (local_full, local_sliding), (remote_full, remote_sliding) = plan.local_block_ids, plan.remote_block_ids
    assert local_full == tuple(d_full) and remote_full == tuple(params["remote_block_ids"][0])
    assert 0 < len(local_sliding) <= MAX_WINDOW_BLOCKS
    assert local_sliding == tuple(b for b in d_sliding if b != 0)[-len(local_sliding):]
    assert remote_sliding == tuple(params["remote_block_ids"][1][-len(local_sliding):])
    assert plan.num_blocks == len(local_full) + len(local_sliding) < 2 * len(local_full)

    run_until_idle(d_sched, finished_recving={"d1"})
    assert_scheduler_empty(d_sched)
    step(p_sched, finished_sending={"p1"})
    assert_scheduler_empty(p_sched)


def test_d_local_prefix_hit_pulls_only_the_rest_of_each_group() -> None:
    p_sched, d_sched = hybrid_scheduler("kv_producer", "p"), hybrid_scheduler("kv_consumer", "d")
    prompt = tokens(100)
    # D already served the first 64 tokens (4 full blocks) itself.
    d_sched.add_request(make_request("warm", prompt[:64] + tokens(8, seed=7), max_tokens=1))
    for _ in range(4):
        step(d_sched)
    assert "warm" not in d_sched.requests
    params, _ = prefill(p_sched, "p1", prompt)
    d_sched.add_request(make_request("d1", prompt, max_tokens=2, kv_transfer_params=params))
    st = step(d_sched)
    (plan,) = st.meta.pulls
    assert plan.error == "", plan.error
    local_full, local_sliding = plan.local_block_ids
    assert len(local_full) == math.ceil(100 / BS) - 4  # blocks 4..6
    assert plan.remote_block_ids[0] == tuple(params["remote_block_ids"][0][4:])
    assert len(local_sliding) <= MAX_WINDOW_BLOCKS
    run_until_idle(d_sched, finished_recving={"d1"})
    assert_scheduler_empty(d_sched)
    step(p_sched, finished_sending={"p1"})


def test_params_from_a_p_without_the_sliding_group_fail_the_plan_with_a_reason() -> None:
    p_sched = make_scheduler(make_vllm_config("kv_producer", engine_id="p", block_size=BS), num_blocks=NUM_BLOCKS)
    d_sched = hybrid_scheduler("kv_consumer", "d")
    prompt = tokens(60)
    params, _ = prefill(p_sched, "p1", prompt)
    d_sched.add_request(make_request("d1", prompt, max_tokens=2, kv_transfer_params=params))
    (plan,) = step(d_sched).meta.pulls
    assert plan.awaiting and "KV-cache groups differ: P sent 1, D has 2" in plan.error


def test_p_holds_back_the_last_prompt_token_of_a_model_with_state_once() -> None:
    """What P does for a model with a linear-attention state (the real engine test is tests/e2e_state): the
    request vLLM created is shortened by one token, once, and only for the decoder's prefill."""
    from vllm_kvp2p.connector.scheduler import _drop_last_prompt_token

    request = make_request("p1", tokens(50), max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    _drop_last_prompt_token(request)
    _drop_last_prompt_token(request)  # offered again (e.g. after a preemption): not shortened twice
    assert request.num_prompt_tokens == 49 and request.prompt_token_ids == tokens(50)[:49]
    assert list(request.all_token_ids) == tokens(50)[:49] and request.max_tokens == 1
    one = make_request("p2", tokens(1), max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    _drop_last_prompt_token(one)
    assert one.num_prompt_tokens == 1


@pytest.mark.parametrize("warm_tokens", [0, 64], ids=["cold", "d-prefix-hit"])
def test_all_sliding_model_pulls_only_the_window(warm_tokens: int) -> None:
    """One sliding-window group and no full-attention group (Mistral style): the window's blocks only, also
    after a local prefix hit on D (whose length no full-attention group tells here)."""
    def sched(role: str, engine: str):
        return make_scheduler(make_vllm_config(role, engine_id=engine, block_size=BS), num_blocks=NUM_BLOCKS,
                              sliding_window=WINDOW, full_attention=False)

    p_sched, d_sched = sched("kv_producer", "p"), sched("kv_consumer", "d")
    prompt = tokens(150)
    if warm_tokens:
        d_sched.add_request(make_request("warm", prompt[:warm_tokens] + tokens(8, seed=7), max_tokens=1))
        for _ in range(4):
            step(d_sched)
    params, (sliding,) = prefill(p_sched, "p1", prompt)
    (offered,) = params["remote_block_ids"]
    assert len(offered) == MAX_WINDOW_BLOCKS and offered == [b for b in sliding if b][-MAX_WINDOW_BLOCKS:]
    d_sched.add_request(make_request("d1", prompt, max_tokens=2, kv_transfer_params=params))
    st = step(d_sched)
    (plan,) = st.meta.pulls
    assert plan.error == "" and plan.awaiting, plan.error
    ((local,),) = (plan.local_block_ids,)
    assert 0 < len(local) <= MAX_WINDOW_BLOCKS
    assert plan.remote_block_ids == (tuple(offered[-len(local):]),)
    run_until_idle(d_sched, finished_recving={"d1"})
    assert_scheduler_empty(d_sched)
