"""A frozen P must not hold up pulls from other P instances: each P instance has its own pull thread (lane).

Real Mooncake engines and a real HoldService for the healthy P; the frozen P is a real ZMQ ROUTER socket on
127.0.0.1 that accepts connections and never answers (what a SIGSTOPped P looks like to D's side channel).
"""

from __future__ import annotations

import time
import uuid

import pytest
import torch
import zmq

from tests.support.ports import free_port
from tests.worker.test_pull_two_engines import BLOCK, Pair
from vllm_kvp2p.contract.protocol import RemotePrefill
from vllm_kvp2p.decode.pull_loop import PullLoop
from vllm_kvp2p.lifecycle.consumer import PullPlan
from vllm_kvp2p.lifecycle.pull import Outcome

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


def _overlaps(spans: list[tuple[float, float]]) -> int:
    """The most spans open at one instant."""
    edges = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
    most = now = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


@pytest.mark.parametrize("lanes_per_peer", [2, 1])
def test_pulls_from_one_p_overlap_their_round_trips_but_not_their_reads(
    monkeypatch: pytest.MonkeyPatch, lanes_per_peer: int
) -> None:
    """A busy P answers late: two pulls from it wait for their claims at the same time (two lanes), while their
    Mooncake reads still take turns (one read slot per P: at most max_batch_entries in flight per peer)."""
    import threading

    from vllm_kvp2p.contract.protocol import Claim
    from vllm_kvp2p.contract.side_channel import SideChannelClient
    from vllm_kvp2p.decode import pull_lanes

    monkeypatch.setattr(pull_lanes, "LANES_PER_PEER", lanes_per_peer)
    claims: list[tuple[float, float]] = []
    reads: list[tuple[float, float]] = []
    lock = threading.Lock()
    request = SideChannelClient.request

    def timed_request(self, host, port, message, timeout=None, meanwhile=None):
        t0 = time.monotonic()
        try:
            return request(self, host, port, message, timeout, meanwhile)
        finally:
            if isinstance(message, Claim):
                with lock:
                    claims.append((t0, time.monotonic()))

    monkeypatch.setattr(SideChannelClient, "request", timed_request)
    pair = Pair()
    handler = pair.holds._server._handler

    def slow_p(message):  # P's side-channel thread gets the core late, then answers at once
        if isinstance(message, Claim):
            time.sleep(0.15)
        return handler(message)

    pair.holds._server._handler = slow_p
    read = pair.d_engine.read

    def timed_read(segment, descriptors):
        t0 = time.monotonic()
        try:
            return read(segment, descriptors)
        finally:
            with lock:
                reads.append((t0, time.monotonic()))

    pair.d_engine.read = timed_read
    try:
        for i in range(4):
            pair.holds.hold(f"ov{i}", "h1")
        for i in range(4):
            pair.pulls.submit(pair.plan(f"ov{i}", [1 + 2 * i, 2 + 2 * i], [3 + 2 * i, 4 + 2 * i]))
        results = []
        deadline = time.monotonic() + 30
        while len(results) < 4 and time.monotonic() < deadline:
            results += [r.result for r in pair.pulls.take_results()]
            time.sleep(0.01)
        assert [r.outcome for r in results] == [Outcome.PULLED] * 4, [r.reason for r in results]
        for i in range(4):
            for name in pair.d_kv:
                assert torch.equal(pair.d_kv[name][[3 + 2 * i, 4 + 2 * i]], pair.p_kv[name][[1 + 2 * i, 2 + 2 * i]])
        assert len(reads) >= 4 and _overlaps(reads) == 1  # reads from one P never overlap
        assert _overlaps(claims) == lanes_per_peer  # one lane: claims one after another
    finally:
        pair.close()
