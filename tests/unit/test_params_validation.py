"""kv_transfer_params come from any client of D's HTTP API: one verdict (vllm_kvp2p/lifecycle/admission.py)
checks every field before D plans anything, and params that fail a check end the request without any network call
(no claim, and no release unless P's address is valid). Pure, no I/O."""

from __future__ import annotations

import msgspec
import pytest

from tests.support.prompts import prompt, remote, tokens
from vllm_kvp2p.contract.protocol import ClaimReply, ClaimStatus, RankRegistration, RemotePrefill, prompt_digest
from vllm_kvp2p.lifecycle.admission import Admitted, Decoder, Refused, judge
from vllm_kvp2p.lifecycle.consumer import ConsumerSchedule, Failure, PullPlan
from vllm_kvp2p.lifecycle.pull import ConsumerPull, FetchRegistration, Finish, LocalKV, SendClaim, SendRelease, Source
from vllm_kvp2p.transfer.descriptors import PlaneGeometry
from vllm_kvp2p.transfer.kv_groups import FULL, SLIDING, STATE, KVGroup, single_full_group
from vllm_kvp2p.transfer.slicing import BlockShape
from vllm_kvp2p.transfer.tp_mapping import HeadSlice, Layout, rank_plan

BS = 16
PROMPT = 60
DECODER = Decoder(BS, single_full_group(BS))


def good(**change: object) -> dict:
    params = remote([[10, 11, 12, 13]], PROMPT, BS, host="10.0.0.7", port=20000).to_params()
    params.update(change)
    return params


def verdict(params: object, n: int = PROMPT, decoder: Decoder = DECODER, seed: int = 0):
    return judge(params, prompt(n, seed), decoder)


@pytest.mark.parametrize(("change", "field"), [
    ({"tp_size": 2_000_000}, "$.tp_size"),
    ({"tp_size": -3}, "$.tp_size"),
    ({"tp_size": 0}, "$.tp_size"),
    ({"tp_size": "2"}, "$.tp_size"),
    ({"remote_port": 65535, "tp_size": 2}, "remote_port 65535 with 2 rank(s)"),
    ({"remote_port": 0}, "$.remote_port"),
    ({"remote_host": "evil host;rm"}, "remote_host"),
    ({"remote_host": "a" * 300}, "$.remote_host"),
    ({"remote_host": "p-0.prefill.svc.cluster.local"}, "is not an IP address"),
    ({"remote_engine_id": ""}, "$.remote_engine_id"),
    ({"remote_engine_id": None}, "$.remote_engine_id"),
    ({"remote_hold_id": "h" * 10_000}, "$.remote_hold_id"),
    ({"remote_hold_id": "h\ud800"}, "remote_hold_id is not valid Unicode"),
    ({"remote_block_size": 0}, "$.remote_block_size"),
    ({"remote_num_tokens": 10**9}, "remote_num_tokens 1000000000 outside 1..60 (the prompt)"),
    ({"remote_num_tokens": 10**30}, "$.remote_num_tokens"),
    ({"remote_num_tokens": -5}, "$.remote_num_tokens"),
    ({"remote_block_ids": []}, "$.remote_block_ids"),
    ({"remote_block_ids": [[1]] * 65}, "$.remote_block_ids"),
    ({"remote_block_ids": [[-1, -2, -3, -4]]}, "$.remote_block_ids[0][0]"),
    ({"remote_block_ids": [[2**63, 1, 2, 3]]}, "$.remote_block_ids[0][0]"),
    ({"remote_block_ids": [[5, 5, 6, 7]]}, "remote_block_ids[0] repeats a block id"),
    ({"remote_block_ids": [[0, 5, 6, 7]]}, "names block 0 (vLLM's null block)"),
    ({"remote_block_ids": [list(range(1, 200_001))]}, "remote_block_ids[0] has 200000 blocks; 60 tokens in blocks "
                                                      "of 16 need exactly 4"),
    ({"remote_block_ids": [[10]]}, "remote_block_ids[0] has 1 blocks; 60 tokens in blocks of 16 need exactly 4"),
    ({"remote_block_ids": [[10, 11, 12, 13], [1]]}, "KV-cache groups differ: P sent 2, D has 1"),
    ({"remote_block_size": 24}, "block sizes incompatible: P uses 24, D uses 16"),
    ({"remote_prompt_digest": ""}, "remote_prompt_digest is missing"),
    ({"remote_prompt_digest": prompt_digest(tokens(PROMPT, seed=1))}, "remote_prompt_digest does not match"),
    ({"remote_block_ids": {"0": [1]}}, "$.remote_block_ids"),
    ({"do_remote_decode": "no"}, "$.do_remote_decode"),
])
def test_each_bad_field_is_named_and_refused(change: dict, field: str) -> None:
    refused = verdict(good(**change))
    assert isinstance(refused, Refused) and field in refused.reason, refused
    assert refused.failure is Failure.INVALID_PARAMS


