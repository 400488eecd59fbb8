"""P-side lifecycle: holds, claims (leases), releases, expiry. Pure state machine, no I/O."""

from __future__ import annotations

import heapq
import itertools

import pytest

from vllm_kvp2p.contract.protocol import MAX_TP_SIZE, ClaimStatus
from vllm_kvp2p.lifecycle.producer import MAX_EARLY_RELEASES, STALE_SLACK, HoldState, ProducerLedger
from vllm_kvp2p.transfer.descriptors import PlaneGeometry


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


def test_two_holds_of_one_id_ending_together_reach_vllm_in_two_steps() -> None:
    """vLLM takes finished ids as a set: the hold service reports the second at the next call."""
    from vllm_kvp2p.contract.protocol import RankRegistration
    from vllm_kvp2p.prefill.hold_service import HoldService
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


# --------------------------------------------------------------------------- the heap of deadlines, bounded by holds
# Before, every release that left a hold live, every renewal and every resent claim pushed a heap entry, and stale
# entries left only when due: 200,000 messages from one peer on its own hold, 200,000 entries (30 MiB), and one
# expire() after 1,000,000 of them took seconds under the hold service's lock. PushedEveryTime replays that rule
# next to the real ledger, on the same messages, so each test shows the old heap growing while the new one stays
# within 2 x live holds + STALE_SLACK.


class PushedEveryTime(ProducerLedger):
    """The ledger, plus ``old_heap``: the deadlines the old rule pushed (one per grant, renewal, and release that
    left its hold live), each gone only once due."""

    def __init__(self, **kw) -> None:
        tokens = itertools.count(1)
        super().__init__(hold_timeout=10.0, lease_timeout=4.0, token_factory=lambda: f"tok-{next(tokens)}", **kw)
        self.old_heap: list[float] = []

    def claim(self, request_id, hold_id, reader, expected_readers, now, claim_id="", **kw):  # type: ignore[override]
        reply = super().claim(request_id, hold_id, reader, expected_readers, now, claim_id, **kw)
        if reply.status is ClaimStatus.GRANTED:
            heapq.heappush(self.old_heap, now + reply.lease)
        return reply

    def renew(self, request_id, hold_id, reader, now, lease_token=""):  # type: ignore[override]
        reply = super().renew(request_id, hold_id, reader, now, lease_token)
        if reply.status is ClaimStatus.GRANTED:
            heapq.heappush(self.old_heap, now + reply.lease)
        return reply

    def release(self, request_id, hold_id, reader, expected_readers, now, lease_token="", pulled=False):  # type: ignore[override]
        held = super().release(request_id, hold_id, reader, expected_readers, now, lease_token, pulled)
        hold = self._holds.get((request_id, hold_id))
        if hold is not None and not hold.leases:
            heapq.heappush(self.old_heap, hold.hold_deadline)
        return held

    def expire(self, now: float) -> None:
        super().expire(now)
        while self.old_heap and self.old_heap[0] <= now:
            heapq.heappop(self.old_heap)

    def heap_bound(self) -> int:
        return 2 * self.active + STALE_SLACK


def hostile_stream(lg: PushedEveryTime, kind: str, holds: int, messages: int) -> None:
    """``messages`` of one kind spread over ``holds`` holds (each with a peer's reader "x:0"), 1e-5 s apart from
    t=1, with an engine step's expire() every 100 messages; the heap checked against its bound as it goes."""
    ids = [f"r{i}" for i in range(holds)]
    tokens = {}
    for rid in ids:
        lg.hold(rid, "h", now=0)
        if kind in ("renew", "resent claim"):
            tokens[rid] = lg.claim(rid, "h", "x:0", 1, now=1, claim_id=f"c-{rid}").lease_token
    for i in range(messages):
        rid, now = ids[i % holds], 1 + i * 1e-5
        if kind == "release":  # a reader with no lease, on a hold expecting two: the hold stays live
            lg.release(rid, "h", "x:0", 2, now=now)
        elif kind == "renew":
            assert lg.renew(rid, "h", "x:0", now=now, lease_token=tokens[rid]).status is ClaimStatus.GRANTED
        else:
            assert lg.claim(rid, "h", "x:0", 1, now=now, claim_id=f"c-{rid}").status is ClaimStatus.GRANTED
        if i % 100 == 99:
            lg.expire(now)
            lg.take_events()
        if i % 1000 == 999:
            assert lg.table_sizes()["deadlines"] <= lg.heap_bound()
    assert lg.active == holds and lg.take_freed() == []


