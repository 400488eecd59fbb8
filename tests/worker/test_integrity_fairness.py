"""Integrity answers fair to every reader (issue 45, item 2): one side-channel peer with leases on its own hold
cannot fail another reader's verified pull, neither by queueing 1 GiB questions on P's one sums thread nor by
resending one release 1,100 times into P's table of deferred answers. A real HoldService and PullLoop over a real
ZMQ side channel, real Mooncake pulls at ``integrity=full``, and P holding ~1 GiB of KV made cheaply (allocated,
never written but for the honest blocks: the kernel backs the rest with its zero page, which the sums read).

P's sums are slowed to ~5 ms/MiB (the review saw six 1 GiB questions delay an honest release's sums to t = 24 s:
4 ms/MiB; here they run at ~1-1.5 ms/MiB on an idle core): a sleep after the real sums, which also lets a test stop
them at once when it is done. Each attack is shown failing the honest pull without its fix (the question queue
as it was: one whole question at a time, in arrival order; the side channel as it was: a slot per copy)."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future

import pytest
import torch
import zmq

from tests.support.ports import free_port
from tests.worker.engine_teardown import close_later
from vllm_kvp2p.contract import protocol
from vllm_kvp2p.contract.protocol import (
    Claim,
    ClaimStatus,
    DigestQuery,
    RankRegistration,
    Release,
    RemotePrefill,
    Reply,
    Request,
    UnitRanges,
)
from vllm_kvp2p.contract.side_channel import MAX_COPIES, MAX_DEFERRED, SideChannelClient
from vllm_kvp2p.decode import pull_loop
from vllm_kvp2p.decode.pull_loop import PullLoop
from vllm_kvp2p.lifecycle.consumer import Failure, PullPlan
from vllm_kvp2p.lifecycle.integrity import IntegrityMode
from vllm_kvp2p.lifecycle.pull import LocalKV, Outcome, PullResult
from vllm_kvp2p.lifecycle.question_queue import Question, QuestionQueue, Slice
from vllm_kvp2p.prefill.hold_service import HoldService
from vllm_kvp2p.transfer.digest import KVMemory, sums_of_units
from vllm_kvp2p.transfer.engine import MooncakeEngine
from vllm_kvp2p.transfer.layout import AttentionInterior, TensorView, coalesce_regions, kv_geometry

NUM_LAYERS, HEADS, BLOCK, HEAD = 3, 2, 16, 1024
UNIT = HEADS * BLOCK * 2 * HEAD * 4  # 256 KiB: one block of one layer, float32
P_BLOCKS, D_BLOCKS = 1400, 8  # P: 1.03 GiB of KV
HONEST = [0, 1, 2, 3]  # the honest request's blocks on P (written), read into D's 0..3
HOSTILE = list(range(16, 16 + 1366))  # the hostile peer's own hold: 4098 units, 1 GiB
GIB_QUESTION = [UnitRanges(p, b, [0, UNIT]) for b in HOSTILE for p in range(NUM_LAYERS)][:4096]  # 4096 units: 1 GiB
SLOW_S_PER_MIB = 0.004  # added to P's real sums (~1-1.5 ms/MiB here): ~5 ms/MiB in all
SIDE_CHANNEL_TIMEOUT = 1.0  # D's budget for each side-channel call, its release included


class SlowSums:
    """P's digester: a sleep of ``s_per_mib`` per MiB asked, then the real sums over P's KV; once ``stop`` is set it
    raises at once (the test is over: the hostile questions waiting are answered without sums)."""

    def __init__(self, real: Callable[[DigestQuery], list[tuple[int, int]]], s_per_mib: float) -> None:
        self.real = real
        self.s_per_mib = s_per_mib
        self.stop = threading.Event()

    def __call__(self, query: DigestQuery) -> list[tuple[int, int]]:
        asked = sum(sum(u.ranges[1::2]) for u in query.units)
        if self.stop.wait(asked / (1 << 20) * self.s_per_mib):
            raise RuntimeError("the test is over")
        return self.real(query)


class AsBefore:
    """P's question queue as it was, the control: one whole question at a time, in arrival order, at most 64
    waiting, no budget (the same interface as lifecycle/question_queue.QuestionQueue)."""

    max_questions = 64

    def __init__(self) -> None:
        self._waiting: deque[Question] = deque()

    def __len__(self) -> int:
        return len(self._waiting)

    def get(self, key: tuple[str, str, str]) -> Question | None:
        return next((q for q in self._waiting if q.key == key), None)

    def admit(self, question: Question, now: float) -> tuple[str, list[Question]]:
        if len(self._waiting) >= self.max_questions:
            return "64 questions already wait", []
        self._waiting.append(question)
        return "", []

    def next_slice(self, now: float) -> tuple[list[Question], Slice | None]:
        return [], Slice(self._waiting[0], 0, len(self._waiting[0].unit_bytes)) if self._waiting else None

    def slice_done(self, done: Slice, sums, seconds: float) -> Question | None:
        self._waiting.remove(done.question)
        done.question.sums = list(sums) if sums is not None else None
        return done.question

    def drop(self, question: Question) -> bool:
        self._waiting.remove(question)
        return True


def _geometry(kv: dict[str, torch.Tensor], num_blocks: int):
    layers = [(n, [TensorView(t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.element_size())])
              for n, t in kv.items()]
    planes, shapes = kv_geometry(layers, num_blocks, BLOCK, HEADS, head_size=HEAD,
                                 interior=AttentionInterior.HEAD_MAJOR_KV_HALVES)
    return planes, shapes, coalesce_regions([v for _, vs in layers for v in vs])


class BigPair:
    """P (~1 GiB of KV) and D (8 blocks) in one process: HoldService, PullLoop at integrity=full, two Mooncake
    engines over TCP on 127.0.0.1."""

    def __init__(self, questions: AsBefore | QuestionQueue | None = None, slow: float = SLOW_S_PER_MIB) -> None:
        names = [f"model.layers.{i}.self_attn" for i in range(NUM_LAYERS)]
        g = torch.Generator().manual_seed(5)
        self.p_kv = {n: torch.empty(P_BLOCKS, HEADS, BLOCK, 2 * HEAD) for n in names}  # not written: not backed
        for t in self.p_kv.values():
            t[: len(HONEST)].normal_(generator=g)
        self.d_kv = {n: torch.zeros(D_BLOCKS, HEADS, BLOCK, 2 * HEAD) for n in names}
        p_planes, p_shapes, p_regions = _geometry(self.p_kv, P_BLOCKS)
        d_planes, d_shapes, d_regions = _geometry(self.d_kv, D_BLOCKS)
        self.p_engine = MooncakeEngine("127.0.0.1", "tcp", transfer_timeout=5)
        self.p_engine.register(p_regions)
        self.d_engine = MooncakeEngine("127.0.0.1", "tcp", transfer_timeout=5)
        self.d_engine.register(d_regions)
        self.port, self.engine_id = free_port(), "p-" + uuid.uuid4().hex[:6]
        reg = RankRegistration(self.engine_id, 0, 1, self.p_engine.segment, p_planes, p_shapes, names, BLOCK,
                               P_BLOCKS, "float32", HEADS, HEADS, HEAD)
        p_memory = KVMemory(list(self.p_kv.values()))
        self.sums = SlowSums(lambda query: sums_of_units(p_memory, p_planes, query), slow)
        self.holds = HoldService(reg, "127.0.0.1", self.port, hold_timeout=60, lease_timeout=60, digester=self.sums,
                                 questions=questions)  # type: ignore[arg-type]
        local = LocalKV(tuple(d_planes), tuple(d_shapes), BLOCK, tuple(names), "float32", HEADS)
        self.pulls = PullLoop(self.d_engine, reader="d:0", tp_size=1, tp_rank=0, local=local,
                              side_channel_timeout=SIDE_CHANNEL_TIMEOUT, claim_wait=1.0, max_batch_entries=64,
                              integrity=IntegrityMode.FULL, memory=KVMemory(list(self.d_kv.values())))
        self.releases_seen = 0
        handle = self.holds._server._handler

        def counting(message: Request) -> Reply | Future[Reply]:
            if isinstance(message, Release):
                self.releases_seen += 1
            return handle(message)

        self.holds._server._handler = counting

    def honest_pull(self, request_id: str = "honest") -> tuple[PullResult, float]:
        """The honest reader's pull of HONEST (verified in full); its result and how long it took."""
        self.holds.hold(request_id, "h1", len(HONEST), [HONEST])
        remote = RemotePrefill(self.engine_id, request_id, "127.0.0.1", self.port, [HONEST], "h1",
                               len(HONEST) * BLOCK, BLOCK)
        t0 = time.monotonic()
        self.pulls.submit(PullPlan("d-" + request_id, remote, (tuple(range(len(HONEST))),), (tuple(HONEST),), True))
        deadline = t0 + 20
        while time.monotonic() < deadline:
            results = self.pulls.take_results()
            if results:
                return results[0].result, time.monotonic() - t0
            time.sleep(0.01)
        raise TimeoutError("no pull result")

    def claim(self, request_id: str, reader: str) -> str:
        """A lease on the hostile peer's own hold, by ``reader`` (a name it makes up): its token."""
        client = SideChannelClient(5.0)
        try:
            reply = client.request("127.0.0.1", self.port, Claim(request_id, "h1", reader, 1, "c-" + reader))
        finally:
            client.close()
        assert reply.status is ClaimStatus.GRANTED, reply
        return reply.lease_token

    def wait_for(self, what: Callable[[], bool], timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not what():
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.01)

    def close(self) -> None:
        self.sums.stop.set()
        self.pulls.close()
        self.holds.close()
        close_later(self.d_engine, self.p_engine)


