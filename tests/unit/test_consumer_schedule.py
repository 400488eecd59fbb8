"""D's scheduler half (``ConsumerSchedule``): exactly one plan per request whatever the order vLLM calls it in, what
vLLM is told to wait for beyond its local prefix-cache hit, a release only when nothing is left to pull, and P's
blocks mapped onto D's of another block size (or the plan failed, never the engine). Pure, no I/O."""

from __future__ import annotations

from tests.support.prompts import prompt
from tests.unit.consumer_pulls import BS, params
from vllm_kvp2p.lifecycle.consumer import ConsumerSchedule


def test_matched_tokens_is_pure_and_counts_beyond_local_hit() -> None:
    s = ConsumerSchedule(BS)
    for _ in range(3):
        assert s.matched_tokens("d1", params(), prompt(60), 16) == (44, True)
    assert s.take_plans() == []


def test_full_local_hit_plans_a_release_only() -> None:
    s = ConsumerSchedule(BS)
    assert s.matched_tokens("d1", params(), prompt(60), 60) == (0, False)
    plan = s.on_alloc("d1", params(), 0, [], 60, prompt(60))
    assert plan is not None and not plan.awaiting and plan.local_block_ids == ()
    assert s.take_plans() == [plan]


def test_partial_hit_with_tail_shorter_than_a_block_computes_locally() -> None:
    s = ConsumerSchedule(BS)
    assert s.matched_tokens("d1", params(), prompt(60), 48) == (0, False)  # 12 tokens left, < one block
    assert s.matched_tokens("d2", params(1, num_tokens=10), prompt(10), 0) == (10, True)  # no hit: pull it all


def test_partial_hit_pulls_only_missing_blocks() -> None:
    s = ConsumerSchedule(BS)
    plan = s.on_alloc("d1", params(), 28, [[7, 8]], 32, prompt(60))  # 2 of 4 blocks cached locally
    assert plan is not None and plan.awaiting
    assert plan.local_block_ids == ((7, 8),) and plan.remote_block_ids == ((12, 13),)


def test_plan_is_made_once_whatever_the_call_order() -> None:
    s = ConsumerSchedule(BS)
    first = s.on_alloc("d1", params(), 60, [[1, 2, 3, 4]], 0, prompt(60))
    assert s.on_alloc("d1", params(), 0, [[5]], 60, prompt(60)) is None  # vLLM's second call after promotion
    assert s.matched_tokens("d1", params(), prompt(60), 0) == (0, False)  # preempted: recompute locally
    assert s.on_finished("d1", params(), prompt(60)) is None  # P is released by the pull itself
    assert s.take_plans() == [first]


def test_rejected_request_releases_p_at_finish() -> None:
    s = ConsumerSchedule(BS)
    plan = s.on_finished("d1", params(), prompt(60))
    assert plan is not None and not plan.awaiting and plan.local_block_ids == ()


def test_non_p2p_requests_are_ignored() -> None:
    s = ConsumerSchedule(BS)
    assert s.matched_tokens("d1", None, prompt(60), 0) == (0, False)
    malformed = s.on_alloc("d1", {"do_remote_prefill": True}, 10, [[1]], 0, prompt(60))  # fails, contacts no one
    assert malformed is not None and malformed.error and not malformed.contact_p
    assert s.on_finished("d2", {"do_remote_decode": True}, prompt(60)) is None


def test_incompatible_block_sizes_fail_the_plan_not_the_engine() -> None:
    s = ConsumerSchedule(24)
    plan = s.on_alloc("d1", params(), 60, [[1, 2, 3]], 0, prompt(60))
    assert plan is not None and plan.awaiting and "P uses 16, D uses 24" in plan.error


def test_larger_d_blocks_map_to_several_p_blocks() -> None:
    s = ConsumerSchedule(32)
    plan = s.on_alloc("d1", params(), 28, [[5]], 32, prompt(60))  # tokens 32..59 of P's 16-token blocks 12, 13
    assert plan is not None and not plan.error
    assert plan.remote_block_ids == ((12, 13),) and plan.remote_token_offset == 0


def test_smaller_d_blocks_start_inside_a_p_block() -> None:
    s = ConsumerSchedule(8)
    plan = s.on_alloc("d1", params(), 36, [[5, 6, 7, 8, 9]], 24, prompt(60))  # token 24 is token 8 of P's block 11
    assert plan is not None and not plan.error
    assert plan.remote_block_ids == ((11, 12, 13),) and plan.remote_token_offset == 8
