"""Worker level: a P hold service and a D pull loop in one process, real Mooncake engines over TCP on 127.0.0.1,
real ZMQ side channel, real CPU tensors in vLLM's CPU KV layout."""

from __future__ import annotations

import time
import uuid

import pytest
import torch

from tests.support.ports import free_port
from tests.worker.engine_teardown import close_later
from vllm_kvp2p.contract.auth import Authenticator
from vllm_kvp2p.contract.protocol import RankRegistration, RemotePrefill
from vllm_kvp2p.decode.pull_loop import PullLoop
from vllm_kvp2p.lifecycle.consumer import PullPlan
from vllm_kvp2p.lifecycle.integrity import IntegrityMode
from vllm_kvp2p.lifecycle.pull import LocalKV, Outcome
from vllm_kvp2p.prefill.hold_service import HoldService
from vllm_kvp2p.transfer.digest import KVMemory, sums_of_units
from vllm_kvp2p.transfer.engine import MooncakeEngine
from vllm_kvp2p.transfer.layout import AttentionInterior, TensorView, coalesce_regions, kv_geometry

NUM_LAYERS, HEADS, BLOCK, HEAD = 3, 2, 16, 32
P_BLOCKS, D_BLOCKS = 40, 33  # ranks and instances may differ in block count


def _kv(num_blocks: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        f"model.layers.{i}.self_attn": torch.randn(num_blocks, HEADS, BLOCK, 2 * HEAD, generator=g)
        for i in range(NUM_LAYERS)
    }


def _planes(kv: dict[str, torch.Tensor], num_blocks: int):
    layers = [
        (n, [TensorView(t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.element_size())]) for n, t in kv.items()
    ]
    planes, shapes = kv_geometry(layers, num_blocks, BLOCK, HEADS, head_size=HEAD,
                                 interior=AttentionInterior.HEAD_MAJOR_KV_HALVES)
    return planes, shapes, coalesce_regions([v for _, vs in layers for v in vs])


def _local(kv: dict[str, torch.Tensor], num_blocks: int) -> tuple[LocalKV, list]:
    planes, shapes, regions = _planes(kv, num_blocks)
    return LocalKV(tuple(planes), tuple(shapes), BLOCK, tuple(kv), "float32", HEADS), regions