@pytest.mark.parametrize("holds", [1, 1000])
@pytest.mark.parametrize("kind", ["release", "renew", "resent claim"])
def test_repeated_messages_keep_the_heap_within_two_entries_per_hold(kind: str, holds: int) -> None:
    lg = PushedEveryTime()
    hostile_stream(lg, kind, holds, 100_000)
    assert lg.table_sizes()["deadlines"] <= lg.heap_bound()
    assert len(lg.old_heap) >= 100_000  # the old rule: one entry per message, none due yet


def test_deadlines_moved_earlier_again_and_again_are_rebuilt_away() -> None:
    """The only messages that still add an entry move a hold's deadline earlier: each new reader with a shorter
    lease (its claim's deadline nearer). A hold has at most MAX_TP_SIZE readers; the rebuild bounds the rest."""
    lg = PushedEveryTime(clock_skew=0.0)
    for h in range(50):
        lg.hold(f"r{h}", "h", now=0)
    wall = 1_800_000_000_000
    for i in range(MAX_TP_SIZE):
        for h in range(50):
            reply = lg.claim(f"r{h}", "h", f"x:{i}", 1, now=0, deadline_ms=wall + 4000 - i, wall_now_ms=wall)
            assert reply.status is ClaimStatus.GRANTED and reply.lease == pytest.approx((4000 - i) / 1000)
            assert lg.table_sizes()["deadlines"] <= lg.heap_bound()  # at every message
    assert len(lg.old_heap) == 50 * MAX_TP_SIZE
    lg.expire(now=4.0)  # every lease lapsed: every hold finished, their stale entries dropped
    assert lg.active == 0 and len(lg.take_freed()) == 50
    assert lg.table_sizes()["deadlines"] <= STALE_SLACK


def test_finished_holds_leave_no_pile_of_stale_entries() -> None:
    lg = ledger()
    for i in range(10_000):
        lg.hold(f"r{i}", "h", now=0)
        token = lg.claim(f"r{i}", "h", "d:0", 1, now=0.5).lease_token  # its entry moves to the lease (earlier)
        lg.release(f"r{i}", "h", "d:0", 1, now=1, lease_token=token)
    assert lg.active == 0 and len(lg.take_freed()) == 10_000
    assert lg.table_sizes()["deadlines"] <= STALE_SLACK


def test_after_the_churn_the_hold_deadline_still_fires_on_time() -> None:
    lg = PushedEveryTime()
    hostile_stream(lg, "release", 1, 100_000)  # until t=2; hold deadline 10
    lg.expire(now=9.999)
    assert lg.take_freed() == []
    lg.expire(now=10.0)
    assert lg.take_freed() == ["r0"] and lg.counters["hold_expired"] == 1
    assert lg.table_sizes()["deadlines"] <= lg.heap_bound()


def test_after_the_churn_a_lease_still_lapses_on_time() -> None:
    lg = PushedEveryTime()
    hostile_stream(lg, "renew", 1, 100_000)  # last renewal at t=1.99999: lease until 5.99999
    lg.expire(now=5.99)
    assert lg.take_freed() == []
    lg.expire(now=6.0)
    assert lg.take_freed() == ["r0"] and lg.counters["lease_lapsed"] == 1
    assert lg.table_sizes()["deadlines"] <= lg.heap_bound()


