"""A claim carries D's deadline (``Claim.deadline_ms``, D's wall clock): P refuses a claim that arrives
``clock_skew`` past it, and a lease it grants (and its renewals) ends at the deadline + ``clock_skew`` instead of
running a whole ``lease_timeout``; a claim from an older D (no deadline) is served as before. P's ledger, and the
hold service passing the deadline and its own wall clock to it."""

from __future__ import annotations

import pytest

from tests.unit.producer_ledgers import ledger
from vllm_kvp2p.contract.protocol import ClaimStatus
from vllm_kvp2p.lifecycle.producer import HoldState
from vllm_kvp2p.transfer.descriptors import PlaneGeometry

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