class Pair:
    def __init__(self, hold_timeout: float = 30.0, lease_timeout: float = 30.0, auth: Authenticator | None = None,
                 d_auth: Authenticator | None = None, integrity: IntegrityMode = IntegrityMode.OFF) -> None:
        """``auth``: P's shared-secret authenticator (and D's, unless ``d_auth`` gives D another). ``integrity``:
        D's digest mode (P always answers integrity questions, as the worker sets it up)."""
        self.p_kv, self.d_kv = _kv(P_BLOCKS, 1), _kv(D_BLOCKS, 2)
        p_planes, p_shapes, p_regions = _planes(self.p_kv, P_BLOCKS)
        d_local, d_regions = _local(self.d_kv, D_BLOCKS)
        self.p_engine = MooncakeEngine("127.0.0.1", "tcp", transfer_timeout=5)
        self.p_engine.register(p_regions)
        self.d_engine = MooncakeEngine("127.0.0.1", "tcp", transfer_timeout=5)
        self.d_engine.register(d_regions)
        self.port = free_port()
        self.engine_id = "p-" + uuid.uuid4().hex[:6]
        reg = RankRegistration(self.engine_id, 0, 1, self.p_engine.segment, p_planes, p_shapes, list(self.p_kv),
                               BLOCK, P_BLOCKS, "float32", HEADS, HEADS, HEAD)
        p_memory = KVMemory(list(self.p_kv.values()))
        self.holds = HoldService(reg, "127.0.0.1", self.port, hold_timeout=hold_timeout, lease_timeout=lease_timeout,
                                 auth=auth, digester=lambda query: sums_of_units(p_memory, p_planes, query))
        self.pulls = PullLoop(self.d_engine, reader="d:0", tp_size=1, tp_rank=0, local=d_local,
                              side_channel_timeout=2, claim_wait=1.0, max_batch_entries=4, auth=d_auth or auth,
                              integrity=integrity, memory=KVMemory(list(self.d_kv.values())))

    def plan(self, request_id: str, remote_ids: list[int], local_ids: list[int], hold_id: str = "h1",
             awaiting: bool = True) -> PullPlan:
        remote = RemotePrefill(self.engine_id, request_id, "127.0.0.1", self.port, [list(remote_ids)], hold_id,
                               len(remote_ids) * BLOCK, BLOCK)
        return PullPlan("d-" + request_id, remote, (tuple(local_ids),), (tuple(remote_ids),), awaiting)

    def wait_result(self, timeout: float = 20.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            results = self.pulls.take_results()
            if results:
                return results[0].result
            time.sleep(0.01)
        raise TimeoutError("no pull result")

    def wait_freed(self, timeout: float = 5.0) -> set[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            freed = self.holds.take_freed()
            if freed:
                return freed
            time.sleep(0.01)
        return set()

    def close(self) -> None:
        self.pulls.close()
        self.holds.close()
        close_later(self.d_engine, self.p_engine)  # nothing uses them now; Mooncake takes ~1 s to let go


@pytest.fixture(scope="module")
def pair():
    p = Pair()
    yield p
    p.close()


def test_pull_copies_exactly_the_planned_blocks(pair: Pair) -> None:
    remote_ids = [7, 8, 9, 21, 3]  # runs merge where both sides are consecutive
    local_ids = [0, 1, 2, 10, 30]
    before = {n: t.clone() for n, t in pair.d_kv.items()}
    pair.holds.hold("req-a", "h1")
    pair.pulls.submit(pair.plan("req-a", remote_ids, local_ids))
    result = pair.wait_result()
    assert result.outcome is Outcome.PULLED, result.reason
    assert result.num_blocks == 5
    assert result.num_bytes == 5 * NUM_LAYERS * HEADS * BLOCK * 2 * HEAD * 4
    for name in pair.d_kv:
        assert torch.equal(pair.d_kv[name][local_ids], pair.p_kv[name][remote_ids])
        untouched = [b for b in range(D_BLOCKS) if b not in local_ids]
        assert torch.equal(pair.d_kv[name][untouched], before[name][untouched])
    assert pair.wait_freed() == {"req-a"}


def test_claim_for_unknown_or_stale_hold_is_refused_and_p_freed(pair: Pair) -> None:
    pair.holds.hold("req-b", "real-hold")
    pair.pulls.submit(pair.plan("req-b", [1], [4], hold_id="replayed-hold"))
    result = pair.wait_result()
    assert result.outcome is Outcome.FAILED and "refused" in result.reason
    assert result.report_finished and result.report_failed


def test_p_learns_of_hold_late_then_pull_succeeds(pair: Pair) -> None:
    pair.pulls.submit(pair.plan("req-c", [5, 6], [11, 12]))
    time.sleep(0.2)  # D is already claiming; P has not heard of the hold
    pair.holds.hold("req-c", "h1")
    result = pair.wait_result()
    assert result.outcome is Outcome.PULLED, result.reason
    assert pair.wait_freed() == {"req-c"}


def test_nothing_to_pull_still_releases_p_and_is_not_reported(pair: Pair) -> None:
    pair.holds.hold("req-d", "h1")
    pair.pulls.submit(pair.plan("req-d", [], [], awaiting=False))
    result = pair.wait_result()
    assert result.outcome is Outcome.NOTHING_TO_PULL
    assert not result.report_finished
    assert pair.wait_freed() == {"req-d"}


def test_dead_p_fails_fast() -> None:
    d_engine = MooncakeEngine("127.0.0.1", "tcp", transfer_timeout=5)
    kv = _kv(4, 3)
    local, regions = _local(kv, 4)
    d_engine.register(regions)
    loop = PullLoop(d_engine, reader="d:0", tp_size=1, tp_rank=0, local=local,
                    side_channel_timeout=0.5, claim_wait=0.5, max_batch_entries=8)
    try:
        remote = RemotePrefill("gone", "r", "127.0.0.1", free_port(), [[0]], "h", BLOCK, BLOCK)
        t0 = time.monotonic()
        loop.submit(PullPlan("d-r", remote, ((1,),), ((0,),), True))
        deadline = time.monotonic() + 10
        results = []
        while not results and time.monotonic() < deadline:
            results = loop.take_results()
            time.sleep(0.01)
        assert results and results[0].result.outcome is Outcome.FAILED
        assert time.monotonic() - t0 < 5
    finally:
        loop.close()
        d_engine.close()


def test_side_channel_port_collision_names_the_port_and_setting(pair: Pair) -> None:
    from vllm_kvp2p.contract.side_channel import SideChannelError

    with pytest.raises(SideChannelError) as info:
        HoldService(pair.holds.registration, "127.0.0.1", pair.port, hold_timeout=1, lease_timeout=1)
    assert str(pair.port) in str(info.value) and "VLLM_KVP2P_SIDE_CHANNEL_PORT" in str(info.value)


def test_close_stops_pulls_releases_p_and_ends_in_bounded_time() -> None:
    """Shutdown with pulls in progress and queued (P has not heard of the holds, so D would keep claiming for
    claim_wait = 60 s): every pull stops, reports a shutdown failure and releases P, and close() returns in a few
    seconds; only then may the memory be unregistered."""
    pair = Pair()
    pair.pulls.close()
    pair.pulls = PullLoop(pair.d_engine, reader="d:0", tp_size=1, tp_rank=0, local=pair.pulls.local,
                          side_channel_timeout=2, claim_wait=60.0, max_batch_entries=4, max_threads=1)
    try:
        for i in range(3):
            pair.pulls.submit(pair.plan(f"late-{i}", [i + 1], [i + 5]))
        time.sleep(0.5)  # the first is claiming, two are queued behind it
        t0 = time.monotonic()
        assert pair.pulls.close(read_timeout=5)
        assert time.monotonic() - t0 < 5
        results = {r.result.request_id: r.result for r in pair.pulls.take_results()}
        assert set(results) == {"d-late-0", "d-late-1", "d-late-2"}
        assert all(r.outcome is Outcome.FAILED and r.failure is not None and r.failure.value == "shutdown"
                   for r in results.values()), results
        assert pair.holds.table_sizes()["early_releases"] == 3  # each released P (before P heard of the hold)
    finally:
        pair.close()


def test_debug_lines_follow_one_request_from_p_to_d(caplog: pytest.LogCaptureFixture) -> None:
    """At DEBUG, P's hold, claim and release and D's pull steps all name the request and P's hold id."""
    import logging

    pair = Pair()
    try:
        with caplog.at_level(logging.DEBUG, logger="vllm.kvp2p"):
            pair.holds.hold("req-dbg", "h-dbg", 2)
            pair.pulls.submit(pair.plan("req-dbg", [1, 2], [3, 4], hold_id="h-dbg"))
            deadline = time.monotonic() + 30
            while not pair.pulls.take_results() and time.monotonic() < deadline:
                time.sleep(0.01)
        lines = [r.getMessage() for r in caplog.records if "req-dbg" in r.getMessage()]
        for expected in ("2 blocks kept for a decoder", "claim by", "release by", "SendClaim", "ReadBatch",
                         "done (pulled)"):
            assert any(expected in line for line in lines), (expected, lines)
        assert all(r.levelno <= logging.DEBUG for r in caplog.records if "req-dbg" in r.getMessage())
    finally:
        pair.close()


def _record_messages(p: Pair, strip_registration: bool = False) -> list[str]:
    """What D sends P's side channel, in order (and, with ``strip_registration``, P answering as a release that
    does not know ``Claim.with_registration``)."""
    import msgspec

    from vllm_kvp2p.contract.protocol import ClaimReply

    seen: list[str] = []
    handler = p.holds._server._handler

    def recording(message):
        seen.append(type(message).__name__ + ("+registration" if getattr(message, "with_registration", False) else ""))
        reply = handler(message)
        if strip_registration and isinstance(reply, ClaimReply):
            reply = msgspec.structs.replace(reply, registration=None)
        return reply

    p.holds._server._handler = recording
    return seen


def test_a_pull_from_a_new_p_claims_and_gets_the_registration_in_one_round_trip() -> None:
    p = Pair()
    seen = _record_messages(p)
    try:
        p.holds.hold("n1", "h1")
        p.pulls.submit(p.plan("n1", [1, 2], [3, 4]))
        assert p.wait_result().outcome is Outcome.PULLED
        assert seen == ["Claim+registration", "Release"]  # before: GetRegistration, Claim, Release
        seen.clear()
        p.holds.hold("n2", "h1")
        p.pulls.submit(p.plan("n2", [5], [6]))
        assert p.wait_result().outcome is Outcome.PULLED
        assert seen == ["Claim", "Release"]  # known P: the registration is cached
        for name in p.d_kv:
            assert torch.equal(p.d_kv[name][[3, 4, 6]], p.p_kv[name][[1, 2, 5]])
    finally:
        p.close()


def test_a_p_that_ignores_the_registration_request_is_asked_after_the_claim() -> None:
    p = Pair()
    seen = _record_messages(p, strip_registration=True)
    try:
        p.holds.hold("o1", "h1")
        p.pulls.submit(p.plan("o1", [7, 8], [9, 10]))
        result = p.wait_result()
        assert result.outcome is Outcome.PULLED, result.reason
        assert seen == ["Claim+registration", "GetRegistration", "Release"]
        for name in p.d_kv:
            assert torch.equal(p.d_kv[name][[9, 10]], p.p_kv[name][[7, 8]])
    finally:
        p.close()
