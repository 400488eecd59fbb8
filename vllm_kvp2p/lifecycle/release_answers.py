"""P side: what a release is answered, and the answers kept for a release sent again. Pure.

D resends a release it got no answer to on a fresh socket (the first time after 0.5 s), so P's first answer, with
its integrity sums, may be lost, or arrive on a socket D gave up, exactly when P is slow to sum. P keeps the answer
the release that ended a reader's lease got, keyed by (request, hold, reader), for that same release sent again
(:meth:`KeptAnswers.answer` decides who gets it). Peers can make P keep
answers, so the table is bounded: the latest ``max_answers``, at most ``max_bytes`` in all, oldest forgotten first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

MAX_KEPT_ANSWERS = 16384  # releases whose integrity answer is kept for the same release resent
MAX_KEPT_ANSWER_BYTES = 16 << 20  # their answers' bytes (one of 4096 units, the most a question names: ~80 KiB)

ReaderKey = tuple[str, str, str]  # (request id, hold id, reader)


@dataclass(frozen=True)
class ReleaseAnswer:
    """What P answers a release (:meth:`~vllm_kvp2p.lifecycle.producer.ProducerLedger.answer_release`)."""

    lease_held: bool  # the reader's lease held from its claim to its release (ProducerLedger.release)
    sums: bytes | None = None  # the answer to the release's integrity question, as the adapter gave it; None: none
    sums_lost: bool = False  # the same release was answered sums before, and they are no longer kept


@dataclass(frozen=True)
class KeptAnswer:
    question: bytes  # what identifies the release that asked (the adapter's fingerprint of it)
    sums: bytes | None

    @property
    def cost(self) -> int:
        return len(self.question) + len(self.sums or b"")


class KeptAnswers:
    """The answers kept for resent releases, oldest first, bounded by count and bytes."""

    def __init__(self, max_answers: int = MAX_KEPT_ANSWERS, max_bytes: int = MAX_KEPT_ANSWER_BYTES) -> None:
        self.max_answers = max_answers
        self.max_bytes = max_bytes
        self.bytes = 0
        self._answers: OrderedDict[ReaderKey, KeptAnswer] = OrderedDict()

    def __len__(self) -> int:
        return len(self._answers)

    def get(self, key: ReaderKey) -> KeptAnswer | None:
        return self._answers.get(key)

    def answer(self, key: ReaderKey, lease_held: bool, ended_lease: bool, question: bytes,
               sums: bytes | None) -> ReleaseAnswer:
        """What a release that asks ``question`` (b"": none) is answered, once the ledger decided ``lease_held``.
        The release that ended the reader's live lease (``ended_lease``) is answered ``sums`` if the read is
        confirmed, and that answer is kept for the same release sent again. The copy, which finds no lease (the
        first ended it), gets the kept answer; if it is no longer kept, ``sums_lost`` (D counts that pull apart from
        one P answered no sums for). Any other release (another question, or one that ends no lease) gets no sums."""
        if not (lease_held and question):
            return ReleaseAnswer(lease_held)
        if ended_lease:
            self.keep(key, KeptAnswer(question, sums))
            return ReleaseAnswer(lease_held, sums)
        kept = self.get(key)  # P confirmed this reader's read before: this is its release again
        if kept is None:
            return ReleaseAnswer(lease_held, sums_lost=True)
        return ReleaseAnswer(lease_held, kept.sums if kept.question == question else None)

    def keep(self, key: ReaderKey, answer: KeptAnswer) -> None:
        old = self._answers.pop(key, None)
        if old is not None:
            self.bytes -= old.cost
        self._answers[key] = answer
        self.bytes += answer.cost
        while self._answers and (len(self._answers) > self.max_answers or self.bytes > self.max_bytes):
            self.bytes -= self._answers.popitem(last=False)[1].cost