def test_after_the_churn_the_pin_deadline_still_fires_on_time() -> None:
    lg = PushedEveryTime()
    lg.hold("r0", "h", now=0)
    token = lg.claim("r0", "h", "x:0", 1, now=1, claim_id="c").lease_token
    for i in range(100_000):  # renewals until t=7.45, then resent claims until 13.9, each extending up to 14
        now = 1 + i * 12.9e-5
        if i >= 50_000:
            assert lg.claim("r0", "h", "x:0", 1, now=now, claim_id="c").lease_token == token
        else:
            assert lg.renew("r0", "h", "x:0", now=now, lease_token=token).status is ClaimStatus.GRANTED
        if i % 100 == 99:
            lg.expire(now)
    assert lg.table_sizes()["deadlines"] <= lg.heap_bound() and len(lg.old_heap) > 30_000  # those not yet due
    lg.expire(now=13.999)
    assert lg.take_freed() == []
    lg.expire(now=14.0)
    assert lg.take_freed() == ["r0"] and lg.counters["hold_capped"] == 1


def test_renewed_holds_are_filed_again_not_expired_early() -> None:
    """A renewal adds no entry: the hold's entry comes up at the old lease end, and expire() files it again at the
    new one without looking further (nor freeing)."""
    lg = ledger()
    lg.hold("r1", "h", now=0)
    token = lg.claim("r1", "h", "d:0", 1, now=1).lease_token  # until 5
    lg.renew("r1", "h", "d:0", now=3, lease_token=token)  # until 7
    looked: list[str] = []
    original = lg._expire_one
    lg._expire_one = lambda hold, now: (looked.append(hold.request_id), original(hold, now))  # type: ignore
    lg.expire(now=5.0)
    assert looked == [] and lg.take_freed() == []
    lg.expire(now=7.0)
    assert looked == ["r1"] and lg.take_freed() == ["r1"]


# --------------------------------------------------------------------------- a claim carries D's deadline

WALL = 1_800_000_000_000  # ms since the epoch: P's wall clock in these tests


def test_a_claim_that_arrives_after_ds_deadline_is_refused() -> None:
    lg = ledger(clock_skew=2.0)
    lg.hold("r1", "h", now=0)
    late = lg.claim("r1", "h", "d:0", 1, now=1, claim_id="c", deadline_ms=WALL - 2001, wall_now_ms=WALL)
    assert late.status is ClaimStatus.REFUSED and late.reason == "the claim arrived after D's deadline"
    assert not late.lease_token and lg.counters["claim_after_deadline"] == 1
    assert [e.reason for e in lg.take_events()] == ["claim_after_deadline"]
    assert lg.state("r1") is HoldState.HELD
    # Within clock_skew of the deadline: granted (the clocks may disagree that much).
    ok = lg.claim("r1", "h", "d:0", 1, now=1, claim_id="c", deadline_ms=WALL - 1999, wall_now_ms=WALL)
    assert ok.status is ClaimStatus.GRANTED and ok.lease == pytest.approx(0.001)
    # Counted even for a hold P does not know (D gave up: UNKNOWN would only make it retry).
    assert lg.claim("nope", "h", "d:0", 1, now=1, deadline_ms=WALL - 5000, wall_now_ms=WALL).status \
        is ClaimStatus.REFUSED
    assert lg.counters["claim_after_deadline"] == 2


def test_a_late_claim_pins_the_blocks_only_until_ds_deadline() -> None:
    """A claim delivered late (held in a kernel buffer while D's link was down), 1 s after D's deadline, within
    clock_skew = 2 s: granted, but its lease ends at the deadline + clock_skew, 1 s from now, renewed or not."""
    lg = ledger(clock_skew=2.0)  # lease_timeout 4
    lg.hold("r1", "h", now=0)
    reply = lg.claim("r1", "h", "d:0", 1, now=1, deadline_ms=WALL - 1000, wall_now_ms=WALL)
    assert reply.status is ClaimStatus.GRANTED and reply.lease == pytest.approx(1.0)
    refused = lg.renew("r1", "h", "d:0", now=1.5, lease_token=reply.lease_token)
    assert refused.status is ClaimStatus.REFUSED and lg.counters["renew_past_deadline"] == 1
    assert "deadline + clock_skew" in lg.take_events()[-1].what
    lg.expire(now=1.99)
    assert lg.take_freed() == []
    lg.expire(now=2.0)
    assert lg.take_freed() == ["r1"] and lg.counters["lease_lapsed"] == 1
    assert "claim's deadline" in lg.take_events()[-1].what


