"""P's registration in D's pull: fetched, or sent with the claim's reply (one round trip less; an older P that ignores
the request is asked after the claim), and checked before any read either way: an incompatible geometry is refused
with both values, a forged one in a claim reply is refused and the lease just granted released with its token, a
reply whose registration has the wrong type does not decode. Pure, no I/O."""

from __future__ import annotations

import msgspec
import pytest

from tests.unit.consumer_pulls import BS, SRC, awaiting_plan, pull, registration
from vllm_kvp2p.contract.protocol import ClaimReply, ClaimStatus
from vllm_kvp2p.lifecycle.consumer import Failure
from vllm_kvp2p.lifecycle.pull import FetchRegistration, Outcome, ReadBatch, SendClaim, SendRelease
from vllm_kvp2p.transfer.descriptors import PlaneGeometry
from vllm_kvp2p.transfer.slicing import BlockShape


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

    from vllm_kvp2p.contract.protocol import decode_reply

    raw = msgspec.msgpack.encode({"type": "claim_reply", "status": "granted", "lease": 30.0,
                                  "registration": registration_value})
    with pytest.raises(msgspec.ValidationError):  # the side channel reports it as a bad reply: the claim fails
        decode_reply(raw)
