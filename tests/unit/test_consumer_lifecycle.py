"""D-side lifecycle: plans made exactly once, and a pull driven through every outcome. Pure, no I/O."""

from __future__ import annotations

import msgspec
import pytest

from tests.support.prompts import prompt, remote
from vllm_kvp2p.contract.protocol import ClaimReply, ClaimStatus, RankRegistration, RemotePrefill
from vllm_kvp2p.lifecycle.consumer import ConsumerSchedule, Failure, PullPlan
from vllm_kvp2p.lifecycle.producer import HoldState, ProducerLedger
from vllm_kvp2p.lifecycle.pull import (
    ConsumerPull,
    FetchRegistration,
    Finish,
    LocalKV,
    Outcome,
    PullResult,
    ReadBatch,
    SendClaim,
    SendRelease,
    SendRenew,
    Source,
    Wait,
)
from vllm_kvp2p.transfer.descriptors import PlaneGeometry
from vllm_kvp2p.transfer.slicing import BlockShape
from vllm_kvp2p.transfer.tp_mapping import HeadSlice, Layout, rank_plan

BS = 16


def params(n_blocks: int = 4, num_tokens: int = 60) -> dict:
    return remote([list(range(10, 10 + n_blocks))], num_tokens, BS).to_params()


# ----------------------------------------------------------------------------- schedule


def test_matched_tokens_is_pure_and_counts_beyond_local_hit() -> None:
    s = ConsumerSchedule(BS)
    for _ in range(3):
        assert s.matched_tokens("d1", params(), prompt(60), 16) == (44, True)
    assert s.take_plans() == []


def test_full_local_hit_plans_a_release_only() -> None:
    s = ConsumerSchedule(BS)
    assert s.matched_tokens("d1", params(), prompt(60), 60) == (0, False)
    plan = s.on_alloc("d1", params(), 0, [], 60, prompt(60))
    assert plan is not None and not plan.awaiting and plan.local_block_ids == ()
    assert s.take_plans() == [plan]


def test_partial_hit_with_tail_shorter_than_a_block_computes_locally() -> None:
    s = ConsumerSchedule(BS)
    assert s.matched_tokens("d1", params(), prompt(60), 48) == (0, False)  # 12 tokens left, < one block
    assert s.matched_tokens("d2", params(1, num_tokens=10), prompt(10), 0) == (10, True)  # no hit: pull it all


def test_partial_hit_pulls_only_missing_blocks() -> None:
    s = ConsumerSchedule(BS)
    plan = s.on_alloc("d1", params(), 28, [[7, 8]], 32, prompt(60))  # 2 of 4 blocks cached locally
    assert plan is not None and plan.awaiting
    assert plan.local_block_ids == ((7, 8),) and plan.remote_block_ids == ((12, 13),)


def test_plan_is_made_once_whatever_the_call_order() -> None:
    s = ConsumerSchedule(BS)
    first = s.on_alloc("d1", params(), 60, [[1, 2, 3, 4]], 0, prompt(60))
    assert s.on_alloc("d1", params(), 0, [[5]], 60, prompt(60)) is None  # vLLM's second call after promotion
    assert s.matched_tokens("d1", params(), prompt(60), 0) == (0, False)  # preempted: recompute locally
    assert s.on_finished("d1", params(), prompt(60)) is None  # P is released by the pull itself
    assert s.take_plans() == [first]


def test_rejected_request_releases_p_at_finish() -> None:
    s = ConsumerSchedule(BS)
    plan = s.on_finished("d1", params(), prompt(60))
    assert plan is not None and not plan.awaiting and plan.local_block_ids == ()


def test_non_p2p_requests_are_ignored() -> None:
    s = ConsumerSchedule(BS)
    assert s.matched_tokens("d1", None, prompt(60), 0) == (0, False)
    malformed = s.on_alloc("d1", {"do_remote_prefill": True}, 10, [[1]], 0, prompt(60))  # fails, contacts no one
    assert malformed is not None and malformed.error and not malformed.contact_p
    assert s.on_finished("d2", {"do_remote_decode": True}, prompt(60)) is None


