"""P-side lifecycle: holds, claims (leases), releases, expiry. Pure state machine, no I/O."""

from __future__ import annotations

from vllm_kvp2p.lifecycle.producer import HoldState, ProducerLedger
from vllm_kvp2p.protocol import ClaimStatus


def ledger() -> ProducerLedger:
    return ProducerLedger(hold_timeout=10.0, lease_timeout=4.0)


def test_claim_then_release_frees_exactly_once() -> None:
    lg = ledger()
    lg.hold("r1", "h", now=0)
    assert lg.claim("r1", "h", "d:0", 1, now=1).status is ClaimStatus.GRANTED
    assert lg.take_freed() == []
    lg.release("r1", "h", "d:0", 1, now=2)
    assert lg.take_freed() == ["r1"]
    lg.release("r1", "h", "d:0", 1, now=3)  # duplicate release: ignored, logged
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
    lg.claim("r1", "h", "d:0", 1, now=8)  # lease until 12
    lg.expire(now=11)  # past the hold deadline, lease alive
    assert lg.take_freed() == []
    assert lg.renew("r1", "h", "d:0", now=11).status is ClaimStatus.GRANTED  # lease until 15
    lg.expire(now=14)
    assert lg.take_freed() == []
    lg.expire(now=15.1)  # reader vanished: lease lapsed, nobody can be reading
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


def test_early_release_is_forgotten_after_hold_timeout() -> None:
    lg = ledger()
    lg.release("never-held", "h", "d:0", 1, now=0)
    lg.expire(now=11)
    lg.hold("never-held", "h", now=12)  # too late to match: the hold lives on its own deadline
    assert lg.take_freed() == []


def test_waits_for_every_expected_reader() -> None:
    lg = ledger()
    lg.hold("r1", "h", now=0)
    lg.claim("r1", "h", "d:0", 2, now=1)
    lg.claim("r1", "h", "d:1", 2, now=1)
    lg.release("r1", "h", "d:0", 2, now=2)
    assert lg.take_freed() == []
    lg.release("r1", "h", "d:1", 2, now=2)
    assert lg.take_freed() == ["r1"]


def test_duplicate_hold_is_ignored() -> None:
    lg = ledger()
    lg.hold("r1", "h", now=0)
    lg.hold("r1", "h2", now=1)
    lg.release("r1", "h", "d:0", 1, now=2)
    assert lg.take_freed() == ["r1"]
