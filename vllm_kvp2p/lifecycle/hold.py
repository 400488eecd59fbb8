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


class PlaneIndex:
    """Which of P's planes lie over an address: the registration's planes cut into elementary address segments,
    each with the planes over it (one for a dense model; one per KV-cache group where vLLM's hybrid allocator gives
    layers of several groups one tensor). Built once per registration (:func:`plane_index`)."""

    def __init__(self, planes: tuple[PlaneGeometry, ...]) -> None:
        self.planes = planes
        spans = [(p.base_addr, p.base_addr + (p.num_blocks - 1) * p.block_stride + p.block_bytes)
                 for p in planes if p.num_blocks > 0]
        self._cuts = sorted({x for span in spans for x in span})
        self._over: list[list[int]] = [[] for _ in self._cuts]  # segment [cuts[i], cuts[i + 1]) -> its planes
        for index, (start, end) in enumerate(spans):
            at = bisect.bisect_left(self._cuts, start)
            while at < len(self._cuts) and self._cuts[at] < end:
                self._over[at].append(index)
                at += 1

    def over(self, start: int, end: int) -> set[int]:
        """The planes with any memory in ``[start, end)``: O(segments it crosses), one or two in practice."""
        found: set[int] = set()
        at = max(0, bisect.bisect_right(self._cuts, start) - 1)
        while at < len(self._cuts) and self._cuts[at] < end:
            found.update(self._over[at])
            at += 1
        return found


@functools.lru_cache(maxsize=16)
def plane_index(planes: tuple[PlaneGeometry, ...]) -> PlaneIndex:
    """The index of a registration's planes, made once (a P rank has one registration; tests make a few)."""
    return PlaneIndex(planes)


def held_block_ids(blocks: Blocks) -> tuple[list[int], ...]:
    """Each group's offered blocks, sorted, each once, none negative: what :class:`HeldUnits` looks blocks up in."""
    return tuple(sorted({b for b in group if b >= 0}) for group in blocks)


@dataclass(frozen=True)
class HeldUnits:
    """What a reader of one hold may ask P about (vllm_kvp2p/lifecycle/integrity.query_problem): the bytes of the
    blocks the params offered, per KV-cache group, in every plane of that group (``plane_groups[p]``). Checked by
    address, not by (plane, block) pair: vLLM's hybrid allocator gives layers of several groups one tensor, so
    planes of different groups share memory, and D names a unit by the plane its address falls in
    (lifecycle/integrity.verification_for: by base address), which may be another group's plane over those bytes.

    Made once per hold (:meth:`Hold.held_units`) in O(its blocks): each group's block ids, sorted. A unit is
    then checked in O(log blocks) per plane over its address (one, or one per group sharing a tensor), whatever
    the hold's size. (It used to merge an address span per plane and block: 160 planes x 1,000 blocks for a
    128k-token hold of an 80-layer model, 0.55 s of Python for a question of 5 units.)"""

    held: tuple[list[int], ...]  # per group: its offered block ids, sorted, each once
    plane_groups: tuple[int, ...]
    index: PlaneIndex

    @classmethod
    def of(cls, blocks: Blocks, plane_groups: Sequence[int], planes: Sequence[PlaneGeometry]) -> HeldUnits:
        return cls(held_block_ids(blocks), tuple(plane_groups), plane_index(tuple(planes)))

    @property
    def planes(self) -> tuple[PlaneGeometry, ...]:
        return self.index.planes

    def _group_blocks(self, plane: int) -> list[int]:
        group = self.plane_groups[plane] if plane < len(self.plane_groups) else -1
        return self.held[group] if 0 <= group < len(self.held) else []

    @functools.cached_property
    def bytes(self) -> int:
        """The bytes one honest pull of the hold can move from this rank: each plane's offered blocks (the most a
        reader's question may ask, lifecycle/integrity._bytes_within_the_hold). O(planes x log blocks), once."""
        return sum(bisect.bisect_left(self._group_blocks(p), geometry.num_blocks) * geometry.block_bytes
                   for p, geometry in enumerate(self.planes))

    def pieces(self, start: int, end: int) -> list[tuple[int, int]]:
        """The held blocks with memory in ``[start, end)``, as ``(start, end)`` addresses, sorted: looked up in each
        plane over that memory (:class:`PlaneIndex`) by bisection, never a pass over the hold."""
        found = []
        for p in self.index.over(start, end):
            geometry, ids = self.planes[p], self._group_blocks(p)
            first = max(0, (start - geometry.base_addr) // geometry.block_stride)
            last = min(geometry.num_blocks - 1, (end - 1 - geometry.base_addr) // geometry.block_stride)
            for block in ids[bisect.bisect_left(ids, first): bisect.bisect_right(ids, last)]:
                at = geometry.base_addr + block * geometry.block_stride
                if at < end and at + geometry.block_bytes > start:
                    found.append((at, at + geometry.block_bytes))
        return sorted(found)

    def covers(self, plane: int, block: int, offset: int, end: int) -> bool:
        """Whether bytes ``offset`` .. ``end`` of ``block`` of ``plane`` are all held."""
        if not 0 <= plane < len(self.planes) or end <= offset:
            return False
        geometry = self.planes[plane]
        start = geometry.base_addr + block * geometry.block_stride
        reach, stop = start + offset, start + end
        for piece_start, piece_end in self.pieces(reach, stop):
            if piece_start > reach:
                return False
            reach = max(reach, piece_end)
            if reach >= stop:
                return True
        return False

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
    # What its readers may ask about, made at the first question (held_units): once per hold, not per question.
    units: HeldUnits | None = field(default=None, repr=False, compare=False)

    @property
    def key(self) -> Key:
        return (self.request_id, self.hold_id)

    def knows(self, reader: str) -> bool:
        return reader in self.leases or reader in self.released_by

    @property
    def untouched(self) -> bool:
        """No reader has claimed or released it: no D engine has started on it (an abandon may free it)."""
        return not self.leases and not self.released_by

    def held_units(self, plane_groups: Sequence[int], planes: Sequence[PlaneGeometry]) -> HeldUnits:
        """What a reader of this hold may ask P about (:class:`HeldUnits`), made once: a P rank's planes never
        change, so every question about the hold is checked against the same one."""
        if self.units is None:
            self.units = HeldUnits.of(self.blocks, plane_groups, planes)
        return self.units

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
