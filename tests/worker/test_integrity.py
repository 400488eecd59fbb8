"""The integrity digest between two real Mooncake engines (vllm_kvp2p/lifecycle/integrity.py): every unit D read is
summed on both sides and compared in the release's round trip; a byte changed on its way fails the pull as
``corrupted``, naming the layer and P's block, while without the digest the same pull counts as good."""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import pytest
import torch

from tests.worker.test_pull_two_engines import NUM_LAYERS, Pair
from tests.worker.test_trust_boundaries import raw_request
from vllm_kvp2p.lifecycle.consumer import Failure
from vllm_kvp2p.lifecycle.integrity import IntegrityMode
from vllm_kvp2p.lifecycle.pull import Outcome
from vllm_kvp2p.protocol import MAX_DIGEST_UNITS, Claim, ClaimStatus, ErrorReply, Release, Released, decode_reply
from vllm_kvp2p.side_channel import SideChannelClient


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    p = Pair(integrity=IntegrityMode.FULL)
    yield p
    p.close()


@pytest.fixture
def flip_one_read_byte(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """D's engine changes one byte of what it read (the first byte of the last descriptor of each batch): what a
    faulty link, NIC or allocator does to a transfer that reports success."""
    flipped: list[int] = []
    read = pair.d_engine.read

    def faulty_read(segment, descriptors):
        stats = read(segment, descriptors)
        addr = descriptors.local_addrs[-1]
        for t in pair.d_kv.values():
            start = t.data_ptr()
            if start <= addr < start + t.numel() * t.element_size():
                view = t.view(-1).view(torch.uint8)
                view[addr - start] ^= 0x40
                flipped.append(addr)
                break
        return stats

    monkeypatch.setattr(pair.d_engine, "read", faulty_read)
    return flipped


def pull(pair: Pair, request_id: str, remote_ids: list[int], local_ids: list[int]):
    pair.holds.hold(request_id, "h1", len(remote_ids))
    pair.pulls.submit(pair.plan(request_id, remote_ids, local_ids))
    return pair.wait_result()


def test_every_unit_of_a_good_pull_is_verified(pair: Pair) -> None:
    result = pull(pair, "good", [3, 4, 9], [0, 1, 2])
    assert result.outcome is Outcome.PULLED, result.reason
    assert result.verified_units == 3 * NUM_LAYERS and not result.unverified


def test_one_flipped_byte_fails_the_pull_as_corrupted(pair: Pair, flip_one_read_byte: list[int]) -> None:
    result = pull(pair, "bad", [5, 6, 7, 12], [4, 5, 6, 7])
    assert flip_one_read_byte, "the faulty read did not change a byte"
    assert result.outcome is Outcome.FAILED and result.failure is Failure.CORRUPTED, result
    assert "differ from P's" in result.reason and "layer model.layers." in result.reason and "P block" in result.reason


def test_without_the_digest_the_same_corruption_counts_as_a_good_pull(pair: Pair,
                                                                      flip_one_read_byte: list[int]) -> None:
    pair.pulls.integrity = IntegrityMode.OFF
    try:
        result = pull(pair, "unchecked", [5, 6, 7, 12], [8, 9, 10, 11])
    finally:
        pair.pulls.integrity = IntegrityMode.FULL
    assert flip_one_read_byte
    assert result.outcome is Outcome.PULLED and result.verified_units == 0  # nothing would have noticed


def test_a_p_that_answers_no_question_leaves_the_pull_unverified_not_failed(pair: Pair) -> None:
    digester, pair.holds._digester = pair.holds._digester, None  # an older P: ignores the question
    try:
        result = pull(pair, "old-p", [1, 2], [12, 13])
    finally:
        pair.holds._digester = digester
    assert result.outcome is Outcome.PULLED and result.unverified and result.verified_units == 0


def test_sampled_mode_verifies_a_few_units_and_the_last(pair: Pair) -> None:
    pair.pulls.integrity = IntegrityMode.SAMPLED
    try:
        result = pull(pair, "sampled", list(range(20, 30)), list(range(14, 24)))
    finally:
        pair.pulls.integrity = IntegrityMode.FULL
    assert result.outcome is Outcome.PULLED and result.verified_units == 4 + 1, result


# ------------------------------------------------------------------ what a peer may send, on either side

def claimed(pair: Pair, request_id: str, blocks: int = 2) -> str:
    """A hold on P of ``blocks`` blocks and a live lease on it, claimed the way a D does: its lease token."""
    pair.holds.hold(request_id, "h1", blocks)
    client = SideChannelClient(5.0)
    try:
        reply = client.request("127.0.0.1", pair.port, Claim(request_id, "h1", "peer:0", 1, "c-" + request_id))
    finally:
        client.close()
    assert reply.status is ClaimStatus.GRANTED, reply
    return reply.lease_token


HOSTILE_QUESTIONS = {
    "no such plane": [[10**6, 0, [0, 16]]],
    "negative block": [[0, -5, [0, 16]]],
    "block past the plane": [[0, 10**9, [0, 16]]],
    "a 2**64 - 1 block": [[0, 2**64 - 1, [0, 16]]],
    "a -2**63 offset, a 2**64 - 1 length": [[0, 0, [-(2**63), 2**64 - 1]]],
    "range past the block": [[0, 0, [0, 2**62]]],
    "negative offset": [[0, 0, [-8, 16]]],
    "empty range": [[0, 0, [4, 0]]],
    "odd range list": [[0, 0, [0, 16, 32]]],
    "more units than the hold has": [[0, b % 8, [0, 16]] for b in range(200)],
}
UNDECODABLE_QUESTIONS = {
    "over the wire's unit bound": [[0, 0, [0, 16]]] * (MAX_DIGEST_UNITS + 1),
    "text for numbers": [["zéro", "ブロック", ["\u0000", "🙂"]]],
    "floats": [[0.5, 1.5, [0.0, 16.0]]],
    "not a list": "all of it",
}


@pytest.mark.parametrize("name", list(HOSTILE_QUESTIONS))
def test_a_hostile_question_is_left_unanswered_and_the_release_still_counts(pair: Pair, name: str) -> None:
    """P answers no question outside what the reader's hold has: no sums, no exception, and the release itself is
    handled as any other (the lease confirmed, the hold freed)."""
    request_id = "hostile-" + name.replace(" ", "-")
    token = claimed(pair, request_id)
    frame = msgspec.msgpack.encode({"type": "release", "request_id": request_id, "hold_id": "h1", "reader": "peer:0",
                                    "expected_readers": 1, "pulled": True, "lease_token": token,
                                    "verify": [HOSTILE_QUESTIONS[name]]})
    reply = decode_reply(raw_request(pair.port, frame))
    assert isinstance(reply, Released) and reply.lease_held and reply.sums is None, reply
    assert request_id in pair.wait_freed()


@pytest.mark.parametrize("name", list(UNDECODABLE_QUESTIONS))
def test_an_undecodable_question_gets_a_clear_error_and_is_counted(pair: Pair, name: str) -> None:
    request_id = "undecodable-" + name.replace(" ", "-")
    token = claimed(pair, request_id)
    before = pair.holds._server.dropped["undecodable"]
    frame = msgspec.msgpack.encode({"type": "release", "request_id": request_id, "hold_id": "h1", "reader": "peer:0",
                                    "expected_readers": 1, "pulled": True, "lease_token": token,
                                    "verify": [UNDECODABLE_QUESTIONS[name]]})
    reply = decode_reply(raw_request(pair.port, frame))
    assert isinstance(reply, ErrorReply) and reply.message.startswith("undecodable request"), reply
    assert pair.holds._server.dropped["undecodable"] == before + 1
    client = SideChannelClient(5.0)  # the hold is intact: its reader releases it properly
    try:
        released = client.request("127.0.0.1", pair.port, Release(request_id, "h1", "peer:0", 1, True, token))
    finally:
        client.close()
    assert isinstance(released, Released) and released.lease_held


@pytest.mark.parametrize(("answer", "verdict"), [
    (lambda q: [(1, 1)] * len(q.units), "corrupted"),  # forged: sums P never computed
    (lambda q: [(2**63 - 1, -(2**63))] * len(q.units), "corrupted"),  # absurd values
    (lambda q: [(0, 0)] * (len(q.units) - 1), "unverified"),  # one unit short
    (lambda q: [], "unverified"),
    (lambda q: 1 / 0, "unverified"),  # P's digester raises: the release is still answered
], ids=["forged", "absurd", "short", "empty", "raising"])
def test_whatever_p_answers_d_decides_boundedly(pair: Pair, answer, verdict: str) -> None:
    """D counts a read only when P's sums equal its own: forged or absurd sums fail the pull as corrupted, a short
    or missing answer leaves it unverified (never a match), and nothing raises out of the pull."""
    digester, pair.holds._digester = pair.holds._digester, answer
    try:
        result = pull(pair, f"p-answers-{verdict}-{id(answer)}", [1, 2], [26, 27])
    finally:
        pair.holds._digester = digester
    if verdict == "corrupted":
        assert result.outcome is Outcome.FAILED and result.failure is Failure.CORRUPTED, result
    else:
        assert result.outcome is Outcome.PULLED and result.unverified and result.verified_units == 0, result


def test_the_same_many_unit_question_is_answered_for_a_hold_that_big(pair: Pair) -> None:
    """The control of 'more units than the hold has': only the hold's size refused it (a hold of 100 blocks x 3
    planes covers 200 units, and P answers them all)."""
    token = claimed(pair, "big-hold", blocks=100)
    frame = msgspec.msgpack.encode({"type": "release", "request_id": "big-hold", "hold_id": "h1", "reader": "peer:0",
                                    "expected_readers": 1, "pulled": True, "lease_token": token,
                                    "verify": [HOSTILE_QUESTIONS["more units than the hold has"]]})
    reply = decode_reply(raw_request(pair.port, frame))
    assert isinstance(reply, Released) and reply.sums is not None and len(reply.sums) == 200, reply