@pytest.fixture
def make_pair() -> Iterator[Callable[..., BigPair]]:
    made: list[BigPair] = []

    def make(**kwargs) -> BigPair:
        made.append(BigPair(**kwargs))
        return made[-1]

    yield make
    for pair in made:
        pair.close()


def hostile_release(request_id: str, reader: str, token: str, question: list[UnitRanges]) -> bytes:
    """A release by the hostile peer asking ``question`` of its own hold, with the longest budget P takes."""
    return protocol.encode(Release(request_id, "h1", reader, 1, True, token, DigestQuery(question),
                                   answer_within_ms=60_000))


def send_all(port: int, frames: list[bytes]) -> zmq.Socket:
    """Every frame on one DEALER socket, not waiting for answers (a peer may send as it likes)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    for frame in frames:
        sock.send_multipart([b"", frame])
    return sock


def assert_not_failed(result: PullResult) -> None:
    """Verified in full, or unverified with P's reason; never failed."""
    assert result.outcome is Outcome.PULLED, (result.failure, result.reason)
    assert result.verified_units == len(HONEST) * NUM_LAYERS or result.unverified_reason, result


@pytest.mark.parametrize("fair", [True, False], ids=["fair-queue", "queue-as-before"])
def test_six_1gib_questions_of_one_hold_do_not_fail_another_readers_verified_pull(
        make_pair: Callable[..., BigPair], fair: bool) -> None:
    """A peer claims its own hold (1 GiB on P) under six reader names and asks each time for all of it. The honest
    reader's question comes after: with the fair queue it waits for one slice of theirs (~20 ms), and the six are
    admitted only within the queue's bytes (2 GiB: two of them; the others answered at once without sums); before,
    it waited behind all six (~30 s of sums) and D, with no answer within its 1 s, failed the pull as
    ``unreachable`` and took P for down."""
    pair = make_pair(questions=None if fair else AsBefore())
    readers = [f"x:{i}" for i in range(6)]
    pair.holds.hold("hostile", "h1", len(HOSTILE), [HOSTILE])
    tokens = {reader: pair.claim("hostile", reader) for reader in readers}
    flood = send_all(pair.port, [hostile_release("hostile", r, tokens[r], GIB_QUESTION) for r in readers])
    try:
        pair.wait_for(lambda: pair.releases_seen == 6)
        result, took = pair.honest_pull()
        print(f"honest pull: {result.outcome.value} in {took:.2f} s, verified units {result.verified_units}, "
              f"{result.unverified_reason or result.reason}")
        if fair:
            assert_not_failed(result)
            assert result.verified_units == len(HONEST) * NUM_LAYERS  # it waited a slice, not 2 GiB
            assert pair.holds.counters()["integrity_questions_busy"] >= 4  # 4 of 6 hostile ones did not fit
            assert pair.pulls.table_sizes()["suspects"] == 0
        else:
            assert result.outcome is Outcome.FAILED and result.failure is Failure.UNREACHABLE, result
            assert pair.pulls.table_sizes()["suspects"] == 1  # P, up and answering everything else, taken for down
    finally:
        flood.close()


