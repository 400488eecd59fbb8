"""One hold, several requests (vLLM's n > 1 children): D's reader/follower record and P's sibling offers. Pure."""

from __future__ import annotations

import msgspec

from tests.support.prompts import prompt, remote
from vllm_kvp2p.lifecycle.consumer import ConsumerSchedule
from vllm_kvp2p.lifecycle.shared_holds import MAX_HOLDS_IN_USE, Role, SharedHolds
from vllm_kvp2p.lifecycle.sibling_offers import SiblingOffers, parent_of

BS = 16


def params(hold: str = "h1") -> dict:
    return {**remote([[10, 11, 12, 13]], 60, BS).to_params(), "remote_hold_id": hold}


def test_followers_wait_for_the_reader_then_take_the_prefix_cache() -> None:
    s = ConsumerSchedule(BS)
    assert s.matched_tokens("0_p", params(), prompt(60), 0) == (60, True)
    plan = s.on_alloc("0_p", params(), 60, [[1, 2, 3, 4]], 0, prompt(60))
    assert plan is not None and plan.awaiting
    for child in ("1_p", "2_p"):
        assert s.matched_tokens(child, params(), prompt(60), 0) == (None, False)  # not yet: the pull is in flight
    s.on_scheduled(["0_p"])  # the reader runs: its blocks are D's prefix cache
    assert s.matched_tokens("1_p", params(), prompt(60), 48) == (0, False)
    assert s.on_alloc("1_p", params(), 0, [], 48, prompt(60)) is None  # no plan: nothing to read, nothing to release
    assert s.on_finished("1_p", params(), prompt(60)) is None
    assert s.on_finished("2_p", params(), prompt(60)) is None  # aborted while it waited: no release either
    assert s.take_plans() == [plan]
    assert s.on_finished("0_p", params(), prompt(60)) is None
    assert len(s.shared) == 0


def test_other_holds_and_other_prompts_go_their_own_way() -> None:
    s = ConsumerSchedule(BS)
    s.on_alloc("a", params("h1"), 60, [[1, 2, 3, 4]], 0, prompt(60))
    assert s.matched_tokens("b", params("h2"), prompt(60), 0) == (60, True)
    # The same hold named for another prompt (a forgery, or its victim): not held back, P decides the claim.
    other = {**remote([[10, 11, 12, 13]], 60, BS, seed=3).to_params(), "remote_hold_id": "h1"}
    assert s.matched_tokens("c", other, prompt(60, seed=3), 0) == (60, True)


def test_a_reader_that_finishes_before_its_followers_leaves_the_record_to_them() -> None:
    holds = SharedHolds()
    r = remote([[10]], 10, BS)
    holds.on_planned("reader", r)
    assert holds.role("f", r) is Role.WAIT
    holds.on_followed("f", r)
    holds.on_finished("reader", None)
    assert holds.role("f", r) is Role.FOLLOW  # not READER: the hold is released, claiming it would fail
    holds.on_finished("f", r)
    assert len(holds) == 0
    assert holds.role("late", r) is Role.READER  # the record ended with its last user


def test_the_record_is_bounded() -> None:
    holds = SharedHolds()
    base = remote([[10]], 10, BS)
    for i in range(MAX_HOLDS_IN_USE + 10):
        holds.on_planned(f"r{i}", msgspec.structs.replace(base, remote_hold_id=f"h{i}"))
    assert len(holds) == MAX_HOLDS_IN_USE


def test_parent_of_reads_only_vllm_child_ids() -> None:
    assert parent_of("0_cmpl-x-0-1a2b3c4d") == "cmpl-x-0-1a2b3c4d"
    assert parent_of("12_a_b") == "a_b"
    for plain in ("cmpl-x-0-1a2b3c4d", "_x", "x_1", "1234567890_x", "1_", "-1_x"):
        assert parent_of(plain) is None, plain


def test_siblings_share_only_the_same_tokens() -> None:
    offers = SiblingOffers(capacity=2)
    assert offers.shared("0_p", 40, "d") is None
    offers.remember("0_p", 40, "d", {"remote_hold_id": "h"})
    assert offers.shared("1_p", 40, "d") == {"remote_hold_id": "h"}
    assert offers.shared("1_p", 41, "d") is None and offers.shared("1_p", 40, "e") is None
    assert offers.shared("1_q", 40, "d") is None and offers.shared("p", 40, "d") is None
    offers.remember("plain", 40, "d", {"remote_hold_id": "x"})  # not a child: not remembered
    offers.remember("0_q", 1, "d", {})
    offers.remember("0_r", 1, "d", {})
    assert offers.shared("1_p", 40, "d") is None  # forgotten: the oldest parent beyond the capacity
