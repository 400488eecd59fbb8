"""A frozen P must not hold up pulls from other P instances: each P instance has its own pull thread (lane).

Real Mooncake engines and a real HoldService for the healthy P; the frozen P is a real ZMQ ROUTER socket on
127.0.0.1 that accepts connections and never answers (what a SIGSTOPped P looks like to D's side channel).
"""

from __future__ import annotations

import time
import uuid

import pytest
import zmq

from tests.support.ports import free_port
from tests.worker.test_pull_two_engines import BLOCK, Pair
from vllm_kvp2p.lifecycle.consumer import PullPlan
from vllm_kvp2p.lifecycle.pull import Outcome
from vllm_kvp2p.protocol import RemotePrefill
from vllm_kvp2p.pull_loop import PullLoop

FROZEN_TIMEOUT = 2.0  # D's side-channel timeout in this test: the frozen P's pull fails after it


@pytest.fixture(scope="module")
def frozen_p():
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = free_port()
    sock.bind(f"tcp://127.0.0.1:{port}")
    yield port
    sock.close(0)
    ctx.term()


@pytest.mark.parametrize("threads", [4, 1])
def test_frozen_p_delays_only_its_own_lane(frozen_p: int, threads: int) -> None:
    pair = Pair()
    pair.pulls.close()  # replace the pair's loop with one of `threads` lanes
    pair.pulls = PullLoop(pair.d_engine, reader="d:0", tp_size=1, tp_rank=0, local=pair.pulls.local,
                          side_channel_timeout=FROZEN_TIMEOUT, claim_wait=1.0, max_batch_entries=4,
                          max_threads=threads)
    try:
        frozen = RemotePrefill("p-frozen-" + uuid.uuid4().hex[:4], "req-frozen", "127.0.0.1", frozen_p, [[1, 2]],
                               "h-frozen", 2 * BLOCK, BLOCK)
        pair.holds.hold("req-ok", "h1")
        t0 = time.monotonic()
        pair.pulls.submit(PullPlan("d-req-frozen", frozen, ((5, 6),), ((1, 2),), True))
        pair.pulls.submit(pair.plan("req-ok", [3, 4], [7, 8]))
        done: dict[str, tuple[float, object]] = {}
        deadline = t0 + 4 * FROZEN_TIMEOUT + 10
        while len(done) < 2 and time.monotonic() < deadline:
            for r in pair.pulls.take_results():
                done[r.result.request_id] = (time.monotonic() - t0, r.result)
            time.sleep(0.01)
        assert set(done) == {"d-req-frozen", "d-req-ok"}, done
        (t_frozen, frozen_result), (t_ok, ok_result) = done["d-req-frozen"], done["d-req-ok"]
        assert frozen_result.outcome is Outcome.FAILED and "no answer" in frozen_result.reason
        assert ok_result.outcome is Outcome.PULLED, ok_result.reason
        assert pair.wait_freed() == {"req-ok"}
        if threads > 1:
            # The healthy P's pull finished while the frozen P's was still waiting for an answer.
            assert t_ok < t_frozen, (t_ok, t_frozen)
        else:
            # One thread (the old design): the healthy pull waited behind the frozen one.
            assert t_ok > t_frozen >= FROZEN_TIMEOUT * 0.9, (t_ok, t_frozen)
    finally:
        pair.close()
