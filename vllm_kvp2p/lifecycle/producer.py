"""P side: the life of a finished prompt's blocks on one P worker. Pure: no sockets, threads, clocks or torch.

    hold ──▶ HELD ──claim──▶ CLAIMED ──all readers released──▶ RELEASED
               │                │
               └─hold timeout─▶ EXPIRED ◀─lease timeout (not renewed)─┘

* A hold is created when vLLM finishes a prefill whose KV a decoder will pull (``request_finished`` returned
  delay-free). Its blocks stay allocated until it is RELEASED or EXPIRED; then the request id is reported to vLLM
  as ``finished_sending`` exactly once (:meth:`ProducerLedger.take_freed`).
* A claim is a lease: while any reader holds one, the blocks are not freed even after the hold timeout, until the
  lease itself runs out without renewal. A claim is granted only for the exact hold it names (``hold_id``), so a
  replayed or late ``kv_transfer_params`` can never read blocks that were freed and reused: P refuses, D recomputes.
* Requests are freed once every reader it was told to expect has released. A release that arrives before P has
  heard of the hold (D had nothing to pull and was quick) is remembered and applied when the hold arrives.
* Nothing here raises on a protocol violation from a peer; it answers with a refusal or ignores, and says why.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass, field

from vllm_kvp2p.protocol import ClaimReply, ClaimStatus


class HoldState(enum.Enum):
    HELD = "held"
    CLAIMED = "claimed"
    RELEASED = "released"
    EXPIRED = "expired"

    @property
    def final(self) -> bool:
        return self in (HoldState.RELEASED, HoldState.EXPIRED)


@dataclass
class _Hold:
    request_id: str
    hold_id: str
    state: HoldState
    hold_deadline: float
    expected_readers: int = 1
    leases: dict[str, float] = field(default_factory=dict)  # reader -> lease deadline
    released_by: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class LedgerEvent:
    """Something worth one log line (the adapter logs it; tests assert on it)."""

    request_id: str
    what: str


@dataclass(frozen=True)
class _EarlyRelease:
    hold_id: str
    readers: frozenset[str]
    expected_readers: int
    until: float


class ProducerLedger:
    """Holds, claims and releases of one P worker."""

    def __init__(self, hold_timeout: float, lease_timeout: float, tombstones: int = 65536) -> None:
        self.hold_timeout = hold_timeout
        self.lease_timeout = lease_timeout
        self._holds: dict[str, _Hold] = {}
        self._early: dict[str, _EarlyRelease] = {}
        # Final states of recent holds, so a late claim is refused with the real reason.
        self._tombstones: OrderedDict[str, HoldState] = OrderedDict()
        self._tombstone_limit = tombstones
        self._freed: list[str] = []
        self.events: list[LedgerEvent] = []

    # ------------------------------------------------------------------ queries

    def state(self, request_id: str) -> HoldState | None:
        hold = self._holds.get(request_id)
        if hold is not None:
            return hold.state
        return self._tombstones.get(request_id)

    @property
    def active(self) -> int:
        return len(self._holds)

    # ------------------------------------------------------------------ events from vLLM

    def hold(self, request_id: str, hold_id: str, now: float) -> None:
        """vLLM kept ``request_id``'s blocks for a decoder."""
        if request_id in self._holds or request_id in self._tombstones:
            self._event(request_id, "duplicate hold ignored")
            return
        hold = _Hold(request_id, hold_id, HoldState.HELD, now + self.hold_timeout)
        self._holds[request_id] = hold
        early = self._early.pop(request_id, None)
        if early is not None and early.hold_id == hold_id:
            hold.expected_readers = early.expected_readers
            hold.released_by |= early.readers
            self._maybe_release(hold, "released before the hold arrived")

    # ------------------------------------------------------------------ events from decoders

    def claim(self, request_id: str, hold_id: str, reader: str, expected_readers: int, now: float) -> ClaimReply:
        hold = self._holds.get(request_id)
        if hold is None:
            final = self._tombstones.get(request_id)
            if final is not None:
                self._event(request_id, f"claim by {reader} refused: hold already {final.value}")
                return ClaimReply(ClaimStatus.REFUSED, reason=f"blocks already {final.value}")
            return ClaimReply(ClaimStatus.UNKNOWN, reason="no such hold (yet)")
        if hold.hold_id != hold_id:
            self._event(request_id, f"claim by {reader} refused: stale hold id")
            return ClaimReply(ClaimStatus.REFUSED, reason="hold id does not match (stale transfer params)")
        if reader in hold.released_by:
            return ClaimReply(ClaimStatus.REFUSED, reason="reader already released this hold")
        hold.expected_readers = max(hold.expected_readers, expected_readers)
        hold.leases[reader] = now + self.lease_timeout
        hold.state = HoldState.CLAIMED
        return ClaimReply(ClaimStatus.GRANTED, lease=self.lease_timeout)

    def renew(self, request_id: str, hold_id: str, reader: str, now: float) -> ClaimReply:
        hold = self._holds.get(request_id)
        if hold is None or hold.hold_id != hold_id or reader not in hold.leases:
            return ClaimReply(ClaimStatus.REFUSED, reason="no live claim to renew")
        hold.leases[reader] = now + self.lease_timeout
        return ClaimReply(ClaimStatus.GRANTED, lease=self.lease_timeout)

    def release(self, request_id: str, hold_id: str, reader: str, expected_readers: int, now: float) -> None:
        hold = self._holds.get(request_id)
        if hold is None:
            final = self._tombstones.get(request_id)
            if final is not None:
                self._event(request_id, f"release by {reader} ignored: hold already {final.value}")
                return
            prev = self._early.get(request_id)
            readers = (prev.readers if prev and prev.hold_id == hold_id else frozenset()) | {reader}
            self._early[request_id] = _EarlyRelease(hold_id, readers, expected_readers, now + self.hold_timeout)
            return
        if hold.hold_id != hold_id:
            self._event(request_id, f"release by {reader} ignored: stale hold id")
            return
        hold.expected_readers = max(hold.expected_readers, expected_readers)
        hold.leases.pop(reader, None)
        hold.released_by.add(reader)
        self._maybe_release(hold, "released by all readers")

    # ------------------------------------------------------------------ time

    def expire(self, now: float) -> None:
        """Free holds nobody claimed in time and claims nobody renewed in time."""
        for hold in list(self._holds.values()):
            lapsed = sorted(r for r, t in hold.leases.items() if t <= now)
            for reader in lapsed:
                del hold.leases[reader]
            if lapsed and not hold.leases:
                # The reader vanished mid-transfer (no release, no renewal): nobody can be reading any more.
                why = f"lease of {', '.join(lapsed)} lapsed after {self.lease_timeout:g}s"
                self._finish(hold, HoldState.EXPIRED, why)
                continue
            if hold.leases or hold.hold_deadline > now:
                continue
            self._finish(hold, HoldState.EXPIRED, f"not released within hold_timeout={self.hold_timeout:g}s")
        for request_id, early in list(self._early.items()):
            if early.until <= now:
                del self._early[request_id]

    def take_freed(self) -> list[str]:
        """Request ids whose blocks vLLM may free now; each id is returned exactly once."""
        freed, self._freed = self._freed, []
        return freed

    def take_events(self) -> list[LedgerEvent]:
        events, self.events = self.events, []
        return events

    # ------------------------------------------------------------------ internals

    def _maybe_release(self, hold: _Hold, why: str) -> None:
        if len(hold.released_by) >= hold.expected_readers and not hold.leases:
            self._finish(hold, HoldState.RELEASED, why)

    def _finish(self, hold: _Hold, state: HoldState, why: str) -> None:
        del self._holds[hold.request_id]
        hold.state = state
        self._tombstones[hold.request_id] = state
        while len(self._tombstones) > self._tombstone_limit:
            self._tombstones.popitem(last=False)
        self._freed.append(hold.request_id)
        self._event(hold.request_id, f"{state.value}: {why}")

    def _event(self, request_id: str, what: str) -> None:
        self.events.append(LedgerEvent(request_id, what))
