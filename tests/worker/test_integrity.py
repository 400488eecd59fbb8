"""The integrity digest between two real Mooncake engines (vllm_kvp2p/lifecycle/integrity.py): every unit D read is
summed on both sides and compared in the release's round trip; a byte changed on its way fails the pull as
``corrupted``, naming the layer and P's block, while without the digest the same pull counts as good."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.worker.test_pull_two_engines import NUM_LAYERS, Pair
from vllm_kvp2p.lifecycle.consumer import Failure
from vllm_kvp2p.lifecycle.integrity import IntegrityMode
from vllm_kvp2p.lifecycle.pull import Outcome


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
