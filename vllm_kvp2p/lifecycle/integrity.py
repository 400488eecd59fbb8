"""Whether the bytes D read are the bytes P offered (issue 23): which units a pull verifies, what D asks P for,
and the verdict. Pure: no torch, no sockets; the adapters compute the sums (vllm_kvp2p/transfer/digest.py).

A *unit* is one block of one plane on P. From a pull's read descriptors (D address, P address, length) D names,
per unit, the byte ranges it read in P's coordinates (offsets from the block's start, merged, in P's order): P
sums exactly those bytes of its held block, D the same bytes where it wrote them, and the sums are equal exactly
when the bytes are (see the digest module for why any split gives the same sums). The question travels in D's
release of the hold (P still holds the blocks while it answers), the answer in P's reply to it: no extra round
trip. A P that does not answer it (an older release) leaves the pull *unverified*, counted, not failed.

Whoever reaches P's side channel may send a question, so P answers one (:func:`query_problem`) only from a reader
whose lease on the hold is live, and only about what that reader can have read: bytes of its own hold (the blocks
the params offered, per KV-cache group, in the planes of that group: lifecycle/hold.HeldUnits), each unit named
once, ranges sorted, disjoint and inside the block, at most the hold's bytes in all. Otherwise two ranges
``[o, 1, o + 1, 1]`` of a block outside the hold give ``total = a + b`` and ``weighted = (o + 1) a + (o + 2) b``:
two bytes of another request's KV; and a range repeated inside a unit multiplies what one 64 KiB frame makes P
sum (15,000 copies of one 8 KiB block: 117 MiB for a hold of 48 KiB). The check costs O(the question's units), the
hold's units made once per hold (0.03 ms per question whatever the hold's size); when P sums what it answers is
lifecycle/question_queue.py's decision (fair to every reader, within each reader's budget: :class:`NoSums`).
"""

from __future__ import annotations

import bisect
import enum
import hashlib
import operator
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec

from vllm_kvp2p.contract.protocol import MAX_DIGEST_QUESTION_BYTES, DigestQuery, UnitRanges, UnitSums
from vllm_kvp2p.contract.protocol import MAX_DIGEST_RANGES as MAX_RANGES
from vllm_kvp2p.contract.protocol import MAX_DIGEST_UNITS as MAX_UNITS
from vllm_kvp2p.lifecycle.hold import HeldUnits
from vllm_kvp2p.transfer.descriptors import Descriptors, PlaneGeometry

_encoder = msgspec.msgpack.Encoder()


class IntegrityMode(str, enum.Enum):
    OFF = "off"
    SAMPLED = "sampled"  # a few units of every pull (the last one always: partial blocks live there)
    FULL = "full"  # every unit of every pull


class NoSums(str, enum.Enum):
    """Why P gave a release's question no sums (``Released.no_sums``; D counts the pull unverified, with it)."""

    BUSY = "busy"  # its sums would end after the reader's budget, or its hold's share of P's queue is full
    REFUSED = "refused"  # the question broke one of P's rules (query_problem)
    NO_LEASE = "no_lease"  # the reader holds no live lease on the hold, or the release lacks its token
    NOT_ANSWERED = "not_answered"  # this P answers no questions (no KV memory to sum)
    FAILED = "failed"  # P's sums raised


@dataclass(frozen=True)
class LocalRun:
    """Where D wrote bytes ``offset`` .. ``offset + length`` of query unit ``unit``: at ``addr``."""

    addr: int
    offset: int
    length: int
    unit: int


@dataclass(frozen=True)
class Verification:
    """What D checks for one P rank: the question for P and where D's copies of those bytes are."""

    query: DigestQuery
    local_runs: tuple[LocalRun, ...]


class Verdict(enum.Enum):
    MATCHED = "matched"
    MISMATCHED = "mismatched"
    UNVERIFIED = "unverified"  # P gave no sums (an older P, or a question over its bounds)
    SUMS_LOST = "sums_lost"  # P answered this release before, and no longer has those sums (a resent release)


@dataclass(frozen=True)
class Judgement:
    verdict: Verdict
    units: int = 0  # units compared
    first_bad: UnitRanges | None = None  # the first unit whose sums differ


def pull_mode(mode: IntegrityMode, request_id: str, sampled_pulls: float) -> IntegrityMode:
    """The mode of one pull: ``SAMPLED`` verifies only a ``sampled_pulls`` share of the pulls (``OFF`` for the
    others), chosen by a hash of the request id, so every D rank of the pull makes the same choice and a
    request's verdict does not depend on which rank reports first. A sampled pull costs about 1.7 ms on real
    engines whatever its size (docs/performance.md 15: a few dozen small tensor operations on each side; P's check of
    the question 0.03 ms, plus 0.3-0.6 ms once per hold, for holds up to 128k tokens of an 80-layer model), hence a
    share and not every pull."""
    if mode is not IntegrityMode.SAMPLED or sampled_pulls >= 1:
        return mode
    draw = int.from_bytes(hashlib.sha256(request_id.encode("utf-8", "surrogatepass")).digest()[:8], "little")
    return mode if draw < sampled_pulls * 2**64 else IntegrityMode.OFF


