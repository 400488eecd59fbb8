"""P's integrity questions wait fairly (vllm_kvp2p/lifecycle/question_queue.py), and D never takes "P answered,
but busy" for "P down" (vllm_kvp2p/lifecycle/pull.py). Pure: no sockets, threads or clocks."""

from __future__ import annotations

import pytest

from tests.support.prompts import remote
from vllm_kvp2p.contract.protocol import ClaimReply, ClaimStatus, RankRegistration, RemotePrefill, UnitSums
from vllm_kvp2p.lifecycle import question_queue as qq
from vllm_kvp2p.lifecycle.consumer import Failure, PullPlan
from vllm_kvp2p.lifecycle.integrity import IntegrityMode, NoSums
from vllm_kvp2p.lifecycle.pull import ConsumerPull, Finish, LocalKV, Outcome, SendRelease, Source, Wait
from vllm_kvp2p.lifecycle.question_queue import Question, QuestionQueue
from vllm_kvp2p.transfer.descriptors import PlaneGeometry
from vllm_kvp2p.transfer.slicing import BlockShape
from vllm_kvp2p.transfer.tp_mapping import HeadSlice

MIB = 1 << 20
UNIT = 256 << 10  # a unit of 256 KiB


def question(request: str, reader: str = "d:0", units: int = 5, deadline: float = 30.0,
             unit: int = UNIT) -> Question[str]:
    return Question((request, "h", reader), (unit,) * units, deadline, f"{request}/{reader}")


def drain(queue: QuestionQueue[str], now: float = 0.0, seconds_per_slice: float = 0.02) -> list[str]:
    """Sum every slice in turn (each taking ``seconds_per_slice``); the order in which questions finish."""
    finished = []
    for _ in range(100_000):
        expired, work = queue.next_slice(now)
        finished += [f"{q.payload} (expired)" for q in expired]
        if work is None:
            return finished
        done = queue.slice_done(work, [(0, 0)] * (work.end - work.start), seconds_per_slice)
        if done is not None:
            finished.append(done.payload)
    raise AssertionError("did not drain")


def test_a_small_question_waits_one_slice_of_a_1_gib_one_not_all_of_it() -> None:
    queue: QuestionQueue[str] = QuestionQueue()
    big = question("hostile", units=4096)  # 1 GiB
    assert queue.admit(big, 0.0) == ("", [])
    first = queue.next_slice(0.0)[1]
    assert first is not None and first.question is big and first.end - first.start < 4096  # a slice, not all of it
    queue.slice_done(first, [(0, 0)] * (first.end - first.start), 0.02)
    assert queue.admit(question("honest"), 0.0) == ("", [])
    assert drain(queue)[0] == "honest/d:0"  # after one more slice of the big one at most
    # In arrival order, whole (as it was), it came after 1 GiB of sums.


def test_six_reader_names_on_one_hold_share_one_turn() -> None:
    """A reader name is free to invent: six names on one hold are one hold's turn, not six."""
    queue: QuestionQueue[str] = QuestionQueue(max_bytes=1 << 40)
    for i in range(6):
        assert queue.admit(question("hostile", f"x:{i}", units=1024), 0.0)[0] == ""
    assert queue.admit(question("honest", units=5), 0.0)[0] == ""
    order = drain(queue)
    assert order[0] == "honest/d:0" and order[1:] == [f"hostile/x:{i}" for i in range(6)]


def test_every_hold_gets_its_turn_in_order() -> None:
    queue: QuestionQueue[str] = QuestionQueue()
    for name in ("a", "b", "c"):
        queue.admit(question(name, units=400), 0.0)
    turns = []
    while (work := queue.next_slice(0.0)[1]) is not None:
        turns.append(work.question.key[0])
        queue.slice_done(work, [(0, 0)] * (work.end - work.start), 0.02)
    assert turns[:6] == ["a", "b", "c", "a", "b", "c"]


