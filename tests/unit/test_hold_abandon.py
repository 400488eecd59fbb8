"""P's ledger and an abandon (protocol.Abandon): the holder of a hold's params frees a hold no reader has touched,
and nothing else. Pure state machine, no I/O."""

from __future__ import annotations

import itertools

from vllm_kvp2p.contract.protocol import AbandonOutcome, ClaimStatus
from vllm_kvp2p.lifecycle.producer import HoldState, ProducerLedger


def ledger(**kw) -> ProducerLedger:
    tokens = itertools.count(1)
    return ProducerLedger(hold_timeout=120.0, lease_timeout=4.0, token_factory=lambda: f"tok-{next(tokens)}", **kw)


def test_an_untouched_hold_is_freed_at_once_and_counted_released() -> None:
    lg = ledger()
    lg.hold("r1", "h", now=0, num_blocks=3, mac="m1")
    assert lg.abandon("r1", "h", "m1", now=1) == (AbandonOutcome.RELEASED, "")
    assert lg.take_freed() == ["r1"] and lg.state("r1", "h") is HoldState.RELEASED
    assert lg.tally["released"] == 1 and lg.tally["abandoned"] == 1 and lg.blocks_held == 0
    # Again (a resent abandon): nothing changes, nothing freed twice.
    assert lg.abandon("r1", "h", "m1", now=2)[0] is AbandonOutcome.ENDED
    assert lg.take_freed() == [] and lg.tally["released"] == 1


def test_without_an_abandon_the_same_hold_waits_for_hold_timeout() -> None:
    """The control: what the abandon saves (a hold nobody claims lasts hold_timeout)."""
    lg = ledger()
    lg.hold("r1", "h", now=0, mac="m1")
    lg.expire(now=119.9)
    assert lg.take_freed() == []
    lg.expire(now=120.0)
    assert lg.take_freed() == ["r1"] and lg.state("r1", "h") is HoldState.EXPIRED


def test_a_claimed_hold_is_not_freed_under_its_reader() -> None:
    lg = ledger()
    lg.hold("r1", "h", now=0, mac="m1")
    token = lg.claim("r1", "h", "d:0", 1, now=1).lease_token
    assert lg.abandon("r1", "h", "m1", now=2)[0] is AbandonOutcome.IN_USE
    assert lg.take_freed() == [] and lg.state("r1", "h") is HoldState.CLAIMED
    assert lg.release("r1", "h", "d:0", 1, now=3, lease_token=token, pulled=True)  # the read still counts
    assert lg.take_freed() == ["r1"] and lg.tally["abandoned"] == 0


def test_a_hold_one_of_two_readers_released_waits_for_the_other() -> None:
    """D at TP 2: rank 0 released, rank 1 has not claimed yet. An abandon must not free it under rank 1."""
    lg = ledger()
    lg.hold("r1", "h", now=0, mac="m1")
    token = lg.claim("r1", "h", "d:0", 2, now=1).lease_token
    lg.release("r1", "h", "d:0", 2, now=2, lease_token=token, pulled=True)
    assert lg.abandon("r1", "h", "m1", now=3)[0] is AbandonOutcome.IN_USE
    assert lg.claim("r1", "h", "d:1", 2, now=4).status is ClaimStatus.GRANTED


def test_the_mac_of_the_params_is_the_authority() -> None:
    lg = ledger()
    lg.hold("r1", "h", now=0, mac="m1")
    for wrong in ("", "m2", "m1" + "0"):
        assert lg.abandon("r1", "h", wrong, now=1)[0] is AbandonOutcome.REFUSED
    assert lg.take_freed() == [] and lg.counters["abandon_refused"] == 3
    # another hold id of a live request id: stale params, refused
    assert lg.abandon("r1", "other", "m1", now=1)[0] is AbandonOutcome.REFUSED
    assert lg.abandon("r1", "h", "m1", now=1)[0] is AbandonOutcome.RELEASED


def test_an_abandon_before_the_hold_is_applied_when_it_arrives() -> None:
    """P answers the prefill before its worker hears of the hold (one engine step later)."""
    lg = ledger()
    assert lg.abandon("r1", "h", "m1", now=0)[0] is AbandonOutcome.REMEMBERED
    lg.hold("r1", "h", now=0.01, mac="m1")
    assert lg.take_freed() == ["r1"] and lg.tally["abandoned"] == 1
    # With the wrong mac it is refused on arrival and the hold stays.
    assert lg.abandon("r2", "h", "bad", now=1)[0] is AbandonOutcome.REMEMBERED
    lg.hold("r2", "h", now=1.01, mac="m2")
    assert lg.take_freed() == [] and lg.counters["abandon_refused"] == 1
    # Remembered only for early_release_ttl (10 s): a late hold is not freed by a stale abandon.
    assert lg.abandon("r3", "h", "m3", now=2)[0] is AbandonOutcome.REMEMBERED
    lg.expire(now=12.5)
    lg.hold("r3", "h", now=12.5, mac="m3")
    assert lg.take_freed() == []


def test_an_early_reader_release_wins_over_an_early_abandon() -> None:
    lg = ledger()
    assert lg.abandon("r1", "h", "m1", now=0)[0] is AbandonOutcome.REMEMBERED
    lg.release("r1", "h", "d:0", 2, now=0.1)  # D's rank 0 had nothing to pull; rank 1 still to come
    assert lg.abandon("r1", "h", "m1", now=0.2)[0] is AbandonOutcome.IN_USE
    lg.hold("r1", "h", now=0.3, mac="m1")
    assert lg.take_freed() == []  # waits for D's rank 1, as without the abandon
    lg.release("r1", "h", "d:1", 2, now=0.4)
    assert lg.take_freed() == ["r1"] and lg.tally["abandoned"] == 0


def test_early_abandons_share_the_early_release_bound() -> None:
    lg = ledger(max_early_releases=4)
    for i in range(4):
        assert lg.abandon(f"r{i}", "h", "m", now=0)[0] is AbandonOutcome.REMEMBERED
    assert lg.abandon("r9", "h", "m", now=0)[0] is AbandonOutcome.REFUSED
    assert lg.table_sizes()["early_releases"] == 4 and lg.counters["early_release_table_full"] == 1


def test_ids_over_the_bound_are_refused() -> None:
    lg = ledger()
    assert lg.abandon("r" * 1000, "h", "", now=0)[0] is AbandonOutcome.REFUSED
    assert lg.table_sizes()["early_releases"] == 0
