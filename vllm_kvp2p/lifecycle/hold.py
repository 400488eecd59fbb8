"""P side: one hold, the one record of one finished prompt's blocks kept for decoders, with the lease of each of its
readers. Pure: no sockets, threads, clocks or torch. Its own methods keep its invariants; the ledger
(lifecycle/producer.py) decides when to call them."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

Key = tuple[str, str]  # (request id, hold id)


class HoldState(enum.Enum):
    HELD = "held"
    CLAIMED = "claimed"
    RELEASED = "released"
    EXPIRED = "expired"

    @property
    def final(self) -> bool:
        return self in (HoldState.RELEASED, HoldState.EXPIRED)


@dataclass(frozen=True)
class Lease:
    """One reader's claim on a hold. Replaced, never changed in place, when it is renewed or its claim resent."""

    until: float  # P's clock: it lapses then unless renewed
    cap: float  # it is never renewed past this: the hold's pin deadline, or the claim's deadline + clock_skew
    token: str  # renewals, and the release while it is live, must carry it
    claim_id: str  # chosen by D: a claim resent with the same one gets this lease back

    def extended(self, now: float, lease_timeout: float) -> Lease:
        """Refreshed to ``lease_timeout`` from now, never past its cap, never shortened."""
        return Lease(max(self.until, min(now + lease_timeout, self.cap)), self.cap, self.token, self.claim_id)


@dataclass
class Hold:
    request_id: str
    hold_id: str
    hold_deadline: float
    pin_deadline: float  # hard: no lease runs past it
    created: float
    num_blocks: int = 0
    state: HoldState = HoldState.HELD
    expected_readers: int = 1
    leases: dict[str, Lease] = field(default_factory=dict)  # reader -> its live lease
    released_by: set[str] = field(default_factory=set)
    confirmed: set[str] = field(default_factory=set)  # readers whose lease held from claim to release
    # (deadline, sequence) of its one current entry in the ledger's heap; any other entry naming it is stale.
    due: tuple[float, int] | None = None

    @property
    def key(self) -> Key:
        return (self.request_id, self.hold_id)

    def knows(self, reader: str) -> bool:
        return reader in self.leases or reader in self.released_by

    @property
    def num_readers(self) -> int:
        return len(self.released_by) + len(self.leases)  # a reader is in one or the other

    @property
    def all_released(self) -> bool:
        return len(self.released_by) >= self.expected_readers and not self.leases

    def next_deadline(self) -> float:
        """When expire() must look at it next: its first lease to lapse or, without leases, its hold deadline (the
        pin deadline is never earlier: every lease ends by it)."""
        return min((lease.until for lease in self.leases.values()), default=self.hold_deadline)

    def grant(self, reader: str, lease: Lease) -> None:
        self.leases[reader] = lease
        self.state = HoldState.CLAIMED

    def release_reader(self, reader: str, now: float, pulled: bool) -> bool:
        """The reader is done; returns whether its lease held from its claim to now (see ProducerLedger.release)."""
        lease = self.leases.pop(reader, None)
        if lease is not None:
            held = lease.until > now  # lapsed but not yet expired: blocks still there, but not promised
            if held:
                self.confirmed.add(reader)
        else:
            held = reader in self.confirmed or not pulled
        self.released_by.add(reader)
        return held

    def lapse(self, now: float) -> dict[str, Lease]:
        """Drop the leases that have run out; returns them, by reader name."""
        lapsed = {reader: lease for reader, lease in sorted(self.leases.items()) if lease.until <= now}
        for reader in lapsed:
            del self.leases[reader]
        return lapsed
