"""P side: what P's ledger remembers of holds it does not hold (yet, or any more). Pure: no sockets, threads,
clocks or torch.

* :class:`EarlyReleases`: releases and abandons of a hold P has not heard of yet (P learns a hold one engine step
  after it answered the prefill, and a D with nothing to pull, or the proxy, can be quicker). Applied when the hold
  arrives; kept ``ttl`` seconds, at most ``max_entries``, in expiry order.
* :class:`Tombstones`: the final state of recent holds and the readers whose read P confirmed, one record per hold,
  so a late claim is refused with the real reason and a release sent twice gets the same answer. The most recent
  ``limit`` are kept.

The ledger (lifecycle/producer.py) decides what to do with them; these only keep them, bounded.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

from vllm_kvp2p.lifecycle.hold import HoldState, Key


@dataclass(frozen=True)
class EarlyRelease:
    """What arrived for a hold before P heard of it: readers' releases, or an abandon (the mac it carried)."""

    readers: frozenset[str]
    expected_readers: int
    until: float
    abandon_mac: str | None = None  # an abandon came first (None: none did)


class EarlyReleases:
    """Early releases and abandons by hold, oldest (soonest to expire) first."""

    def __init__(self, max_entries: int, ttl: float) -> None:
        self.max_entries = max_entries
        self.ttl = ttl
        self._entries: dict[Key, EarlyRelease] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Key) -> EarlyRelease | None:
        return self._entries.get(key)

    def pop(self, key: Key) -> EarlyRelease | None:
        return self._entries.pop(key, None)

    def put(self, key: Key, readers: frozenset[str], expected_readers: int, now: float,
            abandon_mac: str | None = None) -> None:
        """Keep (or replace) ``key``'s entry until ``now + ttl``: re-inserted at the end, so the order stays by
        expiry. The caller asked :meth:`has_room` for a new key."""
        self._entries.pop(key, None)
        self._entries[key] = EarlyRelease(readers, expected_readers, now + self.ttl, abandon_mac)

    def has_room(self, now: float) -> bool:
        """Whether one more entry fits, expired ones dropped first."""
        if len(self._entries) >= self.max_entries:
            self.drop_expired(now)
        return len(self._entries) < self.max_entries

    def drop_expired(self, now: float) -> None:
        while self._entries:
            oldest = next(iter(self._entries))
            if self._entries[oldest].until > now:
                break
            del self._entries[oldest]


@dataclass(frozen=True)
class Tombstone:
    """How a hold ended, and the readers whose lease held from claim to release (their read was confirmed)."""

    state: HoldState
    confirmed: frozenset[str] = frozenset()


class Tombstones:
    """The most recent ``limit`` ended holds, oldest first."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._ended: OrderedDict[Key, Tombstone] = OrderedDict()

    def __len__(self) -> int:
        return len(self._ended)

    def __contains__(self, key: object) -> bool:
        return key in self._ended

    def get(self, key: Key) -> Tombstone | None:
        return self._ended.get(key)

    def add(self, key: Key, state: HoldState, confirmed: frozenset[str]) -> None:
        self._ended[key] = Tombstone(state, confirmed)
        while len(self._ended) > self.limit:
            self._ended.popitem(last=False)

    def newest_of(self, request_id: str) -> Iterator[Tombstone]:
        """The tombstones of ``request_id``'s holds, newest first (a scan: for tests and logs)."""
        return (stone for (rid, _), stone in reversed(self._ended.items()) if rid == request_id)
