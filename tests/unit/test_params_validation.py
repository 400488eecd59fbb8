"""kv_transfer_params come from any client of D's HTTP API: every field is checked before D plans anything, and
params that fail a check end the request without any network call (no claim, no release). Pure, no I/O."""

from __future__ import annotations

import pytest

from vllm_kvp2p.lifecycle.consumer import ConsumerSchedule
from vllm_kvp2p.lifecycle.pull import ConsumerPull, Finish, LocalKV, Source
from vllm_kvp2p.protocol import RemotePrefill
from vllm_kvp2p.tp_mapping import Layout, rank_plan
from vllm_kvp2p.transfer.descriptors import PlaneGeometry
from vllm_kvp2p.transfer.slicing import BlockShape

BS = 16
PROMPT = 60


def good(**change: object) -> dict:
    params = RemotePrefill("P", "p-req", "10.0.0.7", 20000, [[10, 11, 12, 13]], "hold", PROMPT, BS).to_params()
    params.update(change)
    return params


@pytest.mark.parametrize(("change", "field"), [
    ({"tp_size": 2_000_000}, "tp_size 2000000 outside 1..1024"),
    ({"tp_size": -3}, "tp_size -3"),
    ({"tp_size": 0}, "tp_size 0"),
    ({"remote_port": 65535, "tp_size": 2}, "remote_port 65535 with tp_size 2"),
    ({"remote_port": 0}, "remote_port 0"),
    ({"remote_host": "evil host;rm"}, "remote_host"),
    ({"remote_host": "a" * 300}, "remote_host"),
    ({"remote_engine_id": ""}, "remote_engine_id must have 1..256 characters, has 0"),
    ({"remote_hold_id": "h" * 10_000}, "remote_hold_id must have 1..256 characters, has 10000"),
    ({"remote_block_size": 0}, "remote_block_size 0"),
    ({"remote_num_tokens": 10**9}, "remote_num_tokens 1000000000 outside 1..60 (the prompt)"),
    ({"remote_num_tokens": -5}, "remote_num_tokens -5"),
    ({"remote_block_ids": []}, "remote_block_ids has 0 groups"),
    ({"remote_block_ids": [[1]] * 65}, "remote_block_ids has 65 groups"),
    ({"remote_block_ids": [[-1, -2, -3]]}, "remote_block_ids[0] holds a negative or repeated block id"),
    ({"remote_block_ids": [[5, 5]]}, "remote_block_ids[0] holds a negative or repeated block id"),
    ({"remote_block_ids": [list(range(200_000))]}, "remote_block_ids[0] has 200000 blocks; 60 tokens fill at most 4"),
])
def test_each_bad_field_is_named(change: dict, field: str) -> None:
    remote = RemotePrefill.from_params(good(**change))
    assert remote is not None
    assert field in remote.problem(PROMPT)


def test_good_params_and_large_but_plausible_ids_pass() -> None:
    assert RemotePrefill.from_params(good()).problem(PROMPT) == ""
    assert RemotePrefill.from_params(good(remote_host="p-0.prefill.svc.cluster.local")).problem(PROMPT) == ""
    assert RemotePrefill.from_params(good(remote_host="fd00::7")).problem(PROMPT) == ""
    # Out of P's range, but only P's registration knows: refused at pull time (descriptors), not here.
    assert RemotePrefill.from_params(good(remote_block_ids=[[2**62, 2**63 - 1]])).problem(PROMPT) == ""


def test_invalid_params_fail_the_plan_without_contacting_anyone() -> None:
    s = ConsumerSchedule(BS)
    bad = good(tp_size=2_000_000)
    # vLLM is asked to wait, so that its kv_load_failure_policy ends the request (recompute, or an error).
    assert s.matched_tokens("d1", bad, PROMPT, 0) == (PROMPT - 1, True)
    plan = s.on_alloc("d1", bad, PROMPT - 1, [[1, 2, 3, 4]], 0, PROMPT)
    assert plan is not None and plan.awaiting and not plan.contact_p
    assert plan.error == "invalid kv_transfer_params: tp_size 2000000 outside 1..1024"
    assert s.on_finished("d2", bad, PROMPT) is None  # a request that never got blocks: no release either
    # Params whose address is valid but whose content is not: nothing is read, but P is released.
    content = good(remote_block_ids=[[-1]])
    readable = s.on_alloc("d3", content, PROMPT - 1, [[1, 2, 3, 4]], 0, PROMPT)
    assert readable is not None and readable.contact_p and "negative or repeated block id" in readable.error
    released = s.on_finished("d4", content, PROMPT)
    assert released is not None and not released.awaiting and released.num_blocks == 0

    shape = BlockShape(True, 2, BS, 16)
    local = LocalKV((PlaneGeometry(1 << 20, 512, 512, 100),), (shape,), BS, ("l0",), "float32", 2)
    job = ConsumerPull(plan, [Source(0)], "d:0", local, claim_wait=1.0, max_batch_entries=64, now=0.0)
    action = job.next_action(0.0)
    assert isinstance(action, Finish)  # no registration, claim or release: nothing goes out
    assert action.result.report_failed and "tp_size 2000000" in action.result.reason


def test_without_the_check_one_request_would_make_d_release_every_rank_it_names() -> None:
    """What the tp_size bound prevents: D derives the P ranks to release from the params' tp_size alone."""
    mapping = rank_plan(Layout(100_000, 8, False), Layout(1, 8, False), 0)
    assert len(mapping.p_ranks) == 100_000  # one side-channel round trip (up to its timeout) each