def test_without_the_deadline_the_late_claim_pins_for_lease_timeout() -> None:
    """The same late claim from an older D (no deadline): nothing says D gave up, so its blocks stay pinned for a
    whole lease_timeout (4 s here, 60 s by default) instead of 1 s."""
    lg = ledger(clock_skew=2.0)
    lg.hold("r1", "h", now=0)
    reply = lg.claim("r1", "h", "d:0", 1, now=1, deadline_ms=0, wall_now_ms=WALL)
    assert reply.status is ClaimStatus.GRANTED and reply.lease == 4.0
    lg.expire(now=2.0)
    lg.expire(now=4.99)
    assert lg.take_freed() == []
    lg.expire(now=5.0)
    assert lg.take_freed() == ["r1"]


def test_a_resent_claim_keeps_the_first_claims_deadline() -> None:
    lg = ledger(clock_skew=1.0)
    lg.hold("r1", "h", now=0)
    first = lg.claim("r1", "h", "d:0", 1, now=1, claim_id="c", deadline_ms=WALL + 1000, wall_now_ms=WALL)
    assert first.lease == pytest.approx(2.0)  # until 3: deadline (now + 1) + clock_skew 1
    for deadline in (WALL + 60_000, 0):  # a resend naming a later deadline, or none, cannot move it
        again = lg.claim("r1", "h", "d:0", 1, now=1.5, claim_id="c", deadline_ms=deadline, wall_now_ms=WALL + 500)
        assert again.lease_token == first.lease_token and again.lease == pytest.approx(1.5)
    assert lg.renew("r1", "h", "d:0", now=2.9, lease_token=first.lease_token).status is ClaimStatus.REFUSED
    # Resent past the cap: nothing left to give (before, it was granted with no time left).
    gone = lg.claim("r1", "h", "d:0", 1, now=3.0, claim_id="c", deadline_ms=WALL + 1000, wall_now_ms=WALL + 2000)
    assert gone.status is ClaimStatus.REFUSED and not gone.lease_token
    lg.expire(now=3.0)
    assert lg.take_freed() == ["r1"]


def test_renewals_are_cut_at_ds_deadline_plus_clock_skew() -> None:
    lg = ledger(clock_skew=2.0)  # lease_timeout 4
    lg.hold("r1", "h", now=0)
    reply = lg.claim("r1", "h", "d:0", 1, now=1, deadline_ms=WALL + 3000, wall_now_ms=WALL)  # cap: 1 + 3 + 2
    assert reply.lease == 4.0
    renewed = lg.renew("r1", "h", "d:0", now=3, lease_token=reply.lease_token)
    assert renewed.status is ClaimStatus.GRANTED and renewed.lease == 3.0 and lg.counters["lease_cut_to_deadline"] == 1
    assert lg.renew("r1", "h", "d:0", now=4, lease_token=reply.lease_token).status is ClaimStatus.REFUSED
    lg.expire(now=5.99)
    assert lg.take_freed() == []
    lg.expire(now=6.0)
    assert lg.take_freed() == ["r1"]


def test_the_hold_service_passes_the_claims_deadline_and_its_wall_clock() -> None:
    import time

    from vllm_kvp2p.contract.protocol import Claim, ClaimReply, RankRegistration
    from vllm_kvp2p.prefill.hold_service import HoldService
    from vllm_kvp2p.testing.server import free_port
    from vllm_kvp2p.transfer.descriptors import PlaneGeometry
    from vllm_kvp2p.transfer.slicing import BlockShape

    reg = RankRegistration("P", 0, 1, "127.0.0.1:1", [PlaneGeometry(1 << 30, 512, 512, 100)],
                           [BlockShape(True, 2, 16, 16)], ["l0"], 16, 100, "float32", 2, 2, 8)
    service = HoldService(reg, "127.0.0.1", free_port(), hold_timeout=10, lease_timeout=4, clock_skew=5.0)
    try:
        service.hold("r1", "h")
        wall_ms = time.time_ns() // 1_000_000
        late = service._handle(Claim("r1", "h", "d:0", 1, "c", deadline_ms=wall_ms - 60_000))
        assert isinstance(late, ClaimReply) and late.status is ClaimStatus.REFUSED
        assert service.counters()["claim_after_deadline"] == 1
        ok = service._handle(Claim("r1", "h", "d:0", 1, "c", deadline_ms=wall_ms + 60_000))
        assert isinstance(ok, ClaimReply) and ok.status is ClaimStatus.GRANTED and ok.lease == 4.0
        assert service._handle(Claim("r1", "h", "d:1", 2, "c2", deadline_ms=wall_ms - 3_000)).lease < 2.5
    finally:
        service.close()


