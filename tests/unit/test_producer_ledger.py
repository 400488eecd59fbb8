"""P-side lifecycle: holds, claims (leases), releases, expiry. Pure state machine, no I/O."""

from __future__ import annotations

import itertools

from vllm_kvp2p.lifecycle.producer import MAX_EARLY_RELEASES, HoldState, ProducerLedger
from vllm_kvp2p.protocol import MAX_TP_SIZE, ClaimStatus


def ledger(**kw) -> ProducerLedger:
    tokens = itertools.count(1)
    return ProducerLedger(hold_timeout=10.0, lease_timeout=4.0, token_factory=lambda: f"tok-{next(tokens)}", **kw)


def test_claim_then_release_frees_exactly_once() -> None:
    lg = ledger()
    lg.hold("r1", "h", now=0)
    reply = lg.claim("r1", "h", "d:0", 1, now=1)
    assert reply.status is ClaimStatus.GRANTED and reply.lease_token == "tok-1"
    assert lg.take_freed() == []
    lg.release("r1", "h", "d:0", 1, now=2, lease_token="tok-1")
    assert lg.take_freed() == ["r1"]
    lg.release("r1", "h", "d:0", 1, now=3, lease_token="tok-1")  # duplicate release: ignored, logged
    lg.expire(now=100)
    assert lg.take_freed() == []
    assert lg.state("r1") is HoldState.RELEASED
    assert any("ignored" in e.what for e in lg.take_events())


def test_unclaimed_hold_expires_after_hold_timeout() -> None:
    lg = ledger()
    lg.hold("r1", "h", now=0)
    lg.expire(now=9.9)
    assert lg.take_freed() == []
    lg.expire(now=10.0)
    assert lg.take_freed() == ["r1"]
    assert lg.state("r1") is HoldState.EXPIRED


def test_live_claim_survives_hold_timeout_and_renewal_extends_it() -> None:
    lg = ledger()
    lg.hold("r1", "h", now=0)
    token = lg.claim("r1", "h", "d:0", 1, now=8).lease_token  # lease until 12
    assert lg.renew("r1", "h", "d:0", now=9, lease_token=token).status is ClaimStatus.GRANTED  # lease until 13
    lg.expire(now=11)  # past the hold deadline, lease alive
    assert lg.take_freed() == []
    lg.expire(now=12.9)
    assert lg.take_freed() == []
    lg.expire(now=13.1)  # reader vanished: lease lapsed, nobody can be reading
    assert lg.take_freed() == ["r1"]
    assert lg.state("r1") is HoldState.EXPIRED


def test_late_claim_after_expiry_is_refused_never_granted() -> None:
    lg = ledger()
    lg.hold("r1", "h", now=0)
    lg.expire(now=10)
    reply = lg.claim("r1", "h", "d:0", 1, now=11)
    assert reply.status is ClaimStatus.REFUSED and "expired" in reply.reason


def test_claim_after_release_is_refused() -> None:
    lg = ledger()
    lg.hold("r1", "h", now=0)
    lg.release("r1", "h", "d:0", 1, now=1)
    assert lg.claim("r1", "h", "d:1", 1, now=2).status is ClaimStatus.REFUSED


def test_stale_hold_id_is_refused() -> None:
    lg = ledger()
    lg.hold("r1", "fresh", now=0)
    assert lg.claim("r1", "replayed", "d:0", 1, now=1).status is ClaimStatus.REFUSED
    lg.release("r1", "replayed", "d:0", 1, now=1)  # a stale release does not free the fresh hold
    assert lg.take_freed() == []


def test_claim_before_hold_is_unknown_then_granted() -> None:
    lg = ledger()
    assert lg.claim("r1", "h", "d:0", 1, now=0).status is ClaimStatus.UNKNOWN
    lg.hold("r1", "h", now=0.1)
    assert lg.claim("r1", "h", "d:0", 1, now=0.2).status is ClaimStatus.GRANTED


def test_release_before_hold_is_applied_when_hold_arrives() -> None:
    lg = ledger()
    lg.release("r1", "h", "d:0", 1, now=0)  # D had nothing to pull and was faster than P's scheduler step
    assert lg.take_freed() == []
    lg.hold("r1", "h", now=0.1)
    assert lg.take_freed() == ["r1"]


def test_early_release_is_forgotten_after_its_ttl() -> None:
    lg = ledger()  # early_release_ttl 10 s by default, here also hold_timeout
    lg.release("never-held", "h", "d:0", 1, now=0)
    lg.expire(now=11)
    lg.hold("never-held", "h", now=12)  # too late to match: the hold lives on its own deadline
    assert lg.take_freed() == []


def test_waits_for_every_expected_reader() -> None:
    lg = ledger()
    lg.hold("r1", "h", now=0)
    t0 = lg.claim("r1", "h", "d:0", 2, now=1).lease_token
    t1 = lg.claim("r1", "h", "d:1", 2, now=1).lease_token
    assert t0 != t1
    lg.release("r1", "h", "d:0", 2, now=2, lease_token=t0)
    assert lg.take_freed() == []
    lg.release("r1", "h", "d:1", 2, now=2, lease_token=t1)
    assert lg.take_freed() == ["r1"]