def verification_for(descriptors: Descriptors, remote_planes: Sequence[PlaneGeometry], mode: IntegrityMode,
                     seed: int, sampled_units: int = 4) -> Verification | None:
    """The question for P and D's runs for a pull's ``descriptors`` from one P rank with ``remote_planes``: every
    unit read (``FULL``), or ``sampled_units`` pieces (what one descriptor read of one block) drawn with ``seed``
    plus the last one (``SAMPLED``); as many units, in order, as fit in ``MAX_DIGEST_QUESTION_BYTES`` encoded
    (about 3,400 whole block-layers: beyond, the rest of a pull goes unchecked and ``PullResult.verified_units`` says
    how many were). None when nothing is verified. Raises ValueError for a descriptor outside every plane (D built
    it from P's registration: that is a bug, not a peer's doing)."""
    if mode is IntegrityMode.OFF or not len(descriptors):
        return None
    order = sorted(range(len(remote_planes)), key=lambda i: remote_planes[i].base_addr)
    bases = [remote_planes[i].base_addr for i in order]
    located = []  # (local addr, plane, offset in plane, length, pieces): one per descriptor, not yet cut per block
    count = 0
    for local, remote, length in zip(descriptors.local_addrs, descriptors.remote_addrs, descriptors.lengths):
        at = bisect.bisect_right(bases, remote) - 1
        if at < 0:
            raise ValueError(f"remote address {remote:#x} lies below every plane")
        p = order[at]
        plane = remote_planes[p]
        start = remote - plane.base_addr
        first, offset = divmod(start, plane.block_stride)
        if first >= plane.num_blocks or offset >= plane.block_bytes:
            raise ValueError(f"remote address {remote:#x} lies outside plane {p}'s blocks")
        n = 1 + max(0, offset + length - plane.block_bytes + plane.block_stride - 1) // plane.block_stride
        located.append((local, p, start, length, n))
        count += n
    # Sampled: a few pieces (a piece: what one descriptor read of one block) drawn before anything is cut, and
    # always the last one (a prompt's partial last block lives there): cost per descriptor, not per block.
    chosen: list[int] | None = None
    if mode is IntegrityMode.SAMPLED and count > sampled_units + 1:
        chosen = sorted(random.Random(seed).sample(range(count - 1), sampled_units)) + [count - 1]
    pieces: dict[tuple[int, int], list[tuple[int, int, int]]] = {}  # unit -> (offset, length, local addr)
    index = 0
    for local, p, start, length, n in located:
        if chosen is not None:
            at = bisect.bisect_left(chosen, index)
            if at == len(chosen) or chosen[at] >= index + n:  # none of this descriptor's pieces is drawn
                index += n
                continue
        plane = remote_planes[p]
        for i in range(n):  # a merged run spans blocks: one piece per block
            block, offset = divmod(start, plane.block_stride)
            if block >= plane.num_blocks or offset >= plane.block_bytes:
                raise ValueError(f"remote address {plane.base_addr + start:#x} lies outside plane {p}'s blocks")
            take = min(length, plane.block_bytes - offset)
            if chosen is None or _drawn(chosen, index + i):
                pieces.setdefault((p, block), []).append((offset, take, local))
            local, start, length = local + take, (block + 1) * plane.block_stride, length - take
        index += n
    query: list[UnitRanges] = []
    runs: list[LocalRun] = []
    size = len(_encoder.encode(DigestQuery([])))
    for unit, found in pieces.items():
        merged: list[int] = []
        for offset, n, _ in sorted(found):
            if merged and merged[-2] + merged[-1] == offset:
                merged[-1] += n
            else:
                merged += [offset, n]
        ranges = UnitRanges(unit[0], unit[1], merged)
        size += len(_encoder.encode(ranges))
        if len(query) == MAX_UNITS or size > MAX_DIGEST_QUESTION_BYTES:  # (and so within MAX_RANGES)
            break  # the rest unchecked: a release P drops (too big) would lose the whole read
        runs += [LocalRun(local, offset, n, len(query)) for offset, n, local in sorted(found)]
        query.append(ranges)
    return Verification(DigestQuery(query), tuple(runs)) if query else None


def _drawn(chosen: list[int], piece: int) -> bool:
    at = bisect.bisect_left(chosen, piece)
    return at < len(chosen) and chosen[at] == piece