def test_incompatible_block_sizes_fail_the_plan_not_the_engine() -> None:
    s = ConsumerSchedule(24)
    plan = s.on_alloc("d1", params(), 60, [[1, 2, 3]], 0, prompt(60))
    assert plan is not None and plan.awaiting and "P uses 16, D uses 24" in plan.error


def test_larger_d_blocks_map_to_several_p_blocks() -> None:
    s = ConsumerSchedule(32)
    plan = s.on_alloc("d1", params(), 28, [[5]], 32, prompt(60))  # tokens 32..59 of P's 16-token blocks 12, 13
    assert plan is not None and not plan.error
    assert plan.remote_block_ids == ((12, 13),) and plan.remote_token_offset == 0


def test_smaller_d_blocks_start_inside_a_p_block() -> None:
    s = ConsumerSchedule(8)
    plan = s.on_alloc("d1", params(), 36, [[5, 6, 7, 8, 9]], 24, prompt(60))  # token 24 is token 8 of P's block 11
    assert plan is not None and not plan.error
    assert plan.remote_block_ids == ((11, 12, 13),) and plan.remote_token_offset == 8


# ----------------------------------------------------------------------------- pull


SHAPE = BlockShape(True, 2, BS, 16)  # 2 heads x 16 tokens x 16 B = 512 B blocks


def planes(base: int, n: int = 2) -> list[PlaneGeometry]:
    return [PlaneGeometry(base + i * 1_000_000, 512, 512, 100) for i in range(n)]


def registration(engine: str = "P", n_planes: int = 2) -> RankRegistration:
    return RankRegistration(engine, 0, 1, "127.0.0.1:15000", planes(1 << 30, n_planes), [SHAPE] * n_planes,
                            ["l0", "l1"], BS, 100, "float32", 2, 2, 8)


SRC = Source(0, 1, (HeadSlice(0, 0, 0, 2),))
LOCAL = LocalKV(tuple(planes(1 << 20)), (SHAPE, SHAPE), BS, ("l0", "l1"), "float32", 2)


def pull(plan: PullPlan, **kw) -> ConsumerPull:
    source = Source(0, 1, (HeadSlice(0, 0, 0, 2),))
    return ConsumerPull(plan, [source], "d:0", LOCAL, claim_wait=1.0,
                        max_batch_entries=kw.get("max_batch_entries", 1024), now=0.0)


def awaiting_plan() -> PullPlan:
    return PullPlan("d1", RemotePrefill.from_params(params()), ((3, 4, 9),), ((10, 11, 12),), awaiting=True)


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


def test_incompatible_registration_fails_with_both_values() -> None:
    job = pull(awaiting_plan())
    job.next_action(0)
    job.on_registration(SRC, registration(n_planes=3))
    rel = job.next_action(0)
    job.on_release_sent(rel.source)
    reason = job.next_action(0).result.reason
    assert "P has 3 KV planes, D has 2" in reason


def test_a_new_p_sends_its_registration_with_the_claim_reply() -> None:
    """No registration cached: one round trip (the claim) before the reads, instead of two."""
    job = pull(awaiting_plan())
    fetch = job.next_action(0)
    assert isinstance(fetch, FetchRegistration) and fetch.join_claim
    job.with_claim(SRC)  # the adapter has none cached
    claim = job.next_action(0)
    assert isinstance(claim, SendClaim) and claim.message.with_registration
    assert job.on_claim_reply(SRC, ClaimReply(ClaimStatus.GRANTED, lease=30, registration=registration()), now=0)
    action = job.next_action(0)
    assert isinstance(action, ReadBatch) and action.segment == "127.0.0.1:15000"
    # A cached registration (the usual path) asks for none.
    cached = pull(awaiting_plan())
    cached.next_action(0)
    cached.on_registration(SRC, registration())
    claim = cached.next_action(0)
    assert isinstance(claim, SendClaim) and not claim.message.with_registration