@pytest.mark.parametrize("before", [(), ("side channel",), ("side channel", "D")],
                         ids=["fixed", "side-channel-as-before", "side-channel-and-d-as-before"])
def test_one_release_resent_1100_times_does_not_fail_another_readers_verified_pull(
        make_pair: Callable[..., BigPair], monkeypatch: pytest.MonkeyPatch, before: tuple[str, ...]) -> None:
    """A peer with two leases on its own hold asks 1 GiB with the first and 4 units with the second, which waits
    behind the first (its hold's questions are summed in order: ~5 s), and resends that second release 1,100 times.
    With copies sharing one slot of P's deferred answers the honest reader's release is deferred as usual and
    verified. With the side channel as before (a slot per copy) the copies fill its 1,024 slots and the honest
    release is answered with an error: D as before took that for silence and failed the pull as ``unreachable``,
    P suspect (the review's finding); D now sends the release again within its budget and never takes P for down
    (here P had queued the first one all the same and answers the copy with its kept sums)."""
    pair = make_pair()
    if "side channel" in before:  # it files each copy under a slot of its own, as it did
        handle, seen = pair.holds._server._handler, set()

        def a_slot_per_copy(message: Request) -> Reply | Future[Reply]:
            answer = handle(message)
            if not isinstance(answer, Future):
                return answer
            if answer not in seen:
                seen.add(answer)
                return answer
            copy: Future[Reply] = Future()
            answer.add_done_callback(lambda f: copy.set_result(f.result()))
            return copy

        pair.holds._server._handler = a_slot_per_copy
    if "D" in before:  # an error answer to a release handled as no answer at all, as it was
        monkeypatch.setattr(pull_loop, "PeerError", type("NothingRaisesThis", (Exception,), {}))
    pair.holds.hold("hostile", "h1", len(HOSTILE), [HOSTILE])
    first, second = pair.claim("hostile", "x:0"), pair.claim("hostile", "x:1")
    resent = hostile_release("hostile", "x:1", second, GIB_QUESTION[-4:])  # small: 1,100 copies decode quickly
    copies = MAX_DEFERRED + 76
    flood = send_all(pair.port, [hostile_release("hostile", "x:0", first, GIB_QUESTION)] + [resent] * (1 + copies))
    try:
        pair.wait_for(lambda: pair.releases_seen == 2 + copies)
        dropped = pair.holds._server.dropped
        result, took = pair.honest_pull()
        print(f"honest pull: {result.outcome.value} in {took:.2f} s, verified units {result.verified_units}, "
              f"{result.unverified_reason or result.reason}; side channel dropped {dict(dropped)}")
        assert pair.holds.table_sizes()["questions_waiting"] >= 1, "the resent release was answered too soon"
        if not before:
            assert_not_failed(result)
            assert result.verified_units == len(HONEST) * NUM_LAYERS
            assert dropped["resent_copy_dropped"] == copies + 1 - MAX_COPIES and dropped["deferred_full"] == 0
        else:
            assert dropped["deferred_full"] > copies + 1 - MAX_DEFERRED  # the copies' and the honest release's
        if "D" in before:
            assert result.outcome is Outcome.FAILED and result.failure is Failure.UNREACHABLE, result
            assert pair.pulls.table_sizes()["suspects"] == 1
        else:
            assert result.failure is not Failure.UNREACHABLE, result
            assert pair.pulls.table_sizes()["suspects"] == 0  # P answered: never taken for down
    finally:
        flood.close()


