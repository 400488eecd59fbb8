"""P's ledger's heap of deadlines: expire() looks only at the holds whose deadline has come, and the heap stays
within 2 x live holds + STALE_SLACK whatever peers send, while every deadline (hold, lease, pin) still fires on
time. Pure state machine, no I/O."""

from __future__ import annotations

import heapq
import itertools

import pytest

from tests.unit.producer_ledgers import ledger
from vllm_kvp2p.contract.protocol import MAX_TP_SIZE, ClaimStatus
from vllm_kvp2p.lifecycle.producer import STALE_SLACK, ProducerLedger


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
