"""One hold, several requests (vLLM's n > 1 children): D's reader/follower parts, each decided once per request and
kept in its one record, the ended holds late children still name, and P's sibling offers. Pure."""

from __future__ import annotations

import msgspec

from tests.support.prompts import prompt, remote
from vllm_kvp2p.lifecycle.consumer import MAX_REQUESTS, ConsumerSchedule, Failure
from vllm_kvp2p.lifecycle.shared_holds import MAX_ENDED_HOLDS, Role, SharedHolds
from vllm_kvp2p.lifecycle.sibling_offers import SiblingOffers, parent_of

BS = 16
LIFETIME = 150.0  # hold_timeout + clock_skew at their defaults
KIDS = [f"{i}_cmpl-p-0-1a2b3c4d" for i in range(3)]  # vLLM's ids of a parent's children


def params(hold: str = "h1") -> dict:
    return {**remote([[10, 11, 12, 13]], 60, BS).to_params(), "remote_hold_id": hold}


def read(s: ConsumerSchedule, request_id: str, hold: str = "h1", now: float = 0.0) -> None:
    """``request_id`` reads ``hold``: its admission, its plan, its pull landed."""
    assert s.matched_tokens(request_id, params(hold), prompt(60), 0, now=now) == (60, True)
    plan = s.on_alloc(request_id, params(hold), 60, [[1, 2, 3, 4]], 0, prompt(60), now=now)
    assert plan is not None and plan.awaiting and plan.contact_p
    s.on_scheduled([request_id])


def follows(s: ConsumerSchedule, request_id: str, hold: str = "h1", now: float = 0.0) -> bool:
    """Whether ``request_id`` is admitted with nothing to load and ends with no plan (no claim, no release)."""
    matched = s.matched_tokens(request_id, params(hold), prompt(60), 48, now=now)
    planned = s.on_alloc(request_id, params(hold), 0, [], 48, prompt(60), now=now)
    ended = s.on_finished(request_id, params(hold), prompt(60), now=now)
    return matched == (0, False) and planned is None and ended is None


def test_followers_wait_for_the_reader_then_take_the_prefix_cache() -> None:
    s = ConsumerSchedule(BS)
    assert s.matched_tokens(KIDS[0], params(), prompt(60), 0) == (60, True)
    plan = s.on_alloc(KIDS[0], params(), 60, [[1, 2, 3, 4]], 0, prompt(60))
    assert plan is not None and plan.awaiting
    for child in KIDS[1:]:
        assert s.matched_tokens(child, params(), prompt(60), 0) == (None, False)  # not yet: the pull is in flight
    s.on_scheduled([KIDS[0]])  # the reader runs: its blocks are D's prefix cache
    assert s.matched_tokens(KIDS[1], params(), prompt(60), 48) == (0, False)
    assert s.on_alloc(KIDS[1], params(), 0, [], 48, prompt(60)) is None  # no plan: nothing to read, nothing to release
    assert s.on_finished(KIDS[1], params(), prompt(60)) is None
    assert s.on_finished(KIDS[2], params(), prompt(60)) is None  # aborted while it waited: no release either
    assert s.take_plans() == [plan]
    assert s.on_finished(KIDS[0], params(), prompt(60)) is None
    assert len(s) == 0 and len(s.shared) == 0


def test_other_holds_and_other_prompts_go_their_own_way() -> None:
    s = ConsumerSchedule(BS)
    s.matched_tokens("a", params("h1"), prompt(60), 0)
    s.on_alloc("a", params("h1"), 60, [[1, 2, 3, 4]], 0, prompt(60))
    assert s.matched_tokens("b", params("h2"), prompt(60), 0) == (60, True)
    # The same hold named for another prompt (a forgery, or its victim): not held back, P decides the claim.
    other = {**remote([[10, 11, 12, 13]], 60, BS, seed=3).to_params(), "remote_hold_id": "h1"}
    assert s.matched_tokens("c", other, prompt(60, seed=3), 0) == (60, True)


def test_the_first_requests_to_ask_is_the_reader_whoever_is_allocated_first() -> None:
    """The part is decided at the first question, not at the first plan: a follower never plans, even if vLLM
    allocates it before its reader (it asked for nothing to load)."""
    s = ConsumerSchedule(BS)
    assert s.matched_tokens(KIDS[0], params(), prompt(60), 0) == (60, True)
    assert s.matched_tokens(KIDS[1], params(), prompt(60), 0) == (None, False)
    assert s.on_alloc(KIDS[1], params(), 0, [], 0, prompt(60)) is None
    assert s.on_alloc(KIDS[0], params(), 60, [[1, 2, 3, 4]], 0, prompt(60)) is not None