def test_the_same_hold_announced_twice_is_reported_once() -> None:
    lg = ledger()
    lg.hold("r1", "h", now=0)
    lg.hold("r1", "h", now=1)
    lg.release("r1", "h", "d:0", 1, now=2)
    assert lg.take_freed() == ["r1"]
    lg.expire(now=1000)
    assert lg.take_freed() == []


def test_a_request_id_that_comes_back_gets_a_hold_of_its_own() -> None:
    """Before, a second hold for an id still live or recently finished was ignored after vLLM had already
    delayed its free: those blocks were never reported, so never freed. Every delayed free is now reported once."""
    lg = ledger()
    lg.hold("r1", "h1", now=0)
    lg.release("r1", "h1", "d:0", 1, now=1)
    assert lg.take_freed() == ["r1"]
    lg.hold("r1", "h2", now=2)  # the id comes back (reused by a client, or a suffix collision)
    lg.hold("r1", "h3", now=2)  # and once more while h2 is live
    assert lg.claim("r1", "h1", "d:0", 1, now=3).status is ClaimStatus.REFUSED  # the old params stay fenced off
    t2 = lg.claim("r1", "h2", "d:0", 1, now=3).lease_token
    lg.release("r1", "h2", "d:0", 1, now=4, lease_token=t2)
    assert lg.take_freed() == ["r1"]  # h2
    lg.expire(now=2 + 10 + 0.001)  # h3 was never claimed: its hold timeout
    assert lg.take_freed() == ["r1"]
    lg.expire(now=1000)
    assert lg.take_freed() == [] and lg.active == 0


def test_expiry_looks_only_at_what_is_due() -> None:
    """Before, every engine step scanned every hold under the lock the side channel needs. Now expire() looks at
    the holds whose deadline has come: with 100,000 held, a step where nothing is due looks at none."""
    lg = ProducerLedger(hold_timeout=100.0, lease_timeout=30.0)
    for i in range(100_000):
        lg.hold(f"r{i}", "h", now=i / 1000)  # created over 100 s
    looked: list[str] = []
    original = lg._expire_one
    lg._expire_one = lambda hold, now: (looked.append(hold.request_id), original(hold, now))  # type: ignore
    lg.expire(now=50.0)
    assert looked == [] and lg.take_freed() == []
    lg.expire(now=100.0 + 0.0995)  # the first hundred are due
    assert len(looked) == 100 and len(lg.take_freed()) == 100
    assert lg.active == 99_900


# --------------------------------------------------------------------------- bounds (issue 11 part 4)
# Each test below replays an attack on the unauthenticated side channel; the comment says what it did before.


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
    assert lg._holds[("r1", "h")].leases == {"d:0": 5.0}
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


def test_two_holds_of_one_id_ending_together_reach_vllm_in_two_steps() -> None:
    """vLLM takes finished ids as a set: the hold service reports the second at the next call."""
    from vllm_kvp2p.hold_service import HoldService
    from vllm_kvp2p.protocol import RankRegistration
    from vllm_kvp2p.testing.server import free_port
    from vllm_kvp2p.transfer.descriptors import PlaneGeometry
    from vllm_kvp2p.transfer.slicing import BlockShape

    reg = RankRegistration("P", 0, 1, "127.0.0.1:1", [PlaneGeometry(1 << 30, 512, 512, 100)],
                           [BlockShape(True, 2, 16, 16)], ["l0"], 16, 100, "float32", 2, 2, 8)
    now = [0.0]
    service = HoldService(reg, "127.0.0.1", free_port(), hold_timeout=10, lease_timeout=4, clock=lambda: now[0])
    try:
        service.hold("r1", "h1")
        service.hold("r1", "h2")
        service.hold("r2", "h1")
        now[0] = 11.0
        assert service.take_freed() == {"r1", "r2"}
        assert service.take_freed() == {"r1"}
        assert service.take_freed() == set()
    finally:
        service.close()


def test_p_confirms_a_read_only_when_the_lease_held_from_claim_to_release() -> None:
    """Fencing through the end of the read: the release's answer says whether the lease held. A read that
    outlived its lease may have read blocks P freed and reused; before, D counted it as good all the same."""
    lg = ledger()  # lease 4 s
    lg.hold("ok", "h", now=0)
    t = lg.claim("ok", "h", "d:0", 1, now=1).lease_token
    assert lg.release("ok", "h", "d:0", 1, now=4.9, lease_token=t, pulled=True) is True
    assert lg.release("ok", "h", "d:0", 1, now=5.0, lease_token=t, pulled=True) is True  # resent: same answer

    lg.hold("slow", "h", now=0)
    t = lg.claim("slow", "h", "d:0", 1, now=1).lease_token
    assert lg.release("slow", "h", "d:0", 1, now=5.5, lease_token=t, pulled=True) is False  # lapsed, not expired
    lg.hold("gone", "h", now=0)
    t = lg.claim("gone", "h", "d:0", 1, now=1).lease_token
    lg.expire(now=6)  # the lease lapsed and P freed the blocks (they may be another request's now)
    assert "gone" in lg.take_freed()
    assert lg.release("gone", "h", "d:0", 1, now=7, lease_token=t, pulled=True) is False
    # Nothing to confirm for a reader that read nothing; a pulled release for a hold P never had is not confirmed.
    assert lg.release("never", "h", "d:1", 1, now=7, pulled=False) is True
    assert lg.release("never2", "h", "d:1", 1, now=7, pulled=True) is False
