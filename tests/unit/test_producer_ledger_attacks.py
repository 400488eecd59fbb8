"""P's ledger under attack on its unauthenticated side channel (issue 11 part 4): each test replays an attack and
says in a comment what it did before. Early releases bounded and short-lived, no hold pinned past its hard
deadline (hold_timeout + lease_timeout) however often it is renewed, expected readers and id lengths capped, a
release or a second claim without the lease's token or claim id ignored, holds beyond max_holds kept and reported.
Pure state machine, no I/O."""

from __future__ import annotations

import itertools

from tests.unit.producer_ledgers import ledger
from vllm_kvp2p.contract.protocol import MAX_TP_SIZE, ClaimStatus
from vllm_kvp2p.lifecycle.producer import MAX_EARLY_RELEASES, HoldState, ProducerLedger


def test_early_releases_are_bounded_and_expire_quickly() -> None:
    # Before: every Release for an unknown request stayed hold_timeout (120 s): 100,000 releases, 100,000 entries.
    lg = ProducerLedger(hold_timeout=120.0, lease_timeout=30.0)
    assert lg.early_release_ttl == 10.0
    lg.release("real", "h", "d:0", 1, now=0)  # a genuine early release, before the flood
    for i in range(100_000):
        lg.release(f"forged-{i}", "h", "x:0", 1, now=1 + i * 1e-5)
    assert lg.table_sizes()["early_releases"] == MAX_EARLY_RELEASES
    assert lg.counters["early_release_table_full"] == 100_000 - (MAX_EARLY_RELEASES - 1)
    events = lg.take_events()
    assert events and {e.reason for e in events} == {"early_release_table_full"}
    lg.hold("real", "h", now=2)  # the genuine one is still applied
    assert lg.take_freed() == ["real"]
    lg.expire(now=12)  # the flood is gone after early_release_ttl, not hold_timeout
    assert lg.table_sizes()["early_releases"] == 0
    lg.release("late", "h", "d:0", 1, now=12)
    assert lg.table_sizes()["early_releases"] == 1


def test_full_early_table_makes_room_from_expired_entries() -> None:
    lg = ledger(max_early_releases=2, early_release_ttl=1.0)
    lg.release("a", "h", "d:0", 1, now=0)
    lg.release("b", "h", "d:0", 1, now=0.5)
    lg.release("c", "h", "d:0", 1, now=0.6)  # full: refused, counted
    assert lg.counters["early_release_table_full"] == 1
    lg.release("a", "h", "d:1", 2, now=0.7)  # an entry already there is updated (and lives on from now)
    lg.release("d", "h", "d:0", 1, now=1.6)  # "b" has expired: its slot is reused without waiting for expire()
    assert lg.table_sizes()["early_releases"] == 2 and lg.counters["early_release_table_full"] == 1
    lg.hold("c", "h", now=1.7)  # refused earlier: the hold lives on its own deadline
    lg.hold("a", "h", now=1.7)  # both readers of "a" released before the hold
    lg.hold("d", "h", now=1.7)
    assert sorted(lg.take_freed()) == ["a", "d"]


def test_early_release_ttl_never_exceeds_hold_timeout() -> None:
    assert ProducerLedger(hold_timeout=5.0, lease_timeout=1.0, early_release_ttl=60.0).early_release_ttl == 5.0
    lg = ledger(early_release_ttl=2.0)
    lg.release("r1", "h", "d:0", 1, now=0)
    lg.expire(now=2.0)
    lg.hold("r1", "h", now=2.1)
    assert lg.take_freed() == []


