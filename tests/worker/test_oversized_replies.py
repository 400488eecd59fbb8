"""Worker level: D's real pull loop (a real Mooncake engine, real CPU tensors) against a P side channel that answers
every request with an oversized registration, over a real ZMQ socket on 127.0.0.1 (issue 37, item 3).

* a frame over side_channel.MAX_REPLY_BYTES (16 MiB, within the 64 MiB accepted before): ZMQ drops it while
  reading its header; the pull fails within a fraction of a second, saying the reply was over D's bound, and D's
  pull thread builds nothing of it. Paired: that frame, decoded as it was before, is ~0.2 GiB of objects.
* a frame within the bound whose registration has more planes than a real one (2049): refused while it is
  decoded, naming the field, as fast.
"""

from __future__ import annotations

import time
import tracemalloc
from collections.abc import Iterator

import msgspec
import pytest

from tests.unit.test_peer_message_bounds import RawP, _old_replies, registration_with
from tests.worker.test_pull_two_engines import BLOCK, D_BLOCKS, _kv, _local
from vllm_kvp2p.contract.protocol import MAX_PLANES, RemotePrefill
from vllm_kvp2p.contract.side_channel import MAX_REPLY_BYTES
from vllm_kvp2p.decode.pull_loop import PullLoop
from vllm_kvp2p.lifecycle.consumer import Failure, PullPlan
from vllm_kvp2p.lifecycle.pull import Outcome, PullResult
from vllm_kvp2p.transfer.engine import MooncakeEngine

SIDE_CHANNEL_TIMEOUT = 5.0  # what a dropped reply cost before: the whole of it, per request


def claim_reply_frame(planes: int) -> bytes:
    """A granted claim carrying a registration of ``planes`` planes (the smallest encoding of each)."""
    reg = msgspec.msgpack.decode(registration_with(planes=[[0, 0, 0, 0]] * planes))["registration"]
    return msgspec.msgpack.encode({"type": "claim_reply", "status": "granted", "lease": 30.0, "lease_token": "t",
                                   "registration": reg})


@pytest.fixture(scope="module")
def d_side() -> Iterator[tuple[MooncakeEngine, object]]:
    kv = _kv(D_BLOCKS, 2)
    local, regions = _local(kv, D_BLOCKS)
    engine = MooncakeEngine("127.0.0.1", "tcp", transfer_timeout=5)
    engine.register(regions)
    yield engine, local
    engine.close()


def pull_answered(d_side: tuple[MooncakeEngine, object], frame: bytes) -> tuple[PullResult, float, float]:
    """One pull of two blocks from a P answering every request ``frame``: (its result, seconds, tracemalloc's peak
    in MiB meanwhile)."""
    p = RawP(frame)
    try:
        return _pull_from(d_side, p)
    finally:
        p.close()


def _pull_from(d_side: tuple[MooncakeEngine, object], p: RawP) -> tuple[PullResult, float, float]:
    engine, local = d_side
    loop = PullLoop(engine, reader="d:0", tp_size=1, tp_rank=0, local=local,  # type: ignore[arg-type]
                    side_channel_timeout=SIDE_CHANNEL_TIMEOUT, claim_wait=1.0, max_batch_entries=4)
    remote = RemotePrefill("p-oversized", "r1", "127.0.0.1", p.port, [[1, 2]], "h1", 2 * BLOCK, BLOCK)
    try:
        tracemalloc.start()
        t0 = time.monotonic()
        loop.submit(PullPlan("d-r1", remote, ((3, 4),), ((1, 2),), True))
        while not (results := loop.take_results()):
            assert time.monotonic() - t0 < 4 * SIDE_CHANNEL_TIMEOUT, "no pull result"
            time.sleep(0.005)
        took = time.monotonic() - t0
        peak = tracemalloc.get_traced_memory()[1] / (1 << 20)
        tracemalloc.stop()
        return results[0].result, took, peak
    finally:
        loop.close()


def test_a_reply_over_the_frame_bound_fails_the_pull_at_once_with_nothing_built(d_side) -> None:
    # 1.7 MiB, 350 k planes: over three times the bound, and what it cost decoded scales with the frame (a 16 MiB one,
    # still inside the former 64 MiB frame bound, built ~0.2 GiB of planes on the pull thread of the process that
    # holds the model; measured once, 14 s under tracemalloc, so not on every run).
    frame = claim_reply_frame(350_000)
    assert 3 * MAX_REPLY_BYTES < len(frame) < 64 << 20  # accepted by the frame bound before
    before, _ = _peak(lambda: _old_replies.decode(frame))
    assert before > 10, before  # MiB, against the 4 MiB at most below
    result, took, peak = pull_answered(d_side, frame)
    assert result.outcome is Outcome.FAILED, result
    assert "closed the connection before its reply arrived" in result.reason, result.reason
    assert f"{MAX_REPLY_BYTES >> 10} KiB bound" in result.reason
    assert took < 1.0, took  # each request's 3 attempts end in milliseconds, not after SIDE_CHANNEL_TIMEOUT
    assert peak < 4, peak  # MiB: nothing of the frame was buffered or decoded


def test_a_registration_of_more_planes_than_a_real_one_is_refused_naming_the_field(d_side) -> None:
    frame = claim_reply_frame(MAX_PLANES + 1)
    assert len(frame) < MAX_REPLY_BYTES
    result, took, peak = pull_answered(d_side, frame)
    assert result.outcome is Outcome.FAILED, result
    assert f"Expected `array` of length <= {MAX_PLANES} - at `$.registration.planes`" in result.reason, result.reason
    assert took < 1.0 and peak < 4, (took, peak)
    # P answered: the pull is INCOMPATIBLE (its hint names versions and layouts), not "P down" (UNREACHABLE)
    assert result.failure is Failure.INCOMPATIBLE and result.unreachable_rank is None, result


def _peak(fn) -> tuple[float, object]:
    tracemalloc.start()
    out = fn()
    peak = tracemalloc.get_traced_memory()[1] / (1 << 20)
    tracemalloc.stop()
    return peak, out
