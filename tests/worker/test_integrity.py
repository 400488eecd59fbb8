"""The integrity digest between two real Mooncake engines (vllm_kvp2p/lifecycle/integrity.py): every unit D read is
summed on both sides and compared in the release's round trip; a byte changed on its way fails the pull as
``corrupted``, naming the layer and P's block, while without the digest the same pull counts as good."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence

import msgspec
import pytest
import torch

from tests.worker.test_pull_two_engines import NUM_LAYERS, Pair
from tests.worker.test_trust_boundaries import raw_request
from vllm_kvp2p.contract.protocol import (
    MAX_DIGEST_UNITS,
    Claim,
    ClaimStatus,
    ErrorReply,
    Release,
    Released,
    Renew,
    decode_reply,
)
from vllm_kvp2p.contract.side_channel import SideChannelClient
from vllm_kvp2p.lifecycle import integrity
from vllm_kvp2p.lifecycle.consumer import Failure
from vllm_kvp2p.lifecycle.integrity import IntegrityMode
from vllm_kvp2p.lifecycle.pull import Outcome
from vllm_kvp2p.transfer.digest import digest_reference


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
    pair.holds.hold(request_id, "h1", len(remote_ids), [remote_ids])
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

def claimed(pair: Pair, request_id: str, blocks: Sequence[int] = (0, 1)) -> str:
    """A hold on P offering ``blocks`` and a live lease on it, claimed the way a D does: its lease token."""
    pair.holds.hold(request_id, "h1", len(blocks), [list(blocks)])
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
    "more units than the hold has": [[p, b, [0, 16]] for p in range(NUM_LAYERS) for b in range(8)],
    "a block outside the hold": [[0, 20, [0, 16]]],
    "overlapping ranges": [[0, 0, [0, 16, 8, 16]]],
    "a range twice": [[0, 1, [0, 16, 0, 16]]],
    "ranges out of order": [[0, 1, [32, 16, 0, 16]]],
    "a unit twice": [[0, 0, [0, 16]], [0, 0, [16, 16]]],
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


def test_the_same_many_unit_question_is_answered_for_a_hold_of_those_blocks(pair: Pair) -> None:
    """The control of 'more units than the hold has': a hold offering blocks 0..7 covers those 24 units (8 blocks x 3
    planes, each named once), and P answers them all."""
    token = claimed(pair, "big-hold", blocks=range(8))
    reply = release_asking(pair, "big-hold", token, HOSTILE_QUESTIONS["more units than the hold has"])
    assert isinstance(reply, Released) and reply.sums is not None and len(reply.sums) == 24, reply


# ------------------------------------------------------------------ each of P's rules, and the attack without it

def release_asking(pair: Pair, request_id: str, token: str, question: list, timeout_ms: int = 30_000) -> object:
    """A release carrying ``question`` (raw units: [plane, block, [offset, length, ...]]) by the lease's reader."""
    frame = msgspec.msgpack.encode({"type": "release", "request_id": request_id, "hold_id": "h1", "reader": "peer:0",
                                    "expected_readers": 1, "pulled": True, "lease_token": token,
                                    "verify": [question]})
    return decode_reply(raw_request(pair.port, frame, timeout_ms=timeout_ms))


def without(monkeypatch: pytest.MonkeyPatch, *rules: Callable) -> None:
    """P's question rules with ``rules`` dropped: the attack each one stops."""
    monkeypatch.setattr(integrity, "QUESTION_RULES", tuple(r for r in integrity.QUESTION_RULES if r not in rules))


def block_bytes(pair: Pair, plane: int, block: int) -> bytes:
    """P's bytes of one block of one plane, read from its KV tensors (plane i: layer i's tensor, dense)."""
    geometry = pair.holds.registration.planes[plane]
    (tensor,) = [t for t in pair.p_kv.values() if t.data_ptr() == geometry.base_addr]
    return tensor[block].contiguous().view(torch.uint8).flatten().numpy().tobytes()[:geometry.block_bytes]


