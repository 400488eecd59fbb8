"""A crash of D's pull thread mid-pull (a bug): the request fails as ``internal`` at once, and the releases still owed
go out, each lease with its token (without it P's ledger ignores a live lease's release and keeps the blocks until
the lease lapses) and a never-claimed rank a notification; a failure already out is kept. Pure, no I/O."""

from __future__ import annotations

import msgspec
import pytest

from tests.unit.consumer_pulls import (
    SRC,
    awaiting_plan,
    claim_and_read_rank_0,
    pull,
    registration,
    tp2_pull,
    tp2_registration,
    tp2_sources,
)
from vllm_kvp2p.contract.protocol import ClaimReply, ClaimStatus
from vllm_kvp2p.lifecycle.consumer import Failure
from vllm_kvp2p.lifecycle.producer import HoldState, ProducerLedger
from vllm_kvp2p.lifecycle.pull import ReadBatch, SendRelease


def test_a_crash_owes_each_lease_its_token_and_a_never_claimed_rank_a_notification() -> None:
    job = tp2_pull(max_batch_entries=1)
    rank0, rank1 = tp2_sources()
    claim_and_read_rank_0(job, token="t0")
    job.on_crash("internal error: boom")  # e.g. the adapter raised while fetching rank 1's registration
    owed = []
    while isinstance(action := job.next_action(0.2), SendRelease):
        owed.append(action)
        job.on_release_sent(action.source)
    assert [(a.source.p_rank, a.message.lease_token, a.message.pulled, a.message.expected_readers) for a in owed] == [
        (0, "t0", False, 1), (1, "", False, 1)]
    assert action.result.failure is Failure.INTERNAL and action.result.reason == "internal error: boom"


def test_a_crash_during_the_releases_owes_only_those_not_answered() -> None:
    job = tp2_pull()
    rank0, rank1 = tp2_sources()
    claim_and_read_rank_0(job, token="t0")
    job.next_action(0.1)
    job.on_registration(rank1, tp2_registration(1))
    job.next_action(0.1)
    job.on_claim_reply(rank1, ClaimReply(ClaimStatus.GRANTED, lease=30.0, lease_token="t1"), now=0.1)
    while isinstance(action := job.next_action(0.2), ReadBatch):
        job.on_batch_done(action.source, True)
    assert isinstance(action, SendRelease) and action.source == rank0
    job.on_release_sent(rank0)
    job.on_crash("internal error: boom")  # before rank 1's release went out
    owed = job.next_action(0.2)
    assert isinstance(owed, SendRelease) and owed.source == rank1 and owed.message.lease_token == "t1"
    assert not owed.message.pulled  # nothing read counts after a crash
    job.on_release_sent(rank1)
    assert job.next_action(0.2).result.failure is Failure.INTERNAL


def test_a_crash_keeps_a_failure_already_out() -> None:
    job = pull(awaiting_plan())
    job.next_action(0)
    job.on_registration(SRC, registration())
    job.next_action(0)
    job.on_claim_reply(SRC, ClaimReply(ClaimStatus.GRANTED, lease=30, lease_token="tok"), now=0)
    job.on_batch_done(SRC, False, "rc -1")  # published as read_failed
    job.on_crash("internal error: boom")
    release = job.next_action(0)
    assert isinstance(release, SendRelease) and release.message.lease_token == "tok"
    job.on_release_sent(SRC)
    assert job.next_action(0).result.failure is Failure.READ_FAILED


@pytest.mark.parametrize("with_token", [True, False])
def test_the_release_owed_after_a_crash_frees_ps_hold_only_with_its_token(with_token: bool) -> None:
    """P's ledger ignores the release of a live lease that does not carry its token (the release the pull thread
    used to send after a crash): the blocks stay pinned until the lease lapses."""
    ledger = ProducerLedger(hold_timeout=600.0, lease_timeout=60.0)
    ledger.hold("p-req", "hold", 0.0, 3)
    job = pull(awaiting_plan())
    job.next_action(0)
    job.on_registration(SRC, registration())
    m = job.next_action(0).message
    job.on_claim_reply(SRC, ledger.claim(m.request_id, m.hold_id, m.reader, m.expected_readers, 0.0, m.claim_id),
                       now=0)
    job.on_crash("internal error: boom")
    release = job.next_action(0.5).message
    if not with_token:
        release = msgspec.structs.replace(release, lease_token="")
    ledger.release(release.request_id, release.hold_id, release.reader, release.expected_readers, 0.5,
                   release.lease_token, release.pulled)
    if with_token:
        assert ledger.state("p-req") is HoldState.RELEASED and ledger.take_freed() == ["p-req"]
    else:
        assert ledger.state("p-req") is HoldState.CLAIMED and ledger.counters["release_without_token"] == 1
