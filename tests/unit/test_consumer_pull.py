"""D's pull of one P rank (``ConsumerPull``) driven through every outcome: claim (retried while P has not heard of the
hold, with a backoff from 1 ms to 50 ms; refused), reads in batches, the lease renewed during long reads, the release
always sent and carrying the lease's token, nothing to pull, stale results ignored; and the deadline every claim
carries (D's wall clock), which lets P refuse a claim delivered after D gave up. Pure, no I/O."""

from __future__ import annotations

from tests.unit.consumer_pulls import LOCAL, SRC, awaiting_plan, params, pull, registration
from vllm_kvp2p.contract.protocol import ClaimReply, ClaimStatus, RemotePrefill
from vllm_kvp2p.lifecycle.consumer import PullPlan
from vllm_kvp2p.lifecycle.producer import ProducerLedger
from vllm_kvp2p.lifecycle.pull import (
    ConsumerPull,
    FetchRegistration,
    Finish,
    Outcome,
    ReadBatch,
    SendClaim,
    SendRelease,
    SendRenew,
    Wait,
)


def test_happy_path_sequence() -> None:
    job = pull(awaiting_plan(), max_batch_entries=2)
    assert isinstance(job.next_action(0), FetchRegistration)
    job.on_registration(SRC, registration())
    claim = job.next_action(0)
    assert isinstance(claim, SendClaim) and claim.message.hold_id == "hold"
    job.on_claim_reply(SRC, ClaimReply(ClaimStatus.GRANTED, lease=30), now=0)
    reads = []
    while isinstance(action := job.next_action(1), ReadBatch):
        reads.append(action)
        job.on_batch_done(action.source, True)
    # 2 planes x runs (3,4)->(10,11) merged and 9->12: 4 entries, in batches of 2
    assert [len(r.descriptors) for r in reads] == [2, 2]
    assert isinstance(action, SendRelease) and action.message.pulled
    job.on_release_sent(action.source)
    fin = job.next_action(1)
    assert isinstance(fin, Finish)
    r = fin.result
    assert r.outcome is Outcome.PULLED and r.report_finished and not r.report_failed
    assert r.num_blocks == 3 and r.num_bytes == 3 * 512 * 2


def test_unknown_claim_is_retried_then_refused_after_claim_wait() -> None:
    job = pull(awaiting_plan())
    job.next_action(0)
    job.on_registration(SRC, registration())
    job.next_action(0)
    job.on_claim_reply(SRC, ClaimReply(ClaimStatus.UNKNOWN), now=0.1)
    assert isinstance(job.next_action(0.1005), Wait)
    assert isinstance(job.next_action(0.2), SendClaim)
    job.on_claim_reply(SRC, ClaimReply(ClaimStatus.UNKNOWN), now=1.5)  # past claim_wait
    rel = job.next_action(1.5)
    assert isinstance(rel, SendRelease) and not rel.message.pulled
    job.on_release_sent(rel.source)
    r = job.next_action(1.5).result
    assert r.outcome is Outcome.FAILED and r.report_finished and r.report_failed


def test_unknown_claim_retry_starts_at_1_ms_and_backs_off_to_50_ms() -> None:
    """P usually learns of a hold within a ms of answering: the first retry must not wait the old 50 ms, and a P
    slow to step is asked at most every 50 ms."""
    job = pull(awaiting_plan())
    job.next_action(0)
    job.on_registration(SRC, registration())
    now, waits = 0.0, []
    for _ in range(10):
        assert isinstance(job.next_action(now), SendClaim)
        job.on_claim_reply(SRC, ClaimReply(ClaimStatus.UNKNOWN), now=now)
        wait = job.next_action(now)
        assert isinstance(wait, Wait)
        waits.append(round((wait.until - now) * 1000, 3))
        now = wait.until
    assert waits == [1, 2, 4, 8, 16, 32, 50, 50, 50, 50]


def test_refused_claim_fails_and_still_releases() -> None:
    job = pull(awaiting_plan())
    job.next_action(0)
    job.on_registration(SRC, registration())
    job.next_action(0)
    job.on_claim_reply(SRC, ClaimReply(ClaimStatus.REFUSED, reason="blocks already expired"), now=0)
    rel = job.next_action(0)
    assert isinstance(rel, SendRelease) and rel.message.lease_token == ""  # no lease: a plain notification


def test_lease_is_renewed_during_long_reads() -> None:
    job = pull(awaiting_plan(), max_batch_entries=1)
    job.next_action(0)
    job.on_registration(SRC, registration())
    job.next_action(0)
    job.on_claim_reply(SRC, ClaimReply(ClaimStatus.GRANTED, lease=3, lease_token="tok"), now=0)  # renew at t=1
    action = job.next_action(0.5)
    assert isinstance(action, ReadBatch)
    job.on_batch_done(action.source, True)
    renew = job.next_action(1.2)
    assert isinstance(renew, SendRenew) and renew.message.lease_token == "tok"  # P refuses a renewal without it
    job.on_renewed(renew.source, ClaimReply(ClaimStatus.GRANTED, lease=3, lease_token="tok"), now=1.2)
    assert isinstance(job.next_action(1.3), ReadBatch)