def test_good_params_pass() -> None:
    assert verdict(good()) == Admitted(RemotePrefill.from_params(good()), PROMPT)
    assert isinstance(verdict(good(remote_host="fd00::7")), Admitted)
    # Out of P's range, but only P's registration knows: refused at pull time (descriptors), not here.
    assert isinstance(verdict(good(remote_block_ids=[[2**62 - 4, 2**62 - 3, 2**62 - 2, 2**62 - 1]])), Admitted)
    assert verdict({"do_remote_decode": True}) is None and verdict(None) is None and verdict([1]) is None


def test_params_bind_the_prompt_they_were_issued_for() -> None:
    """Params for prompt A sent with prompt B (a client, or a router mixing up requests): refused before anything
    is contacted (A's request may still claim the hold). Without the binding they were planned and read."""
    params = good()
    other = verdict(params, seed=1)
    assert isinstance(other, Refused) and "remote_prompt_digest does not match" in other.reason
    assert not other.contact_p  # the hold is another request's: D neither reads nor releases it
    longer = verdict(params, n=PROMPT + 40)  # B starts with A: P's KV of A's tokens is B's too
    assert isinstance(longer, Admitted) and longer.load_end == PROMPT
    unbound = {k: v for k, v in params.items() if k != "remote_prompt_digest"}
    assert isinstance(verdict(unbound, seed=1), Refused)
    # Without the digest check, B's request was admitted with A's KV (the bug this closes):
    assert RemotePrefill.from_params(unbound) is not None and len(params["remote_block_ids"][0]) == 4


@pytest.mark.parametrize(("groups", "lists", "n", "ok"), [
    # 60 tokens, window 40: vLLM skips tokens 0..20, so the window's blocks are 1..3 (3 of the prompt's 4)
    ((KVGroup(FULL, BS), KVGroup(SLIDING, BS, 40)), [[1, 2, 3, 4], [2, 3, 4]], 60, True),
    ((KVGroup(FULL, BS), KVGroup(SLIDING, BS, 40)), [[1, 2, 3, 4], [1, 2, 3, 4]], 60, False),
    ((KVGroup(FULL, BS), KVGroup(SLIDING, BS, 40)), [[1, 2, 3, 4], [3, 4]], 60, False),
    ((KVGroup(SLIDING, BS, 40),), [[3, 4]], 20, True),
    ((KVGroup(SLIDING, BS, 40),), [[4]], 20, False),
    ((KVGroup(STATE, BS), KVGroup(FULL, BS)), [[7], [1, 2, 3, 4]], 59, True),
    ((KVGroup(STATE, BS), KVGroup(FULL, BS)), [[7, 8], [1, 2, 3, 4]], 59, False),
    ((KVGroup(STATE, BS), KVGroup(FULL, BS)), [[], [1, 2, 3, 4]], 59, False),
])
def test_every_group_offers_exactly_what_vllm_allocates(groups, lists, n, ok) -> None:
    decoder = Decoder(BS, groups)
    result = verdict(remote(lists, n, BS).to_params(), n=PROMPT, decoder=decoder)
    assert isinstance(result, Admitted if ok else Refused), result