def test_a_child_first_asked_after_its_reader_ended_follows_for_the_params_lifetime() -> None:
    """vLLM adds children one at a time: one queued behind a request that does not fit is first asked after the
    reader ended and released P. It follows; a claim would be refused (the hold is gone)."""
    s = ConsumerSchedule(BS, hold_lifetime=LIFETIME)
    read(s, KIDS[0], now=10.0)
    assert s.on_finished(KIDS[0], params(), prompt(60), now=20.0) is None
    assert len(s.shared) == 0 and s.shared.remembered == 1
    assert follows(s, KIDS[1], now=20.0 + LIFETIME - 0.001)
    # Past the lifetime the params can no longer be used (with the secret D refuses them as expired; without it
    # P's hold timed out): the hold is forgotten, and a request naming it again is judged as any other.
    assert s.matched_tokens(KIDS[2], params(), prompt(60), 0, now=20.0 + LIFETIME) == (60, True)
    assert s.shared.remembered == 0


def test_a_hold_read_by_a_lone_request_is_forgotten_at_its_end() -> None:
    """Only vLLM's n > 1 children have late siblings; a second request naming a lone request's ended hold is a
    replay, whose claim P refuses as it should."""
    s = ConsumerSchedule(BS)
    read(s, "cmpl-lone-0-1a2b3c4d")
    s.on_finished("cmpl-lone-0-1a2b3c4d", params(), prompt(60), now=1.0)
    assert s.shared.remembered == 0
    assert s.matched_tokens("replay", params(), prompt(60), 0, now=1.0) == (60, True)


def test_a_reader_aborted_before_it_was_asked_releases_p_and_its_siblings_follow() -> None:
    """The first child ends before vLLM asked about it (aborted while waiting): it is the reader then, releases P,
    and the hold is remembered, so the later children do not claim what it released."""
    s = ConsumerSchedule(BS)
    release = s.on_finished(KIDS[0], params(), prompt(60), now=1.0)
    assert release is not None and release.contact_p and release.num_blocks == 0
    assert follows(s, KIDS[1], now=2.0)


def test_on_finished_forgets_a_request_whatever_its_verdict_is_now() -> None:
    """With the secret a verdict depends on the clock (params expire). The one made at the first question stands:
    a follower that ends (or is asked again after a preemption) past the expiry keeps its part, contacts no one,
    and is forgotten; the signature is checked once per request."""
    clock = {"expired": False}
    calls: list[str] = []

    def authenticate(r: object) -> str:
        calls.append("x")
        return "kv_transfer_params expired 60.0 s ago" if clock["expired"] else ""

    s = ConsumerSchedule(BS, authenticate=authenticate)
    read(s, KIDS[0])
    assert s.matched_tokens(KIDS[1], params(), prompt(60), 48) == (0, False)
    assert s.on_alloc(KIDS[1], params(), 0, [], 48, prompt(60)) is None
    clock["expired"] = True
    for _ in range(3):  # preempted and asked again: still a follower, nothing to load
        assert s.matched_tokens(KIDS[1], params(), prompt(60), 0) == (0, False)
    assert s.on_alloc(KIDS[1], params(), 0, [], 32, prompt(60)) is None
    assert s.on_finished(KIDS[1], params(), prompt(60)) is None
    assert s.on_finished(KIDS[0], params(), prompt(60)) is None
    assert len(s) == 0 and len(s.shared) == 0
    assert len(calls) == 2  # one verdict per request
    # The control: a request first asked now is judged now, and refused.
    assert s.matched_tokens("cmpl-late-0-1a2b3c4d", params("h2"), prompt(60), 0) == (59, True)


def test_a_failed_hook_fails_a_follower_without_contacting_p() -> None:
    s = ConsumerSchedule(BS)
    read(s, KIDS[0])
    assert s.matched_tokens(KIDS[1], params(), prompt(60), 0) == (0, False)
    s.fail(KIDS[1], "internal error in get_num_new_matched_tokens: KeyError")
    assert s.matched_tokens(KIDS[1], params(), prompt(60), 0) == (59, True)
    plan = s.on_alloc(KIDS[1], params(), 59, [[5, 6, 7, 8]], 0, prompt(60))
    assert plan is not None and plan.failure is Failure.INTERNAL and not plan.contact_p
    assert s.on_finished(KIDS[1], params(), prompt(60)) is None


