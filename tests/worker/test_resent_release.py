"""A release resent keeps its verification (issue 37, item 5): D's side-channel client waits 0.5 s for the first
answer to a release, then resends it on a fresh socket. P answers the copy with the sums it computed for the
first (the ledger keeps them: ProducerLedger.answer_release), whether the copy arrives while they are summed or
after the first answer went to a socket D had given up; and a copy whose sums P no longer keeps is counted
``sums_lost`` with a WARNING, not folded into ``unverified``. A real HoldService and PullLoop over a real ZMQ side
channel and two Mooncake engines."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest

from tests.worker.test_integrity import pull
from tests.worker.test_pull_two_engines import NUM_LAYERS, Pair
from vllm_kvp2p.connector.metrics import Kvp2pStats
from vllm_kvp2p.contract import protocol
from vllm_kvp2p.contract.protocol import Released
from vllm_kvp2p.lifecycle.integrity import IntegrityMode
from vllm_kvp2p.lifecycle.pull import Outcome


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    p = Pair(integrity=IntegrityMode.FULL)
    yield p
    p.close()


@pytest.fixture
def first_answer_lost(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> list[Released]:
    """P's first answer carrying sums never reaches D (lost on the way, or sent to the socket D gave up on)."""
    server, lost = pair.holds._server, []
    send = server._send

    def lossy(identity: bytes, data: bytes) -> None:
        reply = protocol.decode_reply(data)
        if not lost and isinstance(reply, Released) and reply.sums:
            lost.append(reply)
            return
        send(identity, data)

    monkeypatch.setattr(server, "_send", lossy)
    return lost


@pytest.fixture
def releases_seen(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """When each release reached P's handler (the resends among them)."""
    seen: list[float] = []
    handle = pair.holds._server._handler

    def counting(message: protocol.Request):
        if isinstance(message, protocol.Release):
            seen.append(time.monotonic())
        return handle(message)

    monkeypatch.setattr(pair.holds._server, "_handler", counting)
    return seen


def test_a_release_resent_after_its_answer_was_lost_is_still_verified(
        pair: Pair, first_answer_lost: list[Released], releases_seen: list[float]) -> None:
    """The copy arrives after P answered the first (its hold already released and gone): P answers it the kept
    sums. Before, P answered it from the hold's tombstone without sums and D counted the pull unverified."""
    result = pull(pair, "lost-answer", [3, 4], [0, 1])
    assert first_answer_lost, "the first answer was not dropped"
    assert len(releases_seen) >= 2, "D did not resend the release"
    assert result.outcome is Outcome.PULLED, result.reason
    assert result.verified_units == 2 * NUM_LAYERS and not result.unverified and not result.sums_lost, result
    assert result.integrity == "verified"


def test_a_release_resent_while_its_sums_run_gets_the_same_answer(pair: Pair, releases_seen: list[float]) -> None:
    """P's sums take longer than D's first wait: the copy waits for the first one's answer, summed once."""
    digester, sums_runs = pair.holds._digester, []

    def slow(query: protocol.DigestQuery) -> list[tuple[int, int]]:
        sums_runs.append(query)
        time.sleep(0.9)  # D's first attempt waits 0.5 s
        return digester(query)

    pair.holds._digester = slow
    try:
        result = pull(pair, "slow-sums", [5, 6], [2, 3])
    finally:
        pair.holds._digester = digester
    assert len(releases_seen) >= 2, "D did not resend the release"
    assert len(sums_runs) == 1  # the copy did not make P sum again
    assert result.outcome is Outcome.PULLED and result.verified_units == 2 * NUM_LAYERS, result
    assert not result.unverified and not result.sums_lost


def test_a_resent_release_whose_sums_p_no_longer_keeps_counts_as_sums_lost_with_a_warning(
        pair: Pair, first_answer_lost: list[Released], caplog: pytest.LogCaptureFixture) -> None:
    """P keeps no answer (the bound reached): the copy is answered ``sums_lost``, which D counts apart from a P
    that gave no sums, and says so."""
    kept, pair.holds.ledger.kept_answers.max_answers = pair.holds.ledger.kept_answers.max_answers, 0
    try:
        with caplog.at_level(logging.WARNING, logger="vllm.kvp2p.pull_loop"):
            result = pull(pair, "sums-forgotten", [7, 8], [4, 5])
    finally:
        pair.holds.ledger.kept_answers.max_answers = kept
    assert first_answer_lost
    assert result.outcome is Outcome.PULLED, result.reason  # the read itself is confirmed
    assert result.sums_lost and not result.unverified and result.verified_units == 0, result
    assert any("sums_lost" in r.getMessage() and "P rank 0" in r.getMessage() for r in caplog.records)
    stats = Kvp2pStats()
    stats.record_integrity(result.integrity)
    assert stats.data["integrity"] == {"verified": 0, "unverified": 0, "sums_lost": 1}


def test_a_p_that_answers_no_question_is_still_unverified_not_sums_lost(pair: Pair) -> None:
    """The control: no sums because P answers none (an older P) stays ``unverified``."""
    digester, pair.holds._digester = pair.holds._digester, None
    try:
        result = pull(pair, "no-digester", [9, 10], [6, 7])
    finally:
        pair.holds._digester = digester
    assert result.outcome is Outcome.PULLED and result.unverified and not result.sums_lost, result
    assert result.integrity == "unverified"