def test_an_older_p_that_ignores_the_request_is_asked_after_the_claim() -> None:
    job = pull(awaiting_plan())
    job.next_action(0)
    job.with_claim(SRC)
    job.next_action(0)
    assert not job.on_claim_reply(SRC, ClaimReply(ClaimStatus.GRANTED, lease=30, lease_token="tok"), now=0)
    fetch = job.next_action(0)
    assert isinstance(fetch, FetchRegistration) and not fetch.join_claim  # fetch it now, no second claim
    assert job.on_registration(SRC, registration())
    action = job.next_action(0)
    assert isinstance(action, ReadBatch)
    job.on_batch_done(action.source, True)
    rel = job.next_action(0)
    assert isinstance(rel, SendRelease) and rel.message.lease_token == "tok" and rel.message.pulled


def test_a_registration_in_a_claim_reply_is_checked_and_the_lease_released() -> None:
    job = pull(awaiting_plan())
    job.next_action(0)
    job.with_claim(SRC)
    job.next_action(0)
    bad = registration(n_planes=3)
    assert not job.on_claim_reply(SRC, ClaimReply(ClaimStatus.GRANTED, lease=30, lease_token="tok",
                                                  registration=bad), now=0)
    rel = job.next_action(0)
    assert isinstance(rel, SendRelease) and rel.message.lease_token == "tok" and not rel.message.pulled
    job.on_release_sent(rel.source)
    assert "P has 3 KV planes, D has 2" in job.next_action(0).result.reason


def test_a_registration_with_an_unknown_claim_is_kept_for_the_retry() -> None:
    job = pull(awaiting_plan())
    job.next_action(0)
    job.with_claim(SRC)
    job.next_action(0)
    assert job.on_claim_reply(SRC, ClaimReply(ClaimStatus.UNKNOWN, registration=registration()), now=0)
    retry = job.next_action(0.5)
    assert isinstance(retry, SendClaim) and not retry.message.with_registration
    job.on_claim_reply(SRC, ClaimReply(ClaimStatus.GRANTED, lease=30), now=0.5)
    assert isinstance(job.next_action(0.5), ReadBatch)


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


@pytest.mark.parametrize(("change", "message"), [
    ({"engine_id": "other"}, "answers for engine other, the params name engine P"),
    ({"layer_names": ["l0", "l1", "l2"]}, "KV layers: P has 3, D has 2; only P: l2 (a speculative-decoding"),
    # D runs a draft model (MTP) P does not: P never filled that layer, D would decode from whatever it holds.
    ({"layer_names": ["l0"]}, "KV layers: P has 1, D has 2; only D: l1 (a speculative-decoding draft model's "
                              "layers, MTP or EAGLE, are KV layers too: start P and D with the same "
                              "--speculative-config)"),
    ({"layer_names": ["l1", "l0"]}, "P registers the same layers as D in another order"),
    ({"layer_names": ["l0", "x" * 100_000]}, "only P: " + "x" * 80 + " (a"),  # bounded, whatever P sends
    ({"layer_names": ["l0", "层\u0000é"]}, "only P: 层\u0000é (a"),  # non-ASCII, a NUL: quoted as sent
    # Many forged names: the comparison is linear and the message names three of them.
    ({"layer_names": [f"forged.{i}" for i in range(200_000)]}, "only P: forged.0, forged.1, forged.2 ... (a"),
    ({"dtype": "bfloat16"}, "KV cache dtype: P uses bfloat16, D uses float32"),
    ({"total_num_kv_heads": 4}, "total KV heads: P has 4, D has 2"),
    ({"use_mla": True}, "MLA: P True, D False"),
    ({"block_shapes": [BlockShape(True, 2, BS, 32)] * 2}, "bytes per head and token: P 32, D 16 (head size)"),
    # A P whose blocks are not what its params say (the params' own block size was checked against D's at
    # admission: lifecycle/admission.py).
    ({"block_size": 24}, "block size: the params say P's blocks hold 16 tokens, P rank 0 registers blocks of 24"),
])
def test_incompatible_geometry_is_refused_at_handshake_with_both_values(change: dict, message: str) -> None:
    import msgspec

    job = pull(awaiting_plan())
    job.next_action(0)
    job.on_registration(SRC, msgspec.structs.replace(registration(), **change))
    rel = job.next_action(0)
    assert isinstance(rel, SendRelease)  # P is still released
    job.on_release_sent(rel.source)
    result = job.next_action(0).result
    assert result.outcome is Outcome.FAILED and result.report_failed
    assert message in result.reason


