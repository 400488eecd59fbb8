"""Dead and frozen P instances, worker level: a real D pull loop and Mooncake engine, real ZMQ, P a real
HoldService (killed: closed, its port refuses) or a ROUTER socket that never answers (what a SIGSTOPped P looks
like). Time bounds carry a margin for a loaded 2-core machine."""

from __future__ import annotations

import time
import uuid

import zmq

from tests.support.ports import free_port
from tests.worker.test_pull_two_engines import BLOCK, Pair
from vllm_kvp2p.contract.protocol import RemotePrefill
from vllm_kvp2p.contract.side_channel import PeerRefused, SideChannelClient, probe
from vllm_kvp2p.decode.pull_loop import PullLoop
from vllm_kvp2p.lifecycle.consumer import Failure, PullPlan
from vllm_kvp2p.lifecycle.pull import Outcome, PullResult
from vllm_kvp2p.prefill.hold_service import HoldService

SIDE_CHANNEL_TIMEOUT = 3.0


def loop_for(pair: Pair) -> PullLoop:
    pair.pulls.close()
    pair.pulls = PullLoop(pair.d_engine, reader="d:0", tp_size=1, tp_rank=0, local=pair.pulls.local,
                          side_channel_timeout=SIDE_CHANNEL_TIMEOUT, claim_wait=5.0, max_batch_entries=4,
                          suspect_time=30.0)
    return pair.pulls


def timed(pair: Pair, plan: PullPlan) -> tuple[float, PullResult]:
    t0 = time.monotonic()
    pair.pulls.submit(plan)
    result = pair.wait_result(timeout=30)
    return time.monotonic() - t0, result


def plan_for(port: int, request_id: str, engine_id: str = "p-x") -> PullPlan:
    remote = RemotePrefill(engine_id, request_id, "127.0.0.1", port, [[1, 2]], "h", 2 * BLOCK, BLOCK)
    return PullPlan("d-" + request_id, remote, ((5, 6),), ((1, 2),), True)


def test_probe_tells_dead_from_alive() -> None:
    port = free_port()
    assert probe("127.0.0.1", port) is False
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(f"tcp://127.0.0.1:{port}")
    try:
        assert probe("127.0.0.1", port) is True
    finally:
        sock.close(0)
        ctx.term()
    client = SideChannelClient(5.0)
    t0 = time.monotonic()
    try:
        from vllm_kvp2p.contract.protocol import GetRegistration

        client.request("127.0.0.1", port, GetRegistration(0))
    except PeerRefused:
        pass
    finally:
        client.close()
    assert time.monotonic() - t0 < 1.0  # not the 5 s timeout


def test_a_killed_p_is_answered_in_under_two_seconds_and_again_after_it_returns() -> None:
    pair = Pair()
    loop_for(pair)
    try:
        pair.holds.hold("warm", "h1")
        took, result = timed(pair, pair.plan("warm", [1], [2]))  # D knows P: registration cached, socket open
        assert result.outcome is Outcome.PULLED
        registration = pair.holds.registration
        pair.holds.close()  # killed: nothing listens on its port any more
        took, result = timed(pair, pair.plan("after-kill", [1], [2]))
        assert result.outcome is Outcome.FAILED and result.failure is Failure.UNREACHABLE, result.reason
        assert took < 2.0, took  # before: the claim's whole timeout, then the release's (10 s at defaults)
        took, result = timed(pair, pair.plan("still-dead", [1], [2]))
        assert result.failure is Failure.UNREACHABLE and took < 1.0, (took, result.reason)
        # P restarts on the same address: the next pull works at once.
        pair.holds = HoldService(registration, "127.0.0.1", pair.port, hold_timeout=30, lease_timeout=30)
        pair.holds.hold("back", "h1")
        took, result = timed(pair, pair.plan("back", [3], [4]))
        assert result.outcome is Outcome.PULLED, result.reason
    finally:
        pair.close()


def test_a_frozen_p_costs_one_timeout_then_a_probe_per_plan() -> None:
    pair = Pair()
    loop_for(pair)
    ctx = zmq.Context()
    frozen = ctx.socket(zmq.ROUTER)  # accepts, never answers
    frozen.setsockopt(zmq.LINGER, 0)
    port = free_port()
    frozen.bind(f"tcp://127.0.0.1:{port}")
    engine_id = "p-frozen-" + uuid.uuid4().hex[:4]
    try:
        took, result = timed(pair, plan_for(port, "f1", engine_id))
        assert result.failure is Failure.UNREACHABLE, result.reason
        assert took < SIDE_CHANNEL_TIMEOUT + 1.0, took  # the result does not wait for the release
        took, result = timed(pair, plan_for(port, "f2", engine_id))
        assert result.failure is Failure.UNREACHABLE and "does not answer a probe" in result.reason
        assert took < 1.5, took  # one short probe, not another timeout
        # A healthy P on another lane is untouched meanwhile.
        pair.holds.hold("healthy", "h1")
        took, result = timed(pair, pair.plan("healthy", [1], [2]))
        assert result.outcome is Outcome.PULLED and took < 2.0, (took, result.reason)
    finally:
        frozen.close(0)
        ctx.term()
        pair.close()