def test_renewing_every_second_forever_stops_at_the_hard_deadline() -> None:
    # Before: each renewal granted lease_timeout more, so one reader pinned the blocks for as long as it liked.
    lg = ledger()  # hold 10 s + lease 4 s: no hold is pinned past created + 14 s
    lg.hold("r1", "h", now=0)
    claim = lg.claim("r1", "h", "d:0", 10**9, now=1.5)
    assert claim.status is ClaimStatus.GRANTED and claim.lease == 4.0
    replies = {}
    for t in itertools.count(2.5):
        if t > 1000:
            break
        lg.expire(now=t)
        replies[t] = lg.renew("r1", "h", "d:0", now=t, lease_token=claim.lease_token)
    granted = [t for t, r in replies.items() if r.status is ClaimStatus.GRANTED]
    assert granted == [2.5 + i for i in range(9)]  # up to 10.5
    assert replies[9.5].lease == 4.0 and replies[10.5].lease == 3.5  # the real time left, to created + 14
    assert replies[11.5].status is ClaimStatus.REFUSED and "pinned" in replies[11.5].reason
    assert lg.state("r1") is HoldState.EXPIRED  # freed at 14, not at 1000
    assert lg.counters["renew_past_deadline"] >= 1 and lg.counters["hold_capped"] == 1
    assert lg.counters["expected_readers_capped"] == 1
    assert lg.take_freed() == ["r1"]


def test_expire_frees_at_the_hard_deadline_exactly() -> None:
    lg = ledger()
    lg.hold("r1", "h", now=0)
    token = lg.claim("r1", "h", "d:0", 1, now=9).lease_token
    assert lg.renew("r1", "h", "d:0", now=12, lease_token=token).lease == 2.0  # cut to 14
    lg.expire(now=13.99)
    assert lg.take_freed() == []
    lg.expire(now=14)
    assert lg.take_freed() == ["r1"]
    assert any(e.reason == "hold_capped" for e in lg.take_events())
    late = ledger()
    late.hold("r2", "h", now=0)
    assert late.claim("r2", "h", "d:0", 1, now=14).status is ClaimStatus.REFUSED  # before expire() ran: refused


def test_huge_expected_readers_is_capped() -> None:
    # Before: expected_readers=10**9 in a claim kept the hold after the real reader released, up to hold_timeout
    # or, renewed, for ever. Now: capped at MAX_TP_SIZE (counted), and the hard deadline still holds.
    lg = ledger()
    lg.hold("r1", "h", now=0)
    lg.claim("r1", "h", "d:0", 10**9, now=1)
    lg.release("r1", "h", "x:0", -5, now=1)  # negative: as 1
    assert lg.counters["expected_readers_capped"] == 1
    assert lg._holds[("r1", "h")].expected_readers == MAX_TP_SIZE
    lg.expire(now=14)
    assert lg.take_freed() == ["r1"]


def test_forged_release_without_the_token_leaves_the_lease_and_the_hold() -> None:
    # Before: a Release naming the real reader dropped its lease, and P freed blocks D was still reading.
    lg = ledger()
    lg.hold("r1", "h", now=0)
    token = lg.claim("r1", "h", "d:0", 1, now=1).lease_token
    lg.release("r1", "h", "d:0", 1, now=2)  # forged: no token
    lg.release("r1", "h", "d:0", 1, now=2, lease_token="tok-guess")  # forged: wrong token
    assert lg.take_freed() == [] and lg.state("r1") is HoldState.CLAIMED
    assert {r: lease.until for r, lease in lg._holds[("r1", "h")].leases.items()} == {"d:0": 5.0}
    assert lg.counters["release_without_token"] == 2
    assert [e.reason for e in lg.take_events()] == ["release_without_token"] * 2
    forged_renew = lg.renew("r1", "h", "d:0", now=2, lease_token="")
    assert forged_renew.status is ClaimStatus.REFUSED and lg.counters["renew_refused"] == 1
    assert lg.renew("r1", "h", "d:0", now=3, lease_token=token).status is ClaimStatus.GRANTED
    lg.release("r1", "h", "d:0", 1, now=4, lease_token=token)  # the genuine one frees
    assert lg.take_freed() == ["r1"] and lg.state("r1") is HoldState.RELEASED