def test_release_carries_the_lease_token_of_the_claim() -> None:
    job = pull(awaiting_plan())
    job.next_action(0)
    job.on_registration(SRC, registration())
    job.next_action(0)
    job.on_claim_reply(SRC, ClaimReply(ClaimStatus.GRANTED, lease=30, lease_token="tok"), now=0)
    action = job.next_action(0)
    job.on_batch_done(action.source, False, "boom")  # failed or not, the release must carry the token
    rel = job.next_action(0)
    assert isinstance(rel, SendRelease) and rel.message.lease_token == "tok" and not rel.message.pulled


def test_failed_read_fails_and_releases() -> None:
    job = pull(awaiting_plan())
    job.next_action(0)
    job.on_registration(SRC, registration())
    job.next_action(0)
    job.on_claim_reply(SRC, ClaimReply(ClaimStatus.GRANTED, lease=30), now=0)
    read = job.next_action(0)
    job.on_batch_done(read.source, False, "rc -1")
    rel = job.next_action(0)
    assert isinstance(rel, SendRelease)
    job.on_release_sent(rel.source)
    assert "rc -1" in job.next_action(0).result.reason


def test_nothing_to_pull_only_releases_and_is_never_reported() -> None:
    plan = PullPlan("d1", RemotePrefill.from_params(params()), (), (), awaiting=False)
    job = pull(plan)
    rel = job.next_action(0)
    assert isinstance(rel, SendRelease) and not rel.message.pulled
    job.on_release_sent(rel.source)
    r = job.next_action(0).result
    assert r.outcome is Outcome.NOTHING_TO_PULL and not r.report_finished and not r.report_failed


def test_stale_results_are_ignored() -> None:
    job = pull(awaiting_plan())
    job.on_claim_reply(SRC, ClaimReply(ClaimStatus.GRANTED, lease=30), now=0)  # not claiming yet
    assert isinstance(job.next_action(0), FetchRegistration)


# ----------------------------------------------------------------------------- D's deadline in its claims


def test_every_claim_carries_the_pulls_deadline_on_ds_wall_clock() -> None:
    job = ConsumerPull(awaiting_plan(), [SRC], "d:0", LOCAL, claim_wait=1.0, max_batch_entries=1024, now=100.0,
                       timeout=20.0, wall_now_ms=1_700_000_000_000)
    assert job.wall_deadline_ms == 1_700_000_020_000
    job.next_action(100.0)
    job.on_registration(SRC, registration())
    first = job.next_action(100.0)
    job.on_claim_reply(SRC, ClaimReply(ClaimStatus.UNKNOWN), now=100.0)
    resent = job.next_action(100.5)
    assert isinstance(first, SendClaim) and isinstance(resent, SendClaim)
    assert first.message.deadline_ms == resent.message.deadline_ms == 1_700_000_020_000


def test_no_deadline_is_claimed_without_a_wall_clock_or_a_bound() -> None:
    for kw in ({"timeout": 20.0}, {"wall_now_ms": 1_700_000_000_000}):
        job = ConsumerPull(awaiting_plan(), [SRC], "d:0", LOCAL, claim_wait=1.0, max_batch_entries=1024, now=0.0,
                           **kw)
        job.next_action(0.0)
        job.on_registration(SRC, registration())
        claim = job.next_action(0.0)
        assert isinstance(claim, SendClaim) and claim.message.deadline_ms == 0


def test_p_refuses_a_claim_that_reaches_it_after_ds_deadline() -> None:
    """What the deadline is for: a claim held up (a kernel buffer while the link was down) and delivered after D
    gave up pins nothing. Without it P grants the late claim, and nobody renews or releases the lease."""
    job = ConsumerPull(awaiting_plan(), [SRC], "d:0", LOCAL, claim_wait=1.0, max_batch_entries=1024, now=0.0,
                       timeout=20.0, wall_now_ms=1_700_000_000_000)
    job.next_action(0.0)
    job.on_registration(SRC, registration())
    m = job.next_action(0.0).message
    late_ms = m.deadline_ms + 120_000  # delivered two minutes after D's deadline (beyond any clock_skew)
    for deadline_ms, granted in ((m.deadline_ms, False), (0, True)):
        ledger = ProducerLedger(hold_timeout=600.0, lease_timeout=60.0)
        ledger.hold("p-req", "hold", 0.0, 3)
        reply = ledger.claim(m.request_id, m.hold_id, m.reader, m.expected_readers, 5.0, m.claim_id,
                             deadline_ms=deadline_ms, wall_now_ms=late_ms)
        assert (reply.status is ClaimStatus.GRANTED) is granted, reply