@pytest.mark.parametrize("fair", [True, False], ids=["budget-kept", "queue-as-before"])
def test_p_too_slow_for_the_readers_budget_answers_at_once_and_d_counts_the_pull_unverified_with_why(
        make_pair: Callable[..., BigPair], caplog: pytest.LogCaptureFixture, fair: bool) -> None:
    """P's sums are slow (1 s/MiB, as P has measured them) and another reader's question waits: the honest reader's
    3 MiB cannot be summed within its 1 s. P answers its release at once without sums (``busy``), not after D gave
    up, and D counts the pull unverified with that reason and a WARNING; P is not suspect, nothing fails. As before
    (no budget) the release waited for the sums, D gave up first and failed the pull as ``unreachable``."""
    queue = QuestionQueue(seconds_per_byte=1.0 / (1 << 20)) if fair else AsBefore()
    pair = make_pair(questions=queue, slow=1.0)
    pair.holds.hold("other", "h1", len(HOSTILE), [HOSTILE])
    token = pair.claim("other", "x:0")
    other = send_all(pair.port, [hostile_release("other", "x:0", token, GIB_QUESTION[:8])])  # 2 MiB: ~2 s
    try:
        pair.wait_for(lambda: pair.holds.table_sizes()["questions_waiting"] == 1)
        with caplog.at_level(logging.WARNING, logger="vllm.kvp2p.pull_log"):
            result, took = pair.honest_pull()
        print(f"honest pull: {result.outcome.value} in {took:.2f} s: {result.unverified_reason or result.reason}")
        if not fair:
            assert result.outcome is Outcome.FAILED and result.failure is Failure.UNREACHABLE, result
            return
        assert result.outcome is Outcome.PULLED and result.unverified, result
        # Answered before D's 1 s deadline (had D given up first, the pull would have failed, not be unverified).
        assert result.unverified_reason == "P rank 0: busy" and result.integrity == "unverified"
        assert any("counts as unverified: P rank 0: busy" in r.getMessage() for r in caplog.records)
        assert pair.holds.counters()["integrity_questions_busy"] == 1
        assert pair.pulls.table_sizes()["suspects"] == 0
    finally:
        other.close()


def test_a_question_the_sums_thread_fails_on_is_answered_and_the_next_is_summed(
        make_pair: Callable[..., BigPair], monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug on one question (here: its check raises) must not stop P's sums thread: that release is answered
    without sums (D counts the pull unverified, never failed) and the next reader's question is summed."""
    import vllm_kvp2p.prefill.hold_service as hold_service

    real, calls = hold_service.query_problem, []

    def failing_once(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a bug in the question's check")
        return real(*args, **kwargs)

    monkeypatch.setattr(hold_service, "query_problem", failing_once)
    pair = make_pair()
    first, _ = pair.honest_pull("first")
    assert first.outcome is Outcome.PULLED and first.unverified, first
    second, _ = pair.honest_pull("second")
    assert_not_failed(second)
    assert second.verified_units == len(HONEST) * NUM_LAYERS, second