def test_at_the_bound_an_unknown_hold_is_computed_by_a_child_never_claimed() -> None:
    """More ended holds than the table keeps: the oldest is forgotten early. Until its lifetime is over, a child
    naming a hold D does not know might be its late child: it computes its prompt and contacts no P (a claim
    would be refused, failing it). Any other request still reads; after that lifetime, children read again."""
    s = ConsumerSchedule(BS, hold_lifetime=LIFETIME)
    s.shared = SharedHolds(LIFETIME, max_ended=2)
    for i, hold in enumerate(("h1", "h2", "h3")):
        read(s, f"0_parent{i}", hold, now=float(i))
        s.on_finished(f"0_parent{i}", params(hold), prompt(60), now=float(i))
    assert s.shared.remembered == 2 and s.shared.forgotten_early == 1  # h1 went at t = 2, LIFETIME early
    late = "1_parent0"  # h1's late child
    assert s.matched_tokens(late, params("h1"), prompt(60), 0, now=3.0) == (0, False)
    assert s.on_alloc(late, params("h1"), 0, [], 0, prompt(60), now=3.0) is None
    assert s.on_finished(late, params("h1"), prompt(60), now=3.0) is None
    assert s.matched_tokens("0_new-parent", params("h4"), prompt(60), 0, now=3.0) == (0, False)  # cannot tell
    assert s.matched_tokens("cmpl-lone", params("h5"), prompt(60), 0, now=3.0) == (60, True)  # no sibling: reads
    assert s.matched_tokens("0_later-parent", params("h6"), prompt(60), 0, now=LIFETIME) == (60, True)


def test_shared_holds_bound_and_lifetime() -> None:
    holds = SharedHolds(LIFETIME, max_ended=MAX_ENDED_HOLDS)
    base = remote([[10]], 10, BS)
    for i in range(MAX_ENDED_HOLDS + 1):
        role, use = holds.join(f"0_p{i}", msgspec.structs.replace(base, remote_hold_id=f"h{i}"), now=0.0)
        assert role is Role.READER and use is not None
        holds.on_reader_finished(use, now=0.0)
    assert holds.remembered == MAX_ENDED_HOLDS and holds.forgotten_early == 1 and len(holds) == 0
    first = msgspec.structs.replace(base, remote_hold_id="h0")
    assert holds.join("1_p0", first, now=1.0)[0] is Role.LOCAL  # forgotten early: not made a reader
    assert holds.join("1_p1", msgspec.structs.replace(base, remote_hold_id="h1"), now=1.0)[0] is Role.FOLLOWER
    assert holds.join("1_p0", first, now=LIFETIME)[0] is Role.READER  # its params' lifetime is over
    assert holds.remembered == 0


def test_requests_past_the_bound_are_left_to_vllm() -> None:
    """More requests than the record's bound (a bug: vLLM finishes every request it asked about): a new one is
    computed by vLLM and contacts no P until its end, which decides as an admission would."""
    s = ConsumerSchedule(BS)
    for i in range(MAX_REQUESTS):
        s.fail(f"r{i}", "filler")
    assert s.matched_tokens(KIDS[0], params(), prompt(60), 0) == (0, False)
    assert s.on_alloc(KIDS[0], params(), 0, [], 0, prompt(60)) is None
    release = s.on_finished(KIDS[0], params(), prompt(60))
    assert release is not None and release.contact_p  # it was the hold's only request: P is released
    assert follows(s, KIDS[1])  # and its siblings do not claim what it released


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


def test_a_reader_ending_twice_is_told_once() -> None:
    """A request id that comes back (VLLM_DISABLE_REQUEST_ID_RANDOMIZATION, a client's own ids) may end the same
    hold's reader twice: the hold is remembered once and forgotten once, without a KeyError at its end."""
    holds = SharedHolds(lifetime=10.0)
    one = msgspec.convert(params("h"), type=type(remote([[1]], 16, BS)))
    other = msgspec.convert(params("x"), type=type(one))
    role, use = holds.join(KIDS[0], one, now=0.0)
    assert role is Role.READER and use is not None
    holds.on_reader_finished(use, now=1.0)
    holds.on_reader_finished(use, now=2.0)
    assert holds.remembered == 1
    holds.join(KIDS[1], other, now=20.0)  # forgets the ended hold: once, no KeyError
    assert holds.remembered == 0