def test_the_bytes_bound_is_shared_max_min() -> None:
    """The hold with the largest share gives way: its newest question is pushed out (answered without sums) for
    another hold's; its own next question is refused rather than pushing out anyone's."""
    queue: QuestionQueue[str] = QuestionQueue()
    one_gib = [question("hostile", f"x:{i}", units=4096) for i in range(3)]
    assert queue.admit(one_gib[0], 0.0) == ("", []) and queue.admit(one_gib[1], 0.0) == ("", [])
    assert queue.queued_bytes == 2 << 30 == qq.MAX_QUEUED_BYTES
    why, pushed = queue.admit(one_gib[2], 0.0)
    assert "its hold's share" in why and pushed == []  # its own hold has the largest share
    why, pushed = queue.admit(question("honest"), 0.0)
    assert why == "" and pushed == [one_gib[1]]  # the newest of the largest share, not the one being summed
    assert queue.get(("hostile", "h", "x:1")) is None and len(queue) == 2
    too_big = question("other", units=4096 * 3)
    assert "more than P's question queue holds" in queue.admit(too_big, 0.0)[0]


def test_the_count_bound_is_shared_max_min() -> None:
    queue: QuestionQueue[str] = QuestionQueue(max_questions=4)
    hostile = [question("hostile", f"x:{i}", units=1) for i in range(4)]
    for q in hostile:
        assert queue.admit(q, 0.0)[0] == ""
    assert "its hold's share" in queue.admit(question("hostile", "x:9", units=1), 0.0)[0]
    why, pushed = queue.admit(question("honest", units=1), 0.0)
    assert why == "" and pushed == [hostile[-1]] and len(queue) == 4


def test_a_question_whose_sums_would_end_after_its_budget_is_answered_at_once() -> None:
    queue: QuestionQueue[str] = QuestionQueue(max_bytes=1 << 40)  # the time bound alone
    queue.seconds_per_byte = 0.004 / MIB  # measured: 4 ms/MiB
    queue.admit(question("hostile", "x:0", units=4096), 0.0)  # 1 GiB: 4 s of sums
    # Another hold's 5 units wait a slice of it: admitted within a 2 s budget.
    assert queue.admit(question("honest", units=5, deadline=1.8), 0.0)[0] == ""
    # The same hold's next 1 GiB would end after ~8 s: not within 2 s, within 30 s.
    why, _ = queue.admit(question("hostile", "x:1", units=4096, deadline=1.8), 0.0)
    assert "after the reader's budget" in why
    assert queue.admit(question("hostile", "x:2", units=4096, deadline=29.8), 0.0)[0] == ""


def test_a_question_still_waiting_at_its_deadline_is_answered_then() -> None:
    queue: QuestionQueue[str] = QuestionQueue()
    slow = question("a", units=4096, deadline=4.8)
    queue.admit(slow, 0.0)
    assert queue.next_slice(4.0)[0] == []
    expired, work = queue.next_slice(4.8)
    assert expired == [slow] and work is None and len(queue) == 0 and queue.queued_bytes == 0


def test_an_empty_queue_admits_whatever_the_speed_measured() -> None:
    """Nothing to wait for: the question is summed, and its slices measure the speed afresh (a slow spell does not
    turn every later question away), and answered at its deadline if the sums are still that slow."""
    queue: QuestionQueue[str] = QuestionQueue(seconds_per_byte=1.0 / MIB)  # 5 units: 1.25 s
    assert queue.admit(question("a", units=5, deadline=1.0), 0.0) == ("", [])
    work = queue.next_slice(0.0)[1]
    assert work is not None and (work.start, work.end) == (0, 1)
    queue.slice_done(work, [(0, 0)], 0.001)
    assert queue.seconds_per_byte < 1.0 / MIB * (1 - qq.RATE_WEIGHT + 0.01)  # the slow spell is being forgotten