def query_problem(query: DigestQuery, planes: Sequence[PlaneGeometry], held: HeldUnits) -> str:
    """Why P does not answer ``query`` ("" when it does), the first of :data:`QUESTION_RULES` it breaks. ``held``:
    the units of the asking reader's hold (ProducerLedger.verifiable_units): P answers about nothing else."""
    for rule in QUESTION_RULES:
        problem = rule(query, planes, held)
        if problem:
            return problem
    return ""


def _within_the_wire_bounds(query: DigestQuery, planes: Sequence[PlaneGeometry], held: HeldUnits) -> str:
    if len(query.units) > MAX_UNITS or sum(len(u.ranges) // 2 for u in query.units) > MAX_RANGES:
        return f"over {MAX_UNITS} units or {MAX_RANGES} ranges"
    return ""


def _inside_p_blocks(query: DigestQuery, planes: Sequence[PlaneGeometry], held: HeldUnits) -> str:
    """Every range inside a block P has (never dropped: the sums would read past it)."""
    for unit in query.units:
        if not 0 <= unit.plane < len(planes) or len(unit.ranges) % 2:
            return f"unit {unit.plane}/{unit.block}: no such plane, or ranges not in pairs"
        plane = planes[unit.plane]
        if not 0 <= unit.block < plane.num_blocks:
            return f"unit {unit.plane}/{unit.block}: no such block"
        for offset, length in zip(unit.ranges[::2], unit.ranges[1::2]):
            if offset < 0 or length <= 0 or offset + length > plane.block_bytes:
                return f"unit {unit.plane}/{unit.block}: range {offset}+{length} outside its {plane.block_bytes} B"
    return ""


def _inside_the_hold(query: DigestQuery, planes: Sequence[PlaneGeometry], held: HeldUnits) -> str:
    """Only bytes of the reader's own hold: any other block is another request's KV (or a freed one's)."""
    for unit in query.units:
        first = min(unit.ranges[::2], default=0)
        end = max(map(operator.add, unit.ranges[::2], unit.ranges[1::2]), default=0)
        if not held.covers(unit.plane, unit.block, first, end):
            return f"unit {unit.plane}/{unit.block}: not a block of this hold"
    return ""


def _units_distinct(query: DigestQuery, planes: Sequence[PlaneGeometry], held: HeldUnits) -> str:
    if len({(u.plane, u.block) for u in query.units}) < len(query.units):
        return "a unit named twice"
    return ""


def _ranges_sorted_and_disjoint(query: DigestQuery, planes: Sequence[PlaneGeometry], held: HeldUnits) -> str:
    for unit in query.units:
        end = 0
        for offset, length in zip(unit.ranges[::2], unit.ranges[1::2]):
            if offset < end:
                return f"unit {unit.plane}/{unit.block}: range {offset}+{length} overlaps or precedes the one before"
            end = offset + length
    return ""


def _bytes_within_the_hold(query: DigestQuery, planes: Sequence[PlaneGeometry], held: HeldUnits) -> str:
    """At most the bytes the reader's pull can have moved from this rank: every byte of its hold, once."""
    asked = sum(sum(u.ranges[1::2]) for u in query.units)
    return f"{asked} bytes asked, more than the hold's {held.bytes}" if asked > held.bytes else ""


Rule = Callable[[DigestQuery, Sequence[PlaneGeometry], HeldUnits], str]
#: P's rules for a question, in order (each a pure function of the question, P's planes and the hold's units).
#: The byte bound follows from the four before it (distinct units of the hold, disjoint ranges inside each); it
#: is checked on its own too, being what bounds the side-channel work of one release (docs/security.md).
QUESTION_RULES: tuple[Rule, ...] = (_within_the_wire_bounds, _inside_p_blocks, _inside_the_hold, _units_distinct,
                                    _ranges_sorted_and_disjoint, _bytes_within_the_hold)


def judge(query: DigestQuery, mine: Sequence[tuple[int, int]], theirs: Sequence[UnitSums] | None,
          sums_lost: bool = False) -> Judgement:
    """D's sums ``mine`` against P's ``theirs`` for the units of ``query``, in order. ``sums_lost``: P said its
    answer to this release is no longer kept (``Released.sums_lost``: the release was resent after P answered it)."""
    if theirs is None and sums_lost:
        return Judgement(Verdict.SUMS_LOST)
    if theirs is None or len(theirs) != len(query.units) or len(mine) != len(query.units):
        return Judgement(Verdict.UNVERIFIED)  # never a match by default: zip() would stop at the shorter list
    for unit, (total, weighted), sums in zip(query.units, mine, theirs):
        if (total, weighted) != (sums.total, sums.weighted):
            return Judgement(Verdict.MISMATCHED, len(query.units), unit)
    return Judgement(Verdict.MATCHED, len(query.units))