def test_a_block_outside_the_hold_is_refused_and_without_the_rule_two_bytes_of_anothers_kv_leak(
        pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    pair.holds.hold("victim", "h1", 2, [[20, 21]])  # another request's hold: the attacker never claimed it
    o = 1000
    question = [[0, 20, [o, 1, o + 1, 1]]]
    reply = release_asking(pair, "attacker", claimed(pair, "attacker"), question)
    assert isinstance(reply, Released) and reply.lease_held and reply.sums is None, reply
    assert pair.holds.counters()["integrity_question_refused"] >= 1

    without(monkeypatch, integrity._inside_the_hold)
    reply = release_asking(pair, "attacker-2", claimed(pair, "attacker-2"), question)
    assert isinstance(reply, Released) and reply.sums is not None, reply
    (sums,) = reply.sums
    b = sums.weighted - (o + 1) * sums.total  # total = a + b, weighted = (o + 1) a + (o + 2) b
    a = sums.total - b
    victim = block_bytes(pair, 0, 20)
    assert (a, b) == (victim[o], victim[o + 1])  # the victim's KV, byte for byte


@pytest.mark.parametrize("ranges", [[0, 64, 32, 64], [0, 64, 0, 64]], ids=["overlapping", "repeated"])
def test_overlapping_or_repeated_ranges_are_refused_and_without_the_rule_summed_twice(
        pair: Pair, monkeypatch: pytest.MonkeyPatch, ranges: list[int]) -> None:
    rid = f"overlap-{ranges[2]}"
    reply = release_asking(pair, rid, claimed(pair, rid), [[0, 1, ranges]])
    assert isinstance(reply, Released) and reply.lease_held and reply.sums is None, reply

    without(monkeypatch, integrity._ranges_sorted_and_disjoint)
    reply = release_asking(pair, rid + "-again", claimed(pair, rid + "-again"), [[0, 1, ranges]])
    offsets = [o for start, n in zip(ranges[::2], ranges[1::2]) for o in range(start, start + n)]
    assert isinstance(reply, Released) and reply.sums is not None, reply
    assert (reply.sums[0].total, reply.sums[0].weighted) == digest_reference(block_bytes(pair, 0, 1), offsets)


def test_a_unit_named_twice_is_refused_and_without_the_rule_summed_twice(pair: Pair,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    whole = pair.holds.registration.planes[0].block_bytes
    question = [[0, 1, [0, whole]], [0, 1, [0, whole]]]
    reply = release_asking(pair, "twice", claimed(pair, "twice"), question)
    assert isinstance(reply, Released) and reply.lease_held and reply.sums is None, reply

    without(monkeypatch, integrity._units_distinct)
    reply = release_asking(pair, "twice-again", claimed(pair, "twice-again"), question)
    assert isinstance(reply, Released) and reply.sums is not None and reply.sums[0] == reply.sums[1], reply


def test_bytes_over_the_holds_are_refused_by_the_bound_alone_and_without_it_p_sums_them(
        pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """One 60 KiB frame: a block of the hold asked 15,000 times over, ~117 MiB of sums for a hold of 2 blocks x 3
    planes (48 KiB). The bound refuses it even with the rules against overlaps and repeats dropped."""
    whole = pair.holds.registration.planes[0].block_bytes
    question = [[0, 1, [0, whole] * 15_000]]
    without(monkeypatch, integrity._ranges_sorted_and_disjoint, integrity._units_distinct)
    reply = release_asking(pair, "many-bytes", claimed(pair, "many-bytes"), question)
    assert isinstance(reply, Released) and reply.lease_held and reply.sums is None, reply

    without(monkeypatch, integrity._bytes_within_the_hold)
    start = time.monotonic()
    reply = release_asking(pair, "many-bytes-again", claimed(pair, "many-bytes-again"), question)
    took = time.monotonic() - start
    assert isinstance(reply, Released) and reply.sums is not None, reply
    one = digest_reference(block_bytes(pair, 0, 1))
    assert (reply.sums[0].total, reply.sums[0].weighted) == (15_000 * one[0], 15_000 * one[1])
    print(f"without the bound: {15_000 * whole / 2**20:.0f} MiB summed for one frame in {took:.2f} s")


def test_an_honest_claim_is_answered_at_once_while_a_maximal_question_is_summed(pair: Pair) -> None:
    """A question at every bound (every unit of a 30-block hold, whole) whose sums take 3 s (the digester slowed:
    what a 2 GiB question costs a CPU): meanwhile another D's claim, renewal and question-less release of another
    hold are answered at once, and the question's own release once its sums are done."""
    digester, started = pair.holds._digester, threading.Event()

    def slow(query):
        started.set()
        time.sleep(3.0)
        return digester(query)

    blocks = list(range(10, 40))
    whole = pair.holds.registration.planes[0].block_bytes
    question = [[p, b, [0, whole]] for p in range(NUM_LAYERS) for b in blocks]
    token = claimed(pair, "hostile-max", blocks=blocks)
    pair.holds._digester = slow
    answers: list[tuple[object, float]] = []
    t0 = time.monotonic()
    asking = threading.Thread(target=lambda: answers.append(
        (release_asking(pair, "hostile-max", token, question), time.monotonic() - t0)))
    try:
        asking.start()
        assert started.wait(5), "the question was not summed"
        pair.holds.hold("honest", "h1", 2, [[2, 3]])
        client = SideChannelClient(5.0)
        try:
            start = time.monotonic()
            claim = client.request("127.0.0.1", pair.port, Claim("honest", "h1", "d:7", 1, "c-honest"))
            claim_took = time.monotonic() - start
            assert claim.status is ClaimStatus.GRANTED, claim
            renewal = client.request("127.0.0.1", pair.port, Renew("honest", "h1", "d:7", claim.lease_token))
            released = client.request("127.0.0.1", pair.port, Release("honest", "h1", "d:7", 1, True,
                                                                       claim.lease_token))
            all_took = time.monotonic() - start
        finally:
            client.close()
        assert renewal.status is ClaimStatus.GRANTED and isinstance(released, Released) and released.lease_held
        assert claim_took < 0.5 and all_took < 1.0, (claim_took, all_took)  # the sums take 3 s
        assert not answers  # still summing
        assert pair.holds.table_sizes()["questions_waiting"] == 1  # the soak's idle check sees a stuck one
        asking.join(10)
    finally:
        pair.holds._digester = digester
    reply, took = answers[0]
    assert isinstance(reply, Released) and reply.sums is not None and len(reply.sums) == len(question), reply
    assert took >= 3.0
    assert pair.holds.table_sizes()["questions_waiting"] == 0
