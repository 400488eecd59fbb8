"""P side: the live holds of one P worker, with what is asked of them often kept as they change. Pure: no
sockets, threads, clocks or torch.

A mapping of (request id, hold id) to :class:`~vllm_kvp2p.lifecycle.hold.Hold`, in creation order, and beside it,
updated on every change rather than found by a pass over every hold (the metrics read them every engine step):
the hold ids of each request id, the blocks held, and the holds counted by their number of readers
(``readers_per_hold``). The ledger (lifecycle/producer.py) decides; changes to a hold's readers go through
:meth:`LiveHolds.recount`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from typing import TypeVar

from vllm_kvp2p.lifecycle.hold import Hold, Key

T = TypeVar("T")


class LiveHolds(Mapping[Key, Hold]):
    def __init__(self) -> None:
        self._holds: dict[Key, Hold] = {}
        self._ids: dict[str, set[str]] = {}  # request id -> hold ids of its live holds
        self.reader_counts: Counter[int] = Counter()  # number of readers -> live holds with that many
        self.blocks = 0  # of every live hold, as vLLM counted them when it kept them

    def __getitem__(self, key: Key) -> Hold:
        return self._holds[key]

    def __iter__(self) -> Iterator[Key]:
        return iter(self._holds)

    def __len__(self) -> int:
        return len(self._holds)

    def add(self, hold: Hold) -> None:
        self._holds[hold.key] = hold
        self._ids.setdefault(hold.request_id, set()).add(hold.hold_id)
        self.reader_counts[hold.num_readers] += 1
        self.blocks += hold.num_blocks

    def remove(self, hold: Hold) -> None:
        del self._holds[hold.key]
        live = self._ids[hold.request_id]
        live.discard(hold.hold_id)
        if not live:
            del self._ids[hold.request_id]
        self.reader_counts[hold.num_readers] -= 1
        self.blocks -= hold.num_blocks

    def hold_ids_of(self, request_id: str) -> set[str]:
        """The hold ids of ``request_id``'s live holds (empty: none)."""
        return self._ids.get(request_id, set())

    def oldest(self) -> Hold | None:
        return next(iter(self._holds.values()), None)

    def recount(self, hold: Hold, change: Callable[[], T]) -> T:
        """Run ``change`` (which may change a live hold's readers), keeping the counts by readers right."""
        before = hold.num_readers
        result = change()
        if hold.num_readers != before:
            self.reader_counts[before] -= 1
            self.reader_counts[hold.num_readers] += 1
        return result

    @property
    def readers_per_hold(self) -> int:
        """The most readers any live hold has, in O(distinct counts)."""
        return max((n for n, holds in self.reader_counts.items() if holds), default=0)
