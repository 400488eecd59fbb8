"""P side: when P's ledger must look at each live hold next. Pure: no sockets, threads, clocks or torch.

Time costs what expires, not what is held: each live hold has one entry in a heap of deadlines, at (or before) the
next moment something about it may change, and :meth:`DeadlineHeap.pop_due` gives only the holds whose entry has
come. A hold's current entry is its ``due``; other entries naming it are stale (the hold ended, or its deadline
moved earlier) and are skipped when they come up.

Bound: the heap holds at most ``2 x live holds + STALE_SLACK`` entries, whatever peers send. A message that moves a
hold's deadline later (a renewal, a resent claim) adds no entry (the current one comes up early and the ledger files
the hold again at its real deadline); one that moves it earlier replaces it; and the heap is rebuilt from the live
holds when stale entries outnumber current ones, O(live holds) paid for by the at least as many messages that made
entries stale.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Mapping

from vllm_kvp2p.lifecycle.hold import Hold, Key

STALE_SLACK = 64  # stale heap entries allowed beyond one per live hold before the heap is rebuilt


class DeadlineHeap:
    """The deadlines of the live holds in ``holds`` (the ledger's own table, read when the heap is rebuilt)."""

    def __init__(self, holds: Mapping[Key, Hold]) -> None:
        self._holds = holds
        self._heap: list[tuple[float, int, Key]] = []
        self._sequence = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def due_by(self, hold: Hold, when: float) -> None:
        """Make the hold's one entry come up no later than ``when``. A later deadline moves nothing; an earlier one
        replaces the entry (the old one is stale)."""
        if hold.due is not None and hold.due[0] <= when:
            return
        hold.due = (when, next(self._sequence))
        heapq.heappush(self._heap, (*hold.due, hold.key))
        self.drop_stale()

    def forget(self, hold: Hold) -> None:
        """The hold ended (and has left ``holds``): its entry, if it has one, is stale now."""
        hold.due = None
        self.drop_stale()

    def pop_due(self, now: float) -> list[Hold]:
        """The live holds whose entry has come, each with its entry taken (``due`` None: file it again)."""
        due: list[Hold] = []
        while self._heap and self._heap[0][0] <= now:
            when, sequence, key = heapq.heappop(self._heap)
            hold = self._holds.get(key)
            if hold is not None and hold.due == (when, sequence):  # its current entry, not a stale one
                hold.due = None
                due.append(hold)
        return due

    def drop_stale(self) -> None:
        if len(self._heap) > 2 * len(self._holds) + STALE_SLACK:
            self._heap = [(*hold.due, key) for key, hold in self._holds.items() if hold.due is not None]
            heapq.heapify(self._heap)
