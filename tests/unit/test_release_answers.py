"""The answers P keeps for resent releases (ProducerLedger.answer_release, issue 37 item 5): the release that ends a
reader's lease is answered its sums, and the same release sent again (D resends after 0.5 s on a fresh socket) gets
the same sums, not a sum-less answer; a copy whose answer is no longer kept says so (``sums_lost``); the kept
answers stay within their bounds. Pure: the ledger alone."""

from __future__ import annotations

import pytest

from vllm_kvp2p.contract.protocol import ClaimStatus, DigestQuery, UnitRanges, UnitSums
from vllm_kvp2p.lifecycle.integrity import Verdict, judge
from vllm_kvp2p.lifecycle.producer import ProducerLedger
from vllm_kvp2p.lifecycle.release_answers import ReleaseAnswer

QUESTION = b"fingerprint-of-the-release"
SUMS = b"the-sums"


def claimed(ledger: ProducerLedger, request_id: str = "r", readers: tuple[str, ...] = ("d:0",)) -> dict[str, str]:
    """A hold of ``request_id`` claimed by every reader; their lease tokens."""
    ledger.hold(request_id, "h", 0.0, 2, ((0, 1),))
    tokens = {}
    for reader in readers:
        reply = ledger.claim(request_id, "h", reader, len(readers), 0.0, "c-" + reader)
        assert reply.status is ClaimStatus.GRANTED
        tokens[reader] = reply.lease_token
    return tokens


def release(ledger: ProducerLedger, token: str, request_id: str = "r", reader: str = "d:0", readers: int = 1,
            question: bytes = QUESTION, sums: bytes | None = None, now: float = 1.0) -> ReleaseAnswer:
    return ledger.answer_release(request_id, "h", reader, readers, now, token, True, question=question, sums=sums)


def test_the_same_release_again_gets_the_sums_of_the_first_after_the_hold_is_gone() -> None:
    ledger = ProducerLedger(30, 30)
    token = claimed(ledger)["d:0"]
    assert release(ledger, token, sums=SUMS) == ReleaseAnswer(True, SUMS)
    assert ledger.state("r") is not None and ledger.state("r").final  # a tombstone now
    # The copy finds no lease (the first ended it) and the adapter has no sums for it: the kept ones.
    assert release(ledger, token, sums=None, now=2.0) == ReleaseAnswer(True, SUMS)
    assert release(ledger, token, sums=None, now=3.0) == ReleaseAnswer(True, SUMS)  # as often as it comes


def test_the_same_release_again_gets_the_sums_while_other_readers_still_hold_the_hold() -> None:
    ledger = ProducerLedger(30, 30)
    tokens = claimed(ledger, readers=("d:0", "d:1"))
    assert release(ledger, tokens["d:0"], readers=2, sums=SUMS) == ReleaseAnswer(True, SUMS)
    assert not ledger.state("r").final
    assert release(ledger, tokens["d:0"], readers=2) == ReleaseAnswer(True, SUMS)


def test_a_first_answer_without_sums_is_repeated_without_sums_not_lost() -> None:
    """P answered the first copy no sums (no digester, a question refused, too many waiting): so is the copy."""
    ledger = ProducerLedger(30, 30)
    token = claimed(ledger)["d:0"]
    assert release(ledger, token, sums=None) == ReleaseAnswer(True)
    assert release(ledger, token) == ReleaseAnswer(True)


def test_another_release_naming_the_reader_gets_no_sums() -> None:
    """Only the same release (its fingerprint covers the lease token and the question) gets the kept answer."""
    ledger = ProducerLedger(30, 30)
    token = claimed(ledger)["d:0"]
    release(ledger, token, sums=SUMS)
    assert release(ledger, "forged", question=b"another release") == ReleaseAnswer(True)


def test_no_sums_for_a_read_p_does_not_confirm_nor_kept() -> None:
    ledger = ProducerLedger(30, 5)
    token = claimed(ledger)["d:0"]
    assert release(ledger, token, sums=SUMS, now=6.0) == ReleaseAnswer(False)  # the lease lapsed at 5
    assert release(ledger, token, now=7.0) == ReleaseAnswer(False)
    assert ledger.table_sizes()["kept_answers"] == 0


def test_a_release_that_asks_nothing_keeps_nothing() -> None:
    ledger = ProducerLedger(30, 30)
    token = claimed(ledger)["d:0"]
    assert release(ledger, token, question=b"") == ReleaseAnswer(True)
    assert ledger.table_sizes()["kept_answers"] == 0
    assert release(ledger, token, question=b"") == ReleaseAnswer(True)


@pytest.mark.parametrize("bound", ["count", "bytes"])
def test_answers_are_kept_within_their_bounds_and_a_forgotten_one_is_reported_lost(bound: str) -> None:
    ledger = ProducerLedger(30, 30, max_kept_answers=3 if bound == "count" else 1000,
                            max_kept_answer_bytes=1000 if bound == "count" else 3 * (len(QUESTION) + 100))
    tokens = {}
    for i in range(5):
        rid = f"r{i}"
        tokens[rid] = claimed(ledger, rid)["d:0"]
        assert release(ledger, tokens[rid], rid, sums=bytes([i]) * 100).sums == bytes([i]) * 100
        assert ledger.table_sizes()["kept_answers"] <= 3
        assert ledger.kept_answers.bytes <= ledger.kept_answers.max_bytes
    assert ledger.table_sizes()["kept_answers"] == 3
    # The oldest two were forgotten: their copies say so; the latest three still get their sums.
    assert release(ledger, tokens["r0"], "r0") == ReleaseAnswer(True, sums_lost=True)
    assert release(ledger, tokens["r1"], "r1") == ReleaseAnswer(True, sums_lost=True)
    for i in (2, 3, 4):
        assert release(ledger, tokens[f"r{i}"], f"r{i}") == ReleaseAnswer(True, bytes([i]) * 100)


def test_release_still_answers_whether_the_lease_held() -> None:
    """The boolean API (tests, benchmarks) is answer_release's ``lease_held``."""
    ledger = ProducerLedger(30, 30)
    token = claimed(ledger)["d:0"]
    assert ledger.release("r", "h", "d:0", 1, 1.0, token, True) is True
    assert ledger.release("r", "h", "d:0", 1, 2.0, token, True) is True


def test_d_judges_lost_sums_apart_from_missing_ones() -> None:
    query = DigestQuery([UnitRanges(0, 1, [0, 8])])
    assert judge(query, [(1, 2)], None, sums_lost=True).verdict is Verdict.SUMS_LOST
    assert judge(query, [(1, 2)], None).verdict is Verdict.UNVERIFIED
    assert judge(query, [(1, 2)], [UnitSums(1, 2)], sums_lost=False).verdict is Verdict.MATCHED