def test_second_claim_by_a_reader_with_a_live_lease_is_refused() -> None:
    # Re-issuing the token (or a new one) would let anyone who names the reader release its lease.
    lg = ledger()
    lg.hold("r1", "h", now=0)
    token = lg.claim("r1", "h", "d:0", 1, now=1).lease_token
    again = lg.claim("r1", "h", "d:0", 1, now=1.1)
    assert again.status is ClaimStatus.REFUSED and again.lease_token == ""
    assert lg.counters["claim_refused_live_lease"] == 1
    assert lg.renew("r1", "h", "d:0", now=2, lease_token=token).status is ClaimStatus.GRANTED  # the first stands
    lg.release("r1", "h", "d:0", 1, now=3, lease_token=token)
    assert lg.take_freed() == ["r1"]


def test_reader_without_a_lease_releases_without_a_token() -> None:
    lg = ledger()  # D rank 1 only notifies this P rank (the TP mapping gives it nothing to read here)
    lg.hold("r1", "h", now=0)
    token = lg.claim("r1", "h", "d:0", 2, now=1).lease_token
    lg.release("r1", "h", "d:1", 2, now=2)
    assert lg.take_freed() == []
    lg.release("r1", "h", "d:0", 2, now=3, lease_token=token)
    assert lg.take_freed() == ["r1"]


def test_holds_beyond_max_holds_are_kept_and_reported() -> None:
    lg = ledger(max_holds=3)
    for i in range(5):
        lg.hold(f"r{i}", "h", now=0)
    assert lg.active == 5  # vLLM already delayed the free: never dropped
    assert lg.counters["holds_over_limit"] == 2
    assert [e.reason for e in lg.take_events()] == ["holds_over_limit"] * 2
    lg.expire(now=10)
    assert sorted(lg.take_freed()) == [f"r{i}" for i in range(5)]


def test_readers_per_hold_and_id_lengths_are_bounded() -> None:
    lg = ledger()
    lg.hold("r1", "h", now=0)
    granted = sum(lg.claim("r1", "h", f"x:{i}", 1, now=1).status is ClaimStatus.GRANTED for i in range(3000))
    assert granted == MAX_TP_SIZE and lg.table_sizes()["readers_per_hold"] == MAX_TP_SIZE
    for i in range(3000):
        lg.release("r1", "h", f"y:{i}", 1, now=1)
    assert lg.table_sizes()["readers_per_hold"] == MAX_TP_SIZE
    assert lg.counters["readers_per_hold_full"] == (3000 - MAX_TP_SIZE) + 3000
    huge = "x" * 10**6
    lg.release(huge, "h", "d:0", 1, now=1)
    lg.release("r2", huge, "d:0", 1, now=1)
    lg.release("r2", "h", huge, 1, now=1)
    assert lg.claim(huge, "h", "d:0", 1, now=1).status is ClaimStatus.REFUSED
    assert lg.renew("r1", "h", huge, now=1).status is ClaimStatus.REFUSED
    assert lg.table_sizes()["early_releases"] == 0 and lg.counters["id_too_long"] == 5
    assert all(len(e.request_id) <= 256 and len(e.what) < 1000 for e in lg.take_events())


def test_a_claim_resent_after_a_lost_reply_gets_the_same_lease_back() -> None:
    """The side-channel client resends a claim whose reply did not arrive; P granted the first. The same claim id
    (random per pull, known only to D and P) gets the same token; anyone else naming the reader does not."""
    ledger = ProducerLedger(hold_timeout=10, lease_timeout=5)
    ledger.hold("r", "h", 0.0)
    first = ledger.claim("r", "h", "d:0", 1, 1.0, claim_id="c1")
    again = ledger.claim("r", "h", "d:0", 1, 2.0, claim_id="c1")
    assert again.status is ClaimStatus.GRANTED and again.lease_token == first.lease_token
    other = ledger.claim("r", "h", "d:0", 1, 2.0, claim_id="guess")
    assert other.status is ClaimStatus.REFUSED and not other.lease_token
    assert ledger.claim("r", "h", "d:0", 1, 2.0).status is ClaimStatus.REFUSED  # no claim id: refused as before