def test_a_question_that_a_slice_would_make_late_is_answered_before_that_slice() -> None:
    """A slice cannot be interrupted: a question whose deadline comes before the next slice would end is answered
    without sums now, not after it (when D may have stopped waiting)."""
    queue: QuestionQueue[str] = QuestionQueue(seconds_per_byte=1.0 / MIB)  # one unit: 0.25 s
    big, small = question("a", units=8, deadline=29.8), question("b", units=4, deadline=2.5)
    assert queue.admit(big, 0.0)[0] == "" and queue.admit(small, 0.0)[0] == ""  # b's sums end by ~2.25 s
    expired, work = queue.next_slice(0.0)
    assert expired == [] and work is not None and work.question is big
    queue.slice_done(work, [(0, 0)], 0.25)
    expired, work = queue.next_slice(0.25)
    assert expired == [] and work is not None and work.question is small
    queue.slice_done(work, [(0, 0)], 0.25)
    expired, work = queue.next_slice(2.3)  # late (another thread took the core): a's slice would end at 2.55
    assert expired == [small] and work is not None and work.question is big


@pytest.mark.parametrize(("within_ms", "budget"), [(0, qq.DEFAULT_BUDGET_S), (2000, 2.0), (10**9, qq.MAX_BUDGET_S)])
def test_the_deadline_is_the_readers_budget_from_arrival_less_the_answers_way_back(within_ms: int,
                                                                                   budget: float) -> None:
    assert QuestionQueue.deadline(100.0, within_ms) == pytest.approx(100.0 + budget - qq.ANSWER_MARGIN_S)
    assert "no time for sums" in QuestionQueue().admit(question("a", deadline=5.0), 5.0)[0]


def test_slices_follow_the_speed_measured() -> None:
    queue: QuestionQueue[str] = QuestionQueue()
    queue.seconds_per_byte = 0.002 / MIB
    assert queue.slice_bytes == 10 * MIB  # 20 ms at 2 ms/MiB
    queue.seconds_per_byte = 1.0 / MIB
    assert queue.slice_bytes == qq.MIN_COST_BYTES  # at least one unit is read whatever this is
    queue.admit(question("a", units=3, unit=4 * MIB), 0.0)
    work = queue.next_slice(0.0)[1]
    assert work is not None and (work.start, work.end) == (0, 1)


def test_sums_that_fail_end_the_question_and_one_answered_meanwhile_is_ignored() -> None:
    queue: QuestionQueue[str] = QuestionQueue()
    a, b = question("a", units=4096), question("b")
    queue.admit(a, 0.0)
    work = queue.next_slice(0.0)[1]
    assert work is not None and queue.drop(a) and not queue.drop(a)
    assert queue.slice_done(work, [(0, 0)] * (work.end - work.start), 0.01) is None  # answered meanwhile
    queue.admit(b, 0.0)
    work = queue.next_slice(0.0)[1]
    assert work is not None
    done = queue.slice_done(work, None, 0.01)
    assert done is b and b.sums is None and len(queue) == 0 and queue.queued_bytes == 0


def test_unit_bytes_are_what_the_ranges_ask() -> None:
    assert qq.unit_bytes([[0, 16, 32, 16], [4, -8], []]) == (32, 0, 0)


# ------------------------------------------------------------------ D: the budget it states, and "busy"

SHAPE = BlockShape(True, 2, 16, 16)  # 2 heads x 16 tokens x 16 B = 512 B blocks
PLANES = [PlaneGeometry((1 << 30) + i * 1_000_000, 512, 512, 100) for i in range(2)]
LOCAL = LocalKV(tuple(PlaneGeometry((1 << 20) + i * 1_000_000, 512, 512, 100) for i in range(2)), (SHAPE, SHAPE),
                16, ("l0", "l1"), "float32", 2)
SRC = Source(0, 1, (HeadSlice(0, 0, 0, 2),))


