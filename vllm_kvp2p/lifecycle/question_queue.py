"""P side: the integrity questions waiting for their sums (vllm_kvp2p/lifecycle/integrity.py), and which units the
sums thread reads next. Pure: no threads, clocks or torch; the adapter (vllm_kvp2p/prefill/hold_service.py) gives it the
time and how long each slice of sums took.

Fair to every reader, whatever other peers ask:

* **Served per hold, in turn, a slice at a time.** The sums thread reads one slice (a few units, about
  ``SLICE_SECONDS`` of sums at the speed measured) of the first question of the hold whose turn it is, then the
  next hold takes its turn. So a question waits for about one slice of every other hold with questions, never for
  their whole questions: six 1 GiB questions of one hold delay another hold's 5-unit question by one slice, not by
  6 GiB of sums. A hold, not a reader name, is what shares: a reader name is free to invent (six names on one hold
  are six readers), a hold is a prompt P prefilled and pins.
* **Bounded in bytes** (what the sums will read; ``MAX_QUEUED_BYTES``) and in questions (``MAX_QUESTIONS``),
  shared max-min: a question that does not fit pushes out the newest question of the hold with the largest share
  (answered at once without sums), unless that is its own hold (then it is answered so itself). A hold's share is
  taken only from holds that have more.
* **Answered within the asking reader's budget.** D's release says how long D waits for its answer
  (``Release.answer_within_ms``, a duration from its arrival: no clocks to agree on, unlike the claim's
  ``deadline_ms``, D's wall clock that may be ``clock_skew``, 30 s, off P's). A question whose sums would end after
  that, at the speed measured and with its fair share of the thread, is answered at once without sums; one still
  waiting at its deadline is answered then, without sums. Either way D counts the pull ``unverified``, with the
  reason, and never waits past its budget for an answer (it took "no answer" for "P down").
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")
HoldKey = tuple[str, str]  # (request id, hold id)
ReleaseKey = tuple[str, str, str]  # (request id, hold id, reader)

MAX_QUESTIONS = 64  # waiting at once (each one deferred answer: within side_channel.MAX_DEFERRED)
#: What the sums of every question waiting may read at once: a maximal honest question (4096 units of 512 KiB,
#: 2 GiB) fits alone; ~3-4 s of one core at the 1.2-1.9 ms/MiB measured.
MAX_QUEUED_BYTES = 2 << 30
DEFAULT_BUDGET_S = 5.0  # an older D says nothing: its side_channel_timeout's default
MAX_BUDGET_S = 30.0  # a reader's budget is taken up to this
ANSWER_MARGIN_S = 0.2  # the answer's way back to D: P answers this much before the reader's budget ends
SLICE_SECONDS = 0.02  # sums per turn, at the speed measured
MIN_COST_BYTES = 256 << 10  # a slice costs at least this much (a few tensor calls, however few its bytes)
MAX_SLICE_BYTES = 64 << 20
#: Until measured: 8 ms/MiB, 4x the speed of whole-block sums on an idle core (docs/performance.md), so that a P
#: whose sums turn out slow does not start with a long slice (they measured 40-80 ms/MiB beside two busy threads).
FIRST_SECONDS_PER_BYTE = 0.008 / (1 << 20)
RATE_WEIGHT = 0.3  # of the latest slice in the speed measured


@dataclass(eq=False)
class Question(Generic[T]):
    """One release's integrity question, waiting: the one record of its progress. ``payload``: the adapter's (the
    release and where its answer goes)."""

    key: ReleaseKey
    unit_bytes: tuple[int, ...]  # what the sums read of each unit, in the question's order
    deadline: float  # answered without sums once this passes
    payload: T
    summed: int = 0  # units summed so far (the next slice starts there)
    left: int = 0  # bytes not yet summed
    sums: list[tuple[int, int]] | None = field(default_factory=list)  # None: the sums failed

    def __post_init__(self) -> None:
        self.left = sum(self.unit_bytes)

    @property
    def hold(self) -> HoldKey:
        return self.key[0], self.key[1]

    @property
    def bytes(self) -> int:
        return sum(self.unit_bytes)


@dataclass(frozen=True)
class Slice(Generic[T]):
    """Units ``start`` .. ``end`` of ``question``: what the sums thread reads next."""

    question: Question[T]
    start: int
    end: int

    @property
    def bytes(self) -> int:
        return sum(self.question.unit_bytes[self.start:self.end])


def unit_bytes(ranges: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """The bytes each unit's ranges (``[offset, length, ...]``) ask, as stated (negative lengths count 0: the
    question is refused by its check before any sums)."""
    return tuple(sum(max(0, n) for n in r[1::2]) for r in ranges)


class QuestionQueue(Generic[T]):
    """The questions waiting, per hold in turn order (the first hold's first question is served next)."""

    def __init__(self, *, max_questions: int = MAX_QUESTIONS, max_bytes: int = MAX_QUEUED_BYTES,
                 seconds_per_byte: float = FIRST_SECONDS_PER_BYTE) -> None:
        """``seconds_per_byte``: the speed of the sums until measured."""
        self.max_questions = max_questions
        self.max_bytes = max_bytes
        self.seconds_per_byte = seconds_per_byte
        self._holds: OrderedDict[HoldKey, deque[Question[T]]] = OrderedDict()
        self._by_key: dict[ReleaseKey, Question[T]] = {}
        self.queued_bytes = 0  # not yet summed, of every question waiting

    def __len__(self) -> int:
        return len(self._by_key)

    def get(self, key: ReleaseKey) -> Question[T] | None:
        return self._by_key.get(key)

    @staticmethod
    def deadline(now: float, answer_within_ms: int) -> float:
        """When a question arriving ``now`` is answered at the latest: the reader's budget (its release's
        ``answer_within_ms``; 0, an older D: ``DEFAULT_BUDGET_S``), at most ``MAX_BUDGET_S``, less the margin for
        the answer's way back."""
        budget = answer_within_ms / 1000 if answer_within_ms > 0 else DEFAULT_BUDGET_S
        return now + min(budget, MAX_BUDGET_S) - ANSWER_MARGIN_S

    @property
    def slice_bytes(self) -> int:
        """About ``SLICE_SECONDS`` of sums at the speed measured (at least one unit is read whatever this is)."""
        return int(min(MAX_SLICE_BYTES, max(MIN_COST_BYTES, SLICE_SECONDS / self.seconds_per_byte)))

    def admit(self, question: Question[T], now: float) -> tuple[str, list[Question[T]]]:
        """Queue ``question`` ("", and the questions pushed out for it, to be answered at once without sums), or
        why not (it is answered at once without sums; nothing pushed out)."""
        if question.bytes > self.max_bytes:
            return f"it asks {question.bytes} bytes, more than P's question queue holds ({self.max_bytes})", []
        if question.deadline <= now:
            return "the reader's budget leaves no time for sums", []
        if self._by_key:  # an empty queue admits: nothing to wait for, and its sums measure the speed afresh
            wait = self.estimate(question.hold, question.bytes)
            if now + wait > question.deadline:
                return (f"its sums would end in about {wait:.2f} s, after the reader's budget ({len(self)} "
                        f"questions of {len(self._holds)} holds waiting)"), []
        victims = self._room_for(question)
        if victims is None:
            return "its hold's share of P's question queue is full", []
        for victim in victims:
            self._remove(victim)
        self._by_key[question.key] = question
        self._holds.setdefault(question.hold, deque()).append(question)
        self.queued_bytes += question.left
        return "", victims

    def estimate(self, hold: HoldKey, nbytes: int) -> float:
        """Seconds until a question of ``nbytes`` of ``hold`` arriving now is summed: its hold's questions ahead and
        its own, and meanwhile every other hold's turns (each at most as much as this hold needs), and the slice
        being read."""
        step = self.slice_bytes
        own = max(nbytes, MIN_COST_BYTES) + sum(max(q.left, MIN_COST_BYTES) for q in self._holds.get(hold, ()))
        share = math.ceil(own / step) * step
        others = sum(min(share, sum(max(q.left, MIN_COST_BYTES) for q in questions))
                     for key, questions in self._holds.items() if key != hold)
        return (own + others + step) * self.seconds_per_byte

    def next_slice(self, now: float) -> tuple[list[Question[T]], Slice[T] | None]:
        """The questions that would be answered after their deadline (removed: answer them without sums now), and
        the next slice to sum, of the hold whose turn it is (which then goes to the back of the turn order). A
        question is answered late if its deadline comes before the slice about to be read ends (a slice cannot be
        interrupted), its own slice included."""
        expired: list[Question[T]] = []
        while self._holds:
            hold, questions = next(iter(self._holds.items()))
            question = questions[0]
            end, taken, step = question.summed, 0, self.slice_bytes
            while end < len(question.unit_bytes) and (end == question.summed or
                                                      taken + question.unit_bytes[end] <= step):
                taken += question.unit_bytes[end]
                end += 1
            ends = now + max(taken, MIN_COST_BYTES) * self.seconds_per_byte
            late = [q for q in self._by_key.values() if q.deadline <= ends]
            if not late:
                self._holds.move_to_end(hold)
                return expired, Slice(question, question.summed, end)
            for q in late:
                self._remove(q)
            expired += late
        return expired, None

    def slice_done(self, done: Slice[T], sums: Sequence[tuple[int, int]] | None,
                   seconds: float) -> Question[T] | None:
        """The sums of ``done`` (None: they failed), which took ``seconds``. Returns its question once it is
        finished (summed, or its sums failed: ``sums`` None), removed; None while it waits for more slices or if it
        was answered meanwhile (pushed out, or past its deadline)."""
        if sums is not None:
            sample = seconds / max(done.bytes, MIN_COST_BYTES)
            self.seconds_per_byte += RATE_WEIGHT * (sample - self.seconds_per_byte)
        question = done.question
        if self._by_key.get(question.key) is not question or done.start != question.summed:
            return None
        if sums is None or len(sums) != done.end - done.start or question.sums is None:
            question.sums = None
            self._remove(question)
            return question
        question.sums.extend(sums)
        question.summed = done.end
        self.queued_bytes -= done.bytes
        question.left -= done.bytes
        if question.summed < len(question.unit_bytes):
            return None
        self._remove(question)
        return question

    def drop(self, question: Question[T]) -> bool:
        """Take ``question`` out (its check refused it); False if it was answered meanwhile."""
        if self._by_key.get(question.key) is not question:
            return False
        self._remove(question)
        return True

    def sizes(self) -> dict[str, int]:
        return {"questions": len(self._by_key), "holds": len(self._holds), "bytes": self.queued_bytes}

    # ------------------------------------------------------------------ internals

    def _room_for(self, question: Question[T]) -> list[Question[T]] | None:
        """The questions to push out so that ``question`` fits, each the newest of the hold with the largest share
        (of questions while their count is over, else of bytes); None when that hold is its own."""
        count = {key: len(qs) for key, qs in self._holds.items()}
        size = {key: sum(q.left for q in qs) for key, qs in self._holds.items()}
        mine = question.hold
        count[mine] = count.get(mine, 0) + 1
        size[mine] = size.get(mine, 0) + question.left
        taken = {key: 0 for key in self._holds}
        total_count, total_bytes = len(self._by_key) + 1, self.queued_bytes + question.left
        victims: list[Question[T]] = []
        while total_count > self.max_questions or total_bytes > self.max_bytes:
            share = count if total_count > self.max_questions else size
            # Its own hold first: at equal shares the newcomer gives way, not a question already waiting.
            largest = max([mine, *(k for k in self._holds if k != mine and count[k] > 0)], key=lambda k: share[k])
            if largest == mine:
                return None
            taken[largest] += 1
            victim = self._holds[largest][-taken[largest]]
            victims.append(victim)
            count[largest] -= 1
            size[largest] -= victim.left
            total_count -= 1
            total_bytes -= victim.left
        return victims

    def _remove(self, question: Question[T]) -> None:
        del self._by_key[question.key]
        questions = self._holds[question.hold]
        questions.remove(question)
        if not questions:
            del self._holds[question.hold]
        self.queued_bytes -= question.left
