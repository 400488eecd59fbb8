"""P's ledger (lifecycle/producer.py): a hold from announced to freed, every delayed free reported exactly once
(claims, leases and their renewal, releases, early releases, expiry, a request id that comes back, two holds of one
id), and what a lease fences: a read P confirms only when its lease held from claim to release, integrity questions
only about the units of the reader's live hold. Pure state machine, no I/O."""

from __future__ import annotations

from tests.unit.producer_ledgers import ledger
from vllm_kvp2p.contract.protocol import ClaimStatus
from vllm_kvp2p.lifecycle.producer import HoldState
from vllm_kvp2p.transfer.descriptors import PlaneGeometry


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


def test_two_holds_of_one_id_ending_together_reach_vllm_in_two_steps() -> None:
    """vLLM takes finished ids as a set: the hold service reports the second at the next call."""
    from vllm_kvp2p.contract.protocol import RankRegistration
    from vllm_kvp2p.prefill.hold_service import HoldService
    from vllm_kvp2p.testing.server import free_port
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