@pytest.mark.parametrize(("change", "message"), [
    ({"num_blocks": -5}, "beyond the -5 blocks"),
    ({"num_blocks": 0}, "beyond the 0 blocks"),
    ({"tp_rank": -1}, "it is rank -1 (stage 0 of 1, TP rank -1 of 1)"),
    ({"tp_size": 10**9}, "rank 0 of 1000000000"),
    ({"engine_id": "x" * 100_000}, "answers for engine xxx"),
    ({"segment": "10.6.6.6:15000"}, "is not on the host of P rank"),
    ({"protocol_version": -1}, "protocol version: P speaks -1"),
    ({"planes": [PlaneGeometry(1 << 62, 512, 512, 100)] * 2}, ""),  # absurd addresses: the read would go there
])
def test_a_forged_registration_in_a_claim_reply_is_refused_and_the_lease_released(change: dict,
                                                                                  message: str) -> None:
    """A peer answering a claim may send any registration: absurd counts, ranks, engine ids, another host's
    segment. Each is refused before any read (or, for addresses P alone can vouch for, read only from the
    params' host, as for a fetched one); the lease just granted is released with its token; nothing is cached."""
    import msgspec

    job = pull(awaiting_plan())
    job.next_action(0)
    job.with_claim(SRC)
    job.next_action(0)
    forged = msgspec.structs.replace(registration(), **change)
    accepted = job.on_claim_reply(SRC, ClaimReply(ClaimStatus.GRANTED, lease=30, lease_token="tok",
                                                  registration=forged), now=0)
    action = job.next_action(0)
    if not message:  # addresses are P's to state: D reads them from the params' host only, as with a fetch
        assert accepted and isinstance(action, ReadBatch) and action.segment == "127.0.0.1:15000"
        return
    assert not accepted  # the caller caches only an accepted registration
    assert isinstance(action, SendRelease) and action.message.lease_token == "tok" and not action.message.pulled
    job.on_release_sent(action.source)
    result = job.next_action(0).result
    assert result.outcome is Outcome.FAILED and result.failure is Failure.INCOMPATIBLE
    assert message in result.reason and len(result.reason) <= 1010  # a 100,000-character id is not echoed whole


@pytest.mark.parametrize("registration_value", ["not a registration", 7, [1, 2], {"engine_id": 5}])
def test_a_claim_reply_whose_registration_has_the_wrong_type_does_not_decode(registration_value: object) -> None:
    import msgspec

    from vllm_kvp2p.contract.protocol import decode_reply

    raw = msgspec.msgpack.encode({"type": "claim_reply", "status": "granted", "lease": 30.0,
                                  "registration": registration_value})
    with pytest.raises(msgspec.ValidationError):  # the side channel reports it as a bad reply: the claim fails
        decode_reply(raw)


# ----------------------------------------------------------------------------- several P ranks, against P's ledger

P_SHAPE = BlockShape(True, 1, BS, 16)  # a P rank at TP 2 holds one of the 2 heads


def tp2_registration(rank: int) -> RankRegistration:
    return RankRegistration("P", rank, 2, "127.0.0.1:15000",
                            [PlaneGeometry((1 << 30) + rank * (1 << 28) + i * 1_000_000, 256, 256, 100)
                             for i in range(2)], [P_SHAPE] * 2, ["l0", "l1"], BS, 100, "float32", 1, 2, 8)


