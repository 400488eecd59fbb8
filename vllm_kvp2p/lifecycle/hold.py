"""P side: one hold, the one record of one finished prompt's blocks kept for decoders, with the lease of each of its
readers. Pure: no sockets, threads, clocks or torch. Its own methods keep its invariants; the ledger
(lifecycle/producer.py) decides when to call them."""

from __future__ import annotations

import bisect
import enum
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

from vllm_kvp2p.transfer.descriptors import PlaneGeometry

Key = tuple[str, str]  # (request id, hold id)
Blocks = tuple[tuple[int, ...], ...]  # block ids per KV-cache group (vLLM's order of transfer groups)


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


@dataclass(frozen=True)
class HeldUnits:
    """What a reader of one hold may ask P about (vllm_kvp2p/lifecycle/integrity.query_problem): the bytes of the
    blocks the params offered, per KV-cache group, in every plane of that group (``plane_groups[p]``), as merged
    address spans. Bytes, not (plane, block) pairs: vLLM's hybrid allocator gives layers of several groups one
    tensor, so planes of different groups share memory, and D names a unit by the plane its address falls in
    (lifecycle/integrity.verification_for: by base address), which may be another group's plane over those bytes."""

    blocks: Blocks
    plane_groups: tuple[int, ...]
    planes: tuple[PlaneGeometry, ...]

    @classmethod
    def of(cls, blocks: Blocks, plane_groups: Sequence[int], planes: Sequence[PlaneGeometry]) -> HeldUnits:
        """Cheap: the spans are made when first needed (off the side channel's thread: hold_service.py)."""
        return cls(blocks, tuple(plane_groups), tuple(planes))

    @functools.cached_property
    def _spans(self) -> tuple[list[int], list[int]]:
        """Merged ``[start, end)`` address spans, sorted: starts, ends."""
        blocks, groups = self.blocks, self.plane_groups
        spans = sorted((plane.base_addr + b * plane.block_stride, plane.block_bytes)
                       for plane, group in zip(self.planes, groups) if 0 <= group < len(blocks)
                       for b in set(blocks[group]) if 0 <= b < plane.num_blocks)
        starts: list[int] = []
        ends: list[int] = []
        for start, length in spans:
            if ends and start <= ends[-1]:
                ends[-1] = max(ends[-1], start + length)
            else:
                starts.append(start)
                ends.append(start + length)
        return starts, ends

    @property
    def bytes(self) -> int:
        """Bytes held (each once, whichever planes share them): the most one reader's pull can have moved."""
        starts, ends = self._spans
        return sum(ends) - sum(starts)

    def covers(self, plane: int, block: int, offset: int, end: int) -> bool:
        """Whether bytes ``offset`` .. ``end`` of ``block`` of ``plane`` are all held."""
        if not 0 <= plane < len(self.planes):
            return False
        geometry, (starts, ends) = self.planes[plane], self._spans
        start = geometry.base_addr + block * geometry.block_stride
        at = bisect.bisect_right(starts, start + offset) - 1
        return at >= 0 and start + end <= ends[at]

    def __contains__(self, unit: object) -> bool:
        """Whether a whole unit ``(plane, block)`` is held."""
        if not (isinstance(unit, tuple) and len(unit) == 2 and 0 <= unit[0] < len(self.planes)):
            return False
        return self.covers(unit[0], unit[1], 0, self.planes[unit[0]].block_bytes)


@dataclass
class Hold:
    request_id: str
    hold_id: str
    hold_deadline: float
    pin_deadline: float  # hard: no lease runs past it
    created: float
    num_blocks: int = 0  # every block vLLM keeps for it, all groups (the blocks-held gauge)
    blocks: Blocks = ()  # the blocks offered to decoders, per group: the only ones a reader may ask P about
    mac: str = ""  # the mac of the params P issued for it ("" unsigned): what an abandon must carry
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
    def untouched(self) -> bool:
        """No reader has claimed or released it: no D engine has started on it (an abandon may free it)."""
        return not self.leases and not self.released_by

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
