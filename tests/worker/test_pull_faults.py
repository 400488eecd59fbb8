"""Worker level, real Mooncake engines over TCP and real ZMQ side channels on 127.0.0.1: a pull thread that crashes
mid-pull still releases P's lease (with its token, so P frees the blocks at once), and a D whose shared secret or
clock does not agree with P's fails its pulls as ``unauthenticated`` without taking the healthy P for down; D's
claims carry its deadline. Each defence is paired with what happened without it."""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec
import pytest

from tests.worker.test_pull_two_engines import Pair
from vllm_kvp2p.contract.auth import Authenticator
from vllm_kvp2p.contract.protocol import Claim, Release, Reply, Request
from vllm_kvp2p.contract.side_channel import SideChannelClient, SideChannelError, Unauthenticated
from vllm_kvp2p.decode.pull_loop import PullLoop
from vllm_kvp2p.lifecycle.consumer import Failure
from vllm_kvp2p.lifecycle.producer import HoldState
from vllm_kvp2p.lifecycle.pull import Outcome, PullResult

SECRET = b"worker-level-fault-secret-0123456789"
SKEW_MS = 100_000  # D's clock 100 s ahead of P's, beyond clock_skew (30 s)


# ----------------------------------------------------------------------------- a crash mid-pull


@pytest.mark.parametrize("token_reaches_p", [True, False])
def test_a_pull_that_crashes_mid_read_releases_its_lease_at_once(token_reaches_p: bool,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The pull thread raises during the read (a bug, injected): the request fails as ``internal`` and P is
    released with the lease's token, so P frees the hold at once (RELEASED, not a lapsed lease 30 s later).
    Paired: the same release without the token (what the thread sent after a crash before) is ignored by P,
    whose hold stays claimed until the lease lapses."""
    pair = Pair(lease_timeout=30.0)
    if not token_reaches_p:
        handler = pair.holds._server._handler

        def without_token(message: Request) -> Reply:
            if isinstance(message, Release):
                message = msgspec.structs.replace(message, lease_token="")
            return handler(message)

        pair.holds._server._handler = without_token

    def crash(*args: object, **kwargs: object) -> None:
        raise RuntimeError("injected crash in the pull thread")

    try:
        monkeypatch.setattr(pair.d_engine, "read", crash)
        pair.holds.hold("c1", "h1")
        pair.pulls.submit(pair.plan("c1", [1, 2], [3, 4]))
        result = pair.wait_result()
        assert result.failure is Failure.INTERNAL and "injected crash" in result.reason, result.reason
        ledger = pair.holds.ledger
        if token_reaches_p:
            assert pair.wait_freed(timeout=3.0) == {"c1"}
            assert ledger.state("c1") is HoldState.RELEASED and not ledger.counters["lease_lapsed"]
        else:
            assert pair.wait_freed(timeout=1.5) == set()
            assert ledger.state("c1") is HoldState.CLAIMED and ledger.counters["release_without_token"] == 1
    finally:
        pair.close()


# ----------------------------------------------------------------------------- authentication failures


class AheadClock(Authenticator):
    """A D whose wall clock runs SKEW_MS ahead of P's (everything else right)."""

    def seal_request(self, body: bytes, now_ms: int) -> tuple[bytes, bytes]:
        return super().seal_request(body, now_ms + SKEW_MS)

    def open_reply(self, frame: bytes, request_nonce: bytes, now_ms: int) -> bytes:
        return super().open_reply(frame, request_nonce, now_ms + SKEW_MS)


D_SIDES = {
    "D without the secret": (Authenticator(SECRET, 30), None, "requires the shared secret and this client has none"),
    "D with another secret": (Authenticator(SECRET, 30), Authenticator(b"another-secret-0123456789abcdef", 30),
                              "bad MAC"),
    "D's clock 100 s ahead": (Authenticator(SECRET, 30), AheadClock(SECRET, 30), "100.0 s off"),
    "P without the secret": (None, Authenticator(SECRET, 30), "failed authentication here"),
}


def pair_with(p_auth: Authenticator | None, d_auth: Authenticator | None) -> Pair:
    pair = Pair(auth=p_auth)
    local = pair.pulls.local
    pair.pulls.close()
    pair.pulls = PullLoop(pair.d_engine, reader="d:0", tp_size=1, tp_rank=0, local=local, side_channel_timeout=2,
                          claim_wait=1.0, max_batch_entries=4, auth=d_auth, suspect_time=30.0)
    return pair


def pull_twice(pair: Pair) -> tuple[PullResult, PullResult]:
    """Two pulls of held blocks, one after the other."""
    results = []
    for request_id, remote, local in (("a1", 1, 2), ("a2", 3, 4)):
        pair.holds.hold(request_id, "h1")
        pair.pulls.submit(pair.plan(request_id, [remote], [local]))
        results.append(pair.wait_result(timeout=10))
    return results[0], results[1]


@pytest.mark.parametrize("case", list(D_SIDES))
def test_a_pull_that_fails_authentication_says_so_and_leaves_p_trusted(case: str) -> None:
    """P answers, but the secrets (or clocks) disagree: the pull fails as ``unauthenticated`` with a reason that
    names the likely cause, P is not taken for down (no suspect), and the next pull asks P again (and is told the
    same) instead of failing without trying."""
    p_auth, d_auth, detail = D_SIDES[case]
    pair = pair_with(p_auth, d_auth)
    try:
        first, second = pull_twice(pair)
        for result in (first, second):
            assert result.outcome is Outcome.FAILED and result.failure is Failure.UNAUTHENTICATED, result.reason
            assert detail in result.reason and "secret" in result.reason
            assert "clock_skew" in result.reason or "VLLM_KVP2P_SECRET" in result.reason
            assert "does not answer a probe" not in result.reason
        assert pair.pulls.table_sizes()["suspects"] == 0
    finally:
        pair.close()


def test_before_an_authentication_failure_was_told_apart_p_was_taken_for_down(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pair of the test above: with the client raising a plain SideChannelError for a refused authentication
    (as it did), the pull reports ``unreachable``, the healthy P becomes suspect, and the next pull fails on a probe
    without P being asked."""
    once = SideChannelClient._once

    def as_before(self: SideChannelClient, endpoint: str, message: Request, timeout_ms: int,
                  meanwhile: Callable[[], None] | None = None) -> Reply:
        try:
            return once(self, endpoint, message, timeout_ms, meanwhile)
        except Unauthenticated as exc:
            raise SideChannelError(str(exc)) from None

    monkeypatch.setattr(SideChannelClient, "_once", as_before)
    pair = pair_with(Authenticator(SECRET, 30), None)
    try:
        first, second = pull_twice(pair)
        assert first.failure is Failure.UNREACHABLE, first.reason
        assert second.failure is Failure.UNREACHABLE and "does not answer a probe" in second.reason, second.reason
    finally:
        pair.close()


# ----------------------------------------------------------------------------- D's deadline in its claims


def test_the_claims_p_receives_carry_ds_deadline_on_the_wall_clock() -> None:
    """What D's pull thread puts in a claim: its wall clock at the start of the pull + pull_timeout (P refuses a claim
    delivered after that and leases no longer)."""
    pair = Pair()
    claims: list[Claim] = []
    handler = pair.holds._server._handler

    def recording(message: Request) -> Reply:
        if isinstance(message, Claim):
            claims.append(message)
        return handler(message)

    pair.holds._server._handler = recording
    try:
        before_ms = time.time_ns() // 1_000_000
        pair.pulls.submit(pair.plan("w1", [1], [2]))
        time.sleep(0.2)  # D claims before P has heard of the hold: the claim is resent
        pair.holds.hold("w1", "h1")
        assert pair.wait_result().outcome is Outcome.PULLED
        after_ms = time.time_ns() // 1_000_000
        timeout_ms = int(pair.pulls.pull_timeout * 1000)
        assert len(claims) > 1 and len({c.deadline_ms for c in claims}) == 1
        assert before_ms + timeout_ms <= claims[0].deadline_ms <= after_ms + timeout_ms
    finally:
        pair.close()