def released_job(*, release_timeout: float = 2.0, timeout: float = 10.0,
                 at: float = 1.0) -> tuple[ConsumerPull, SendRelease]:
    """A pull at integrity=full, read by t = 1, at its release (at t = ``at``)."""
    plan = PullPlan("d1", RemotePrefill.from_params(remote([list(range(10, 14))], 60, 16).to_params()),
                    ((3, 4, 9),), ((10, 11, 12),), awaiting=True)
    job = ConsumerPull(plan, [SRC], "d:0", LOCAL, claim_wait=1.0, max_batch_entries=1024, now=0.0,
                       timeout=timeout, release_timeout=release_timeout, integrity=IntegrityMode.FULL)
    job.next_action(0)
    job.on_registration(SRC, RankRegistration("P", 0, 1, "127.0.0.1:1", PLANES, [SHAPE] * 2, ["l0", "l1"], 16,
                                              100, "float32", 2, 2, 8))
    job.next_action(0)
    job.on_claim_reply(SRC, ClaimReply(ClaimStatus.GRANTED, lease=30, lease_token="t"), now=0)
    while not isinstance(action := job.next_action(1.0), SendRelease):
        job.on_batch_done(action.source, True)
    action = job.next_action(at)
    assert isinstance(action, SendRelease)
    return job, action


def test_ds_release_states_how_long_it_waits_for_the_answer() -> None:
    _, release = released_job(release_timeout=2.0)
    assert release.verification is not None and release.message.answer_within_ms == 2000
    # Late, the releases' budget left is less: pull_timeout 1.5 s + release_timeout 2 s from t = 0, at t = 3.
    _, late = released_job(release_timeout=2.0, timeout=1.5, at=3.0)
    assert late.verification is not None and late.message.answer_within_ms == 500


def test_p_busy_leaves_the_pull_unverified_with_its_reason_never_failed() -> None:
    job, release = released_job()
    job.on_release_sent(SRC, True, [(1, 1)] * 6, None, False, NoSums.BUSY.value)
    result = job.next_action(1.0)
    assert isinstance(result, Finish) and result.result.outcome is Outcome.PULLED
    assert result.result.unverified and result.result.unverified_reason == "P rank 0: busy"
    assert result.result.integrity == "unverified"
    job, _ = released_job()
    job.on_release_sent(SRC, True, [(1, 1)] * 6, None)  # an older P says nothing
    final = job.next_action(1.0)
    assert isinstance(final, Finish) and "older release" in final.result.unverified_reason
    job, _ = released_job()
    job.on_release_sent(SRC, True, [(1, 1)] * 6, [UnitSums(1, 1)] * 6)
    final = job.next_action(1.0)
    assert isinstance(final, Finish) and final.result.verified_units == 6 and not final.result.unverified_reason


def test_a_release_p_answers_with_an_error_is_sent_again_then_times_out_never_unreachable() -> None:
    """P up but busy (an older P's full deferred answers: "try again") is not P down: D sends the release again
    within its budget, and past it the pull fails as ``timeout`` (P not made suspect), not ``unreachable``."""
    job, release = released_job(release_timeout=2.0, timeout=10.0)
    job.on_release_refused(SRC, 1.0, "1024 requests already waiting for their answers: try again")
    assert job.next_action(1.05) == Wait(1.1)
    again = job.next_action(1.1)
    assert isinstance(again, SendRelease)
    job.on_release_sent(SRC, True, [(1, 1)] * 6, [UnitSums(1, 1)] * 6)  # answered this time: a good pull
    final = job.next_action(1.2)
    assert isinstance(final, Finish) and final.result.outcome is Outcome.PULLED and final.result.verified_units

    job, _ = released_job(release_timeout=2.0, timeout=10.0)
    now = 1.0
    while isinstance(action := job.next_action(now), (SendRelease, Wait)):
        if isinstance(action, SendRelease):
            job.on_release_refused(SRC, now, "1024 requests already waiting for their answers: try again")
        now += 0.05
    assert isinstance(action, Finish) and now >= 12.0  # the releases' budget: pull_timeout + release_timeout
    assert action.result.failure is Failure.TIMEOUT and action.result.unreachable_rank is None
    assert "try again" in action.result.reason
