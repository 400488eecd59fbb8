"""Speculative decoding at scheduler level, on every vLLM (vLLM 0.23 cannot run it in a CPU engine at all, see
tests/e2e_spec/conftest.py; Ascend deployments of 0.23 run DeepSeek with MTP).

vLLM's real ``SpeculativeConfig`` and ``Scheduler``. A drafter that runs a model (MTP, EAGLE) makes the scheduler
allocate look-ahead slots for its draft tokens: P gives a block-aligned prompt a block more than its tokens need,
and D, on 0.32, pads a request's first step (one token to compute: the prompt arrived by transfer) with a
placeholder draft. What must hold: P advertises exactly the prompt's blocks and frees the look-ahead block with
them; D plans a pull into exactly as many blocks, runs the request to its end, and nothing is left on either side.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
from vllm.v1.engine import FinishReason

from tests.scheduler.harness import (
    assert_scheduler_empty,
    make_request,
    make_scheduler,
    make_vllm_config,
    model_dir,
    mtp_model_dir,
    request_block_ids,
    run_until_idle,
    step,
    tokens,
)
from vllm_kvp2p.connector.metadata import KVP2PWorkerMetadata, PullReport

BS = 16
NUM_BLOCKS = 100
SPECS: dict[str, tuple[Callable[[], str], dict]] = {
    "mtp": (mtp_model_dir, {"method": "deepseek_mtp", "num_speculative_tokens": 2}),
    "ngram": (model_dir, {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2,
                          "prompt_lookup_max": 4}),
}


@pytest.mark.parametrize("method", sorted(SPECS))
@pytest.mark.parametrize("num_tokens", [32, 40], ids=["block-aligned", "partial-tail"])
def test_p_and_d_move_exactly_the_prompts_blocks_with_draft_lookahead(method: str, num_tokens: int) -> None:
    model, speculative = SPECS[method]
    p = make_scheduler(make_vllm_config("kv_producer", model=model(), speculative=speculative,
                                        engine_id="p-engine"), num_blocks=NUM_BLOCKS)
    d = make_scheduler(make_vllm_config("kv_consumer", model=model(), speculative=speculative,
                                        engine_id="d-engine"), num_blocks=NUM_BLOCKS)
    assert p.num_spec_tokens == 2
    lookahead = p.num_lookahead_tokens  # MTP: its draft tokens; n-gram runs no model and needs none
    assert lookahead == (2 if method == "mtp" else 0)
    prompt, n_blocks = tokens(num_tokens), math.ceil(num_tokens / BS)

    p.add_request(make_request("p1", prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
    st = step(p)
    (new_req,) = st.so.scheduled_new_reqs
    allocated = list(new_req.block_ids[0])
    assert len(allocated) == math.ceil((num_tokens + lookahead) / BS)  # the look-ahead block, when whole blocks
    out = st.output("p1")
    assert out.finish_reason == FinishReason.LENGTH
    params = out.kv_transfer_params
    assert params["remote_block_ids"] == [allocated[:n_blocks]] and params["remote_num_tokens"] == num_tokens

    d.add_request(make_request("d1", prompt, max_tokens=4, kv_transfer_params=params))
    st = step(d)
    (plan,) = st.meta.pulls
    assert plan.remote_block_ids == (tuple(allocated[:n_blocks]),)
    assert len(plan.local_block_ids[0]) == n_blocks
    assert list(plan.local_block_ids[0]) == request_block_ids(d, "d1")[:n_blocks]
    done = PullReport(ok=True, blocks=n_blocks, bytes=n_blocks * 4096, descriptors=n_blocks, seconds=0.01)
    step(d, finished_recving={"d1"}, worker_meta=KVP2PWorkerMetadata({"d1": done}))
    first = step(d)
    # One token to compute; on 0.32 padded with placeholder drafts (always rejected), so 1 or 1 + drafts.
    assert first.so.num_scheduled_tokens["d1"] in (1, 1 + p.num_spec_tokens)
    steps = [first, *run_until_idle(d)]
    finished = {o.request_id: o for s in steps for o in s.outputs if o.finish_reason is not None}
    assert finished["d1"].finish_reason == FinishReason.LENGTH
    assert_scheduler_empty(d)

    step(p, finished_sending={"p1"})  # D released P's hold: every block of the request, look-ahead included
    assert_scheduler_empty(p)