def test_invalid_params_fail_the_plan_without_contacting_anyone() -> None:
    s = ConsumerSchedule(BS)
    bad = good(tp_size=2_000_000)
    # vLLM is asked to wait, so that its kv_load_failure_policy ends the request (recompute, or an error).
    assert s.matched_tokens("d1", bad, prompt(PROMPT), 0) == (PROMPT - 1, True)
    plan = s.on_alloc("d1", bad, PROMPT - 1, [[1, 2, 3, 4]], 0, prompt(PROMPT))
    assert plan is not None and plan.awaiting and not plan.contact_p
    assert plan.error.startswith("invalid kv_transfer_params: ") and "$.tp_size" in plan.error
    assert s.on_finished("d2", bad, prompt(PROMPT)) is None  # a request that never got blocks: no release either
    # Params whose address is valid but whose content is not: nothing is read, but P is released.
    content = good(remote_block_ids=[[10, 10, 11, 12]])
    readable = s.on_alloc("d3", content, PROMPT - 1, [[1, 2, 3, 4]], 0, prompt(PROMPT))
    assert readable is not None and readable.contact_p and "repeats a block id" in readable.error
    released = s.on_finished("d4", content, prompt(PROMPT))
    assert released is not None and not released.awaiting and released.num_blocks == 0

    shape = BlockShape(True, 2, BS, 16)
    local = LocalKV((PlaneGeometry(1 << 20, 512, 512, 100),), (shape,), BS, ("l0",), "float32", 2)
    job = ConsumerPull(plan, [Source(0)], "d:0", local, claim_wait=1.0, max_batch_entries=64, now=0.0)
    action = job.next_action(0.0)
    assert isinstance(action, Finish)  # no registration, claim or release: nothing goes out
    assert action.result.report_failed and "$.tp_size" in action.result.reason
    assert action.result.failure is Failure.INVALID_PARAMS


def test_without_the_check_one_request_would_make_d_release_every_rank_it_names() -> None:
    """What the tp_size bound prevents: D derives the P ranks to release from the params' tp_size alone."""
    mapping = rank_plan(Layout(100_000, 8, False), Layout(1, 8, False), 0)
    assert len(mapping.p_ranks) == 100_000  # one side-channel round trip (up to its timeout) each


# --------------------------------------------------------------------------- at pull time

SHAPE = BlockShape(True, 2, BS, 16)
LOCAL = LocalKV((PlaneGeometry(1 << 20, 512, 512, 100),), (SHAPE,), BS, ("l0",), "float32", 2,
                model_fingerprint="model-a")


def registration(**change: object) -> RankRegistration:
    reg = RankRegistration("P", 0, 1, "10.0.0.7:16001", [PlaneGeometry(1 << 30, 512, 512, 100)], [SHAPE], ["l0"],
                           BS, 100, "float32", 2, 2, 16, incarnation="inc1", model_fingerprint="model-a")
    return msgspec.structs.replace(reg, **change)


def pull(**params: object) -> ConsumerPull:
    remote_params = RemotePrefill.from_params(good(remote_incarnation="inc1", **params))
    ids = tuple(remote_params.remote_block_ids[0])
    plan = PullPlan("d1", remote_params, ((1, 2, 3, 4),), (ids,), awaiting=True)
    job = ConsumerPull(plan, [Source(0, 1, (HeadSlice(0, 0, 0, 2),))], "d:0", LOCAL, claim_wait=1.0,
                       max_batch_entries=64, now=0.0)
    assert isinstance(job.next_action(0.0), FetchRegistration)
    return job


@pytest.mark.parametrize(("change", "params", "reason"), [
    ({}, {}, ""),
    ({"protocol_version": 2}, {}, "protocol version: P speaks 2"),
    ({"engine_id": "Q"}, {}, "answers for engine Q, the params name engine P"),
    ({"incarnation": "inc0"}, {}, "P restarted: the params are from incarnation inc1, its side channel serves inc0"),
    ({"tp_size": 2}, {}, "TP rank 0 of 2), the params name rank 0 of tp_size 1 x pp_size 1"),
    ({"segment": "10.6.6.6:16001"}, {}, "Mooncake segment '10.6.6.6:16001' is not on the host of P rank"),
    ({"model_fingerprint": "model-b"}, {}, "model: P serves fingerprint model-b, D model-a"),
    ({}, {"remote_block_ids": [[10, 11, 12, 100]]}, "the params name blocks beyond the 100 blocks of P rank 0"),
    ({"block_size": BS * 2}, {}, f"block size: the params say P's blocks hold {BS} tokens, P rank 0 registers "
                                 f"blocks of {BS * 2}"),
])
def test_a_registration_is_checked_against_the_params_and_this_d(change: dict, params: dict, reason: str) -> None:
    job = pull(**params)
    source = Source(0, 1, (HeadSlice(0, 0, 0, 2),))
    accepted = job.on_registration(source, registration(**change))
    assert accepted is (not reason)  # only an accepted registration may be cached
    if reason:
        assert job.failed and reason in job._failure


