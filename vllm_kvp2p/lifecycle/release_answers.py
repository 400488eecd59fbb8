"""P side: what a release is answered, and the answers kept for a release sent again. Pure.

D resends a release it got no answer to on a fresh socket (the first time after 0.5 s), so P's first answer, with
its integrity sums, may be lost, or arrive on a socket D gave up, exactly when P is slow to sum. P keeps the answer
the release that ended a reader's lease got, keyed by (request, hold, reader), for that same release sent again
(:meth:`~vllm_kvp2p.lifecycle.producer.ProducerLedger.answer_release` decides who gets it). Peers can make P keep
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

    def keep(self, key: ReaderKey, answer: KeptAnswer) -> None:
        old = self._answers.pop(key, None)
        if old is not None:
            self.bytes -= old.cost
        self._answers[key] = answer
        self.bytes += answer.cost
        while self._answers and (len(self._answers) > self.max_answers or self.bytes > self.max_bytes):
            self.bytes -= self._answers.popitem(last=False)[1].cost