def tp2_sources() -> list[Source]:
    """D at TP 1 reading P at TP 2: one head from each P rank."""
    mapping = rank_plan(Layout(2, 2), Layout(1, 2), 0)
    return [Source(q, mapping.expected_readers[q], tuple(s for s in mapping.reads if s.p_rank == q))
            for q in mapping.p_ranks]


def tp2_pull(*, max_batch_entries: int = 1024, **kw: object) -> ConsumerPull:
    remote = RemotePrefill.from_params({**params(), "tp_size": 2})
    plan = PullPlan("d1", remote, ((3, 4, 9),), ((10, 11, 12),), awaiting=True)
    return ConsumerPull(plan, tp2_sources(), "d:0", LOCAL, claim_wait=60.0, max_batch_entries=max_batch_entries,
                        now=0.0, **kw)


def claim_and_read_rank_0(job: ConsumerPull, lease: float = 3.0, token: str = "t0") -> None:
    """Rank 0 claimed at t=0 (renewal due at lease/3) and all read by t=0.1."""
    rank0 = tp2_sources()[0]
    assert isinstance(job.next_action(0.0), FetchRegistration)
    assert job.on_registration(rank0, tp2_registration(0))
    assert isinstance(job.next_action(0.0), SendClaim)
    job.on_claim_reply(rank0, ClaimReply(ClaimStatus.GRANTED, lease=lease, lease_token=token), now=0.0)
    while isinstance(action := job.next_action(0.1), ReadBatch) and action.source == rank0:
        job.on_batch_done(rank0, True)


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


def run_against_p(job: ConsumerPull, ledgers: dict[int, ProducerLedger], *, read_seconds: dict[int, float],
                  renew_reaches_p: float = 0.0, read_from: float = 0.0,
                  renewals_lost: tuple[int, ...] = ()) -> PullResult:
    """Drive ``job`` on a simulated clock against each P rank's real ledger (their hold "hold" of "p-req"). A read
    from rank r takes ``read_seconds[r]``; the first starts no earlier than ``read_from`` (its read slot was busy);
    a renewal reaches P ``renew_reaches_p`` after it is sent. Renewals of ``renewals_lost`` ranks never reach P
    (the adapter feeds back a grant: what D's state machine did when it renewed only the rank being read)."""
    now = 0.0
    for _ in range(100_000):
        for ledger in ledgers.values():
            ledger.expire(now)
        action = job.next_action(now)
        if isinstance(action, Finish):
            return action.result
        if isinstance(action, Wait):
            now = action.until
            continue
        source = action.source
        ledger = ledgers[source.p_rank]
        if isinstance(action, FetchRegistration):
            job.on_registration(source, tp2_registration(source.p_rank))
        elif isinstance(action, SendClaim):
            m = action.message
            job.on_claim_reply(source, ledger.claim(m.request_id, m.hold_id, m.reader, m.expected_readers, now,
                                                    m.claim_id), now)
        elif isinstance(action, SendRenew):
            m = action.message
            if source.p_rank in renewals_lost:
                job.on_renewed(source, ClaimReply(ClaimStatus.GRANTED, ledger.lease_timeout, "", m.lease_token), now)
                continue
            now += renew_reaches_p
            ledger.expire(now)
            job.on_renewed(source, ledger.renew(m.request_id, m.hold_id, m.reader, now, m.lease_token), now)
        elif isinstance(action, ReadBatch):
            now = max(now, read_from) + read_seconds[source.p_rank]
            job.on_batch_done(source, True)
        else:
            m = action.message
            job.on_release_sent(source, ledger.release(m.request_id, m.hold_id, m.reader, m.expected_readers, now,
                                                       m.lease_token, m.pulled))
    raise AssertionError("the pull did not finish")


def held_ledgers(lease_timeout: float, ranks: int = 2) -> dict[int, ProducerLedger]:
    ledgers = {r: ProducerLedger(hold_timeout=600.0, lease_timeout=lease_timeout) for r in range(ranks)}
    for ledger in ledgers.values():
        ledger.hold("p-req", "hold", 0.0, 3)
    return ledgers


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


# ----------------------------------------------------------------------------- a crash of the pull thread


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