def test_a_claim_without_deadline_ms_decodes_as_not_given() -> None:
    """An older D's claim has no deadline_ms: it decodes as 0 (not given), and a new one carries it."""
    import msgspec

    from vllm_kvp2p.contract.protocol import Claim, decode_request, encode

    older = msgspec.msgpack.encode({"type": "claim", "request_id": "r", "hold_id": "h", "reader": "d:0",
                                    "expected_readers": 1})
    assert decode_request(older) == Claim("r", "h", "d:0", 1)
    assert decode_request(older).deadline_ms == 0
    assert decode_request(encode(Claim("r", "h", "d:0", 1, deadline_ms=WALL))).deadline_ms == WALL


def test_an_integrity_question_may_name_only_the_units_of_the_readers_live_hold() -> None:
    """verifiable_units: the blocks the hold offered, per group, in the planes of that group, and only while the
    asking reader's lease is live and the release carries its token."""
    planes = [PlaneGeometry(0x100000 * (i + 1), 4096, 4096, 10) for i in range(3)]
    groups = (0, 1, 0)
    lg = ledger()
    lg.hold("r1", "h", now=0, num_blocks=9, blocks=((3, 4, 5), (8,)))
    lg.hold("r2", "h", now=0, num_blocks=2, blocks=((6, 7),))
    token = lg.claim("r1", "h", "d:0", 1, now=1).lease_token
    units = lg.verifiable_units("r1", "h", "d:0", 2, token, planes, groups)
    assert units is not None and units.bytes == (3 + 1 + 3) * 4096
    assert {(p, b) for p in range(3) for b in range(10) if (p, b) in units} == {
        (0, 3), (0, 4), (0, 5), (1, 8), (2, 3), (2, 4), (2, 5)}  # not another group's, not another hold's
    assert lg.verifiable_units("r1", "h", "d:0", 2, "tok-forged", planes, groups) is None
    assert lg.verifiable_units("r1", "h", "d:9", 2, token, planes, groups) is None  # not this reader's lease
    assert lg.verifiable_units("r2", "h", "d:0", 2, token, planes, groups) is None  # a hold it never claimed
    assert lg.verifiable_units("r1", "h", "d:0", 5.5, token, planes, groups) is None  # the lease lapsed (4 s)


def test_readers_per_hold_is_kept_without_scanning_the_holds() -> None:
    """table_sizes' readers_per_hold (read every engine step by the metrics) is kept as holds change, not found by a
    pass over every hold: random claims, releases, early releases, lapses and expiries against the scan it
    replaced."""
    import random

    rng = random.Random(45)
    lg = ledger()
    tokens: dict[tuple[str, str], str] = {}
    now = 0.0
    for _ in range(3000):
        now += rng.random() * 0.5
        rid, reader = f"r{rng.randrange(40)}", f"d:{rng.randrange(4)}"
        op = rng.randrange(5)
        if op == 0:
            lg.hold(rid, "h", now)
        elif op == 1:
            reply = lg.claim(rid, "h", reader, rng.randrange(1, 4), now)
            if reply.status is ClaimStatus.GRANTED:
                tokens[(rid, reader)] = reply.lease_token
        elif op == 2:
            lg.release(rid, "h", reader, rng.randrange(1, 4), now, tokens.get((rid, reader), ""), rng.random() < 0.5)
        elif op == 3:
            lg.expire(now)
        else:
            lg.abandon(rid, "h", "", now)
        scan = max((h.num_readers for h in lg._holds.values()), default=0)
        assert lg.table_sizes()["readers_per_hold"] == scan
        assert all(count >= 0 for count in lg._holds.reader_counts.values())