def test_an_unanswered_release_stops_the_releases_to_that_p() -> None:
    """Addressable params naming 1024 ranks of a P that does not answer: one release times out, the other 1023
    are not tried (each would wait for the side-channel timeout)."""
    plan = ConsumerSchedule(BS).on_finished("d1", good(tp_size=1024), prompt(PROMPT))
    assert plan is not None and plan.contact_p
    job = ConsumerPull(plan, [Source(r) for r in range(1024)], "d:0", LOCAL, claim_wait=1.0, max_batch_entries=64,
                       now=0.0)
    sent = 0
    for _ in range(2000):
        action = job.next_action(0.0)
        if isinstance(action, Finish):
            break
        sent += 1
        job.on_release_failed(action.source)
    assert sent == 1
    # Without the rule every rank would be tried: releases that are answered go on to the next rank.
    answered = ConsumerPull(plan, [Source(r) for r in range(1024)], "d:0", LOCAL, claim_wait=1.0,
                            max_batch_entries=64, now=0.0)
    count = 0
    while not isinstance(action := answered.next_action(0.0), Finish):
        answered.on_release_sent(action.source)
        count += 1
    assert count == 1024


def test_one_deadline_bounds_the_whole_pull_and_its_releases() -> None:
    """P keeps answering "not yet" (or a client's params keep D busy): at pull_timeout the pull fails; the
    releases then get side_channel_timeout more, and past that none is sent."""
    plan = PullPlan("d1", RemotePrefill.from_params(good(tp_size=4)), ((1, 2, 3, 4),), ((10, 11, 12, 13),),
                    awaiting=True)
    sources = [Source(0, 1, (HeadSlice(0, 0, 0, 2),))] + [Source(r) for r in (1, 2, 3)]
    job = ConsumerPull(plan, sources, "d:0", LOCAL, claim_wait=1e9, max_batch_entries=64, now=0.0, timeout=20.0,
                       release_timeout=5.0)
    assert job.time_left(3.0) == 17.0
    t = 0.0
    job.next_action(t)
    assert job.on_registration(sources[0], registration(incarnation="", tp_size=4))
    while t < 20.0:  # P answers every claim with "unknown hold": D would retry until claim_wait
        action = job.next_action(t)
        if isinstance(action, SendClaim):
            job.on_claim_reply(sources[0], ClaimReply(ClaimStatus.UNKNOWN), t)
        t += 0.5
    action = job.next_action(20.0)
    assert isinstance(action, SendRelease) and "pull_timeout=20s" in job._failure
    assert job.time_left(21.0) == 4.0  # the releases' own budget
    job.on_release_sent(action.source)
    finish = job.next_action(26.0)
    assert isinstance(finish, Finish)  # past it: the other ranks' releases are not sent
    assert finish.result.failure is Failure.TIMEOUT


def read_then_release(lease_held: bool | None) -> Finish:
    """A pull that read its one batch; P answers the release with ``lease_held`` (None: no answer)."""
    job = pull()
    source = Source(0, 1, (HeadSlice(0, 0, 0, 2),))
    assert job.on_registration(source, registration())
    job.on_claim_reply(source, ClaimReply(ClaimStatus.GRANTED, 60.0, lease_token="t"), 0.0)
    while not isinstance(action := job.next_action(0.0), SendRelease):
        job.on_batch_done(source, True)
    assert action.message.pulled and action.message.lease_token == "t"
    if lease_held is None:
        job.on_release_failed(source)
    else:
        job.on_release_sent(source, lease_held)
    finish = job.next_action(0.0)
    assert isinstance(finish, Finish)
    return finish


def test_a_read_counts_only_when_p_confirms_the_lease_held() -> None:
    assert read_then_release(True).result.outcome.value == "pulled"
    lost = read_then_release(False).result
    assert lost.report_failed and lost.failure is Failure.LEASE_LOST and "did not confirm" in lost.reason
    unanswered = read_then_release(None).result
    assert unanswered.report_failed and unanswered.failure is Failure.UNREACHABLE
