"""D's pull of several P ranks (D at TP 1 reading P at TP 2): every rank's lease is renewed while another rank is
slow (before, only the rank being read was: its lease lapsed and a good read came back lease_lost, shown here
against P's real ledgers with the old behaviour as the pair), a wait for a claim ends when another lease is due, a
failed renewal of one rank fails the pull and releases both. Pure, no I/O."""

from __future__ import annotations

import pytest

from tests.unit.consumer_pulls import (
    claim_and_read_rank_0,
    held_ledgers,
    run_against_p,
    tp2_pull,
    tp2_registration,
    tp2_sources,
)
from vllm_kvp2p.contract.protocol import ClaimReply, ClaimStatus
from vllm_kvp2p.lifecycle.consumer import Failure
from vllm_kvp2p.lifecycle.producer import HoldState
from vllm_kvp2p.lifecycle.pull import FetchRegistration, Outcome, ReadBatch, SendClaim, SendRelease, SendRenew, Wait


def test_the_lease_of_a_rank_already_read_is_renewed_while_a_slow_rank_is_worked_on() -> None:
    """Before, only the rank being read was renewed: rank 0's lease lapsed while rank 1 was slow, and its release
    came back lease_lost (a good read thrown away)."""
    job = tp2_pull()
    rank0, rank1 = tp2_sources()
    claim_and_read_rank_0(job)
    fetch = job.next_action(0.1)
    assert isinstance(fetch, FetchRegistration) and fetch.source == rank1
    assert job.on_registration(rank1, tp2_registration(1))
    assert isinstance(job.next_action(0.2), SendClaim)
    job.on_claim_reply(rank1, ClaimReply(ClaimStatus.UNKNOWN), now=0.2)  # P's rank 1 has not heard of the hold
    wait = job.next_action(0.2)
    assert isinstance(wait, Wait)
    renew = job.next_action(1.5)  # past rank 0's lease / 3, while rank 1 is still being claimed
    assert isinstance(renew, SendRenew) and renew.source == rank0 and renew.message.lease_token == "t0"
    job.on_renewed(rank0, ClaimReply(ClaimStatus.GRANTED, lease=3.0, lease_token="t0"), now=1.5)  # next at 2.5
    claim = job.next_action(1.5)
    assert isinstance(claim, SendClaim) and claim.source == rank1
    job.on_claim_reply(rank1, ClaimReply(ClaimStatus.GRANTED, lease=30.0, lease_token="t1"), now=1.5)
    read = job.next_action(2.0)
    assert isinstance(read, ReadBatch) and read.source == rank1
    renew = job.next_action(2.6)  # and while rank 1 is read
    assert isinstance(renew, SendRenew) and renew.source == rank0
    job.on_renewed(rank0, ClaimReply(ClaimStatus.GRANTED, lease=3.0, lease_token="t0"), now=2.6)
    job.on_batch_done(rank1, True)
    releases = [job.next_action(2.7)]
    job.on_release_sent(rank0)
    releases.append(job.next_action(2.7))
    job.on_release_sent(rank1)
    assert [(r.source.p_rank, r.message.lease_token, r.message.pulled) for r in releases] == [
        (0, "t0", True), (1, "t1", True)]
    assert job.next_action(2.7).result.outcome is Outcome.PULLED


def test_a_wait_for_a_claim_ends_when_another_lease_is_due() -> None:
    job = tp2_pull()
    rank0, rank1 = tp2_sources()
    claim_and_read_rank_0(job, lease=3.0)
    job.next_action(0.1)
    job.on_registration(rank1, tp2_registration(1))
    job.next_action(0.1)
    job.on_claim_reply(rank1, ClaimReply(ClaimStatus.UNKNOWN), now=0.9995)  # retry at 1.0005
    wait = job.next_action(0.9996)
    assert isinstance(wait, Wait) and wait.until == 1.0  # rank 0's renewal is due first
    renew = job.next_action(1.0)
    assert isinstance(renew, SendRenew) and renew.source == rank0


def test_a_failed_renewal_of_another_rank_fails_the_pull_and_releases_both() -> None:
    job = tp2_pull()
    rank0, rank1 = tp2_sources()
    claim_and_read_rank_0(job)
    job.next_action(0.1)
    job.on_registration(rank1, tp2_registration(1))
    job.next_action(0.1)
    job.on_claim_reply(rank1, ClaimReply(ClaimStatus.GRANTED, lease=30.0, lease_token="t1"), now=0.1)
    renew = job.next_action(1.1)
    assert isinstance(renew, SendRenew) and renew.source == rank0
    job.on_renewed(rank0, ClaimReply(ClaimStatus.REFUSED, reason="no live claim to renew"), now=1.1)
    tokens = []
    while isinstance(action := job.next_action(1.1), SendRelease):
        tokens.append(action.message.lease_token)
        assert not action.message.pulled
        job.on_release_sent(action.source)
    assert tokens == ["t0", "t1"]
    assert action.result.failure is Failure.REFUSED and "renewal on P rank 0" in action.result.reason


@pytest.mark.parametrize("renewals_lost", [(), (0,)])
def test_a_slow_second_rank_no_longer_costs_the_first_its_lease(renewals_lost: tuple[int, ...]) -> None:
    """Against P's real ledgers: rank 1's reads take 4 x 3 s with a 6 s lease. Every lease renewed: pulled, both
    holds released. Rank 0's renewals lost (the old behaviour: only the rank being read was renewed): its lease
    lapses, P frees its blocks, and the release comes back not confirmed: lease_lost."""
    ledgers = held_ledgers(lease_timeout=6.0)
    result = run_against_p(tp2_pull(max_batch_entries=1), ledgers, read_seconds={0: 0.01, 1: 3.0},
                           renewals_lost=renewals_lost)
    if not renewals_lost:
        assert result.outcome is Outcome.PULLED, result.reason
        assert [ledgers[r].state("p-req") for r in (0, 1)] == [HoldState.RELEASED] * 2
        assert not any(ledger.counters["lease_lapsed"] for ledger in ledgers.values())
    else:
        assert result.failure is Failure.LEASE_LOST and "P rank 0" in result.reason
        assert ledgers[0].state("p-req") is HoldState.EXPIRED and ledgers[0].counters["lease_lapsed"] == 1
