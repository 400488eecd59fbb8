"""The properties descriptors must have, for every implementation (Python, C++, what the package calls): they cover
exactly the requested bytes, never overlap on either side (for distinct ids), never leave their plane (even when
planes are adjacent in memory), pair a local plane with the same remote plane, merge runs only on dense plane pairs,
and raise ValueError (the reference's message) on invalid input; with worked examples."""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import pytest
from hypothesis import given

from tests.unit.descriptor_cases import BUILDERS, PROPERTY_SETTINGS, broken_case, outcome, py_builder, realistic_case
from vllm_kvp2p.transfer.descriptors import PlaneGeometry, block_runs

pytestmark = pytest.mark.timeout(300)


def _merge(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _plane_of(planes: Sequence[PlaneGeometry], starts: list[int], addr: int, length: int) -> int:
    """Index of the plane holding [addr, addr + length); fails if none does."""
    i = bisect.bisect_right(starts, addr) - 1
    assert i >= 0, f"descriptor at {addr:#x} below every plane"
    p = planes[i]
    assert addr + length <= p.base_addr + p.num_blocks * p.block_stride, (
        f"descriptor [{addr:#x}, {addr + length:#x}) leaves plane {i} "
        f"[{p.base_addr:#x}, {p.base_addr + p.num_blocks * p.block_stride:#x})"
    )
    return i


@pytest.mark.parametrize("builder", BUILDERS)
@PROPERTY_SETTINGS
@given(case=realistic_case())
def test_descriptor_geometry(builder, case):
    lp, rp, li, ri = case
    la, ra, lengths = builder(lp, rp, li, ri)
    assert len(la) == len(ra) == len(lengths)

    # exactly the requested bytes
    assert sum(lengths) == len(li) * sum(p.block_bytes for p in lp)
    assert all(n > 0 for n in lengths)

    lstarts = [p.base_addr for p in lp]
    rstarts = [p.base_addr for p in rp]
    assert lstarts == sorted(lstarts) and rstarts == sorted(rstarts)
    for planes, _starts, addrs, ids in ((lp, lstarts, la, li), (rp, rstarts, ra, ri)):
        got = [(a, a + n) for a, n in zip(addrs, lengths)]
        # never overlapping
        ordered = sorted(got)
        for (_, end), (start, _) in zip(ordered, ordered[1:]):
            assert start >= end, "descriptors overlap"
        # covering exactly the blocks asked for
        want = [
            (p.base_addr + b * p.block_stride, p.base_addr + b * p.block_stride + p.block_bytes)
            for p in planes
            for b in ids
        ]
        assert _merge(got) == _merge(want)
    # each descriptor inside one plane, the same plane index on both sides, planes in order
    plane_seq = []
    for a, r, n in zip(la, ra, lengths):
        i = _plane_of(lp, lstarts, a, n)
        assert _plane_of(rp, rstarts, r, n) == i
        plane_seq.append(i)
    assert plane_seq == sorted(plane_seq)


@pytest.mark.parametrize("builder", BUILDERS)
@PROPERTY_SETTINGS
@given(case=realistic_case(unique=False))
def test_descriptor_counts(builder, case):
    """One entry per run on dense plane pairs, one per block otherwise; repeats are kept."""
    lp, rp, li, ri = case
    la, ra, lengths = builder(lp, rp, li, ri)
    runs = block_runs(li, ri)
    expected = sum(len(runs) if (l.dense and r.dense) else len(li) for l, r in zip(lp, rp))
    assert len(lengths) == expected
    assert sum(lengths) == len(li) * sum(p.block_bytes for p in lp)


@pytest.mark.parametrize("builder", BUILDERS)
@PROPERTY_SETTINGS
@given(case=broken_case())
def test_errors_are_value_errors(builder, case):
    lp, rp, li, ri = case
    kind, _ = outcome(py_builder, lp, rp, li, ri)
    if kind == "ValueError":
        with pytest.raises(ValueError):
            builder(lp, rp, li, ri)
    else:
        builder(lp, rp, li, ri)


# --------------------------------------------------------------------------------------------------------------
# Examples
# --------------------------------------------------------------------------------------------------------------


def test_block_runs_examples():
    assert block_runs([3, 4, 5, 9], [10, 11, 12, 0]) == [(3, 10, 3), (9, 0, 1)]
    assert block_runs([1, 2, 3], [5, 6, 8]) == [(1, 5, 2), (3, 8, 1)]  # consecutive on one side only
    assert block_runs([2, 2], [4, 5]) == [(2, 4, 1), (2, 5, 1)]  # a repeat is not a run
    assert block_runs([3, 2, 1], [3, 2, 1]) == [(3, 3, 1), (2, 2, 1), (1, 1, 1)]  # descending is not a run
    assert block_runs([], []) == []
    with pytest.raises(ValueError):
        block_runs([1], [])


@pytest.mark.parametrize("builder", BUILDERS)
def test_merge_example_dense(builder):
    lp = [PlaneGeometry(0x1000, 64, 64, 16), PlaneGeometry(0x2000, 64, 64, 16)]
    rp = [PlaneGeometry(0x8000, 64, 64, 32), PlaneGeometry(0x9000, 64, 64, 32)]
    assert builder(lp, rp, [3, 4, 5, 9], [10, 11, 12, 0]) == (
        [0x1000 + 3 * 64, 0x1000 + 9 * 64, 0x2000 + 3 * 64, 0x2000 + 9 * 64],
        [0x8000 + 10 * 64, 0x8000, 0x9000 + 10 * 64, 0x9000],
        [3 * 64, 64, 3 * 64, 64],
    )


@pytest.mark.parametrize("builder", BUILDERS)
def test_merge_example_not_dense(builder):
    # K|V packed per block: only the K half (64 of 128 B) moves, so blocks cannot be merged
    lp = [PlaneGeometry(0x1000, 128, 64, 16)]
    rp = [PlaneGeometry(0x8000, 64, 64, 32)]
    assert builder(lp, rp, [3, 4, 5, 9], [10, 11, 12, 0]) == (
        [0x1000 + 3 * 128, 0x1000 + 4 * 128, 0x1000 + 5 * 128, 0x1000 + 9 * 128],
        [0x8000 + 10 * 64, 0x8000 + 11 * 64, 0x8000 + 12 * 64, 0x8000],
        [64, 64, 64, 64],
    )


@pytest.mark.parametrize("builder", BUILDERS)
def test_no_merge_across_adjacent_planes(builder):
    # two planes back to back in memory, all blocks of both: still one descriptor per plane
    lp = [PlaneGeometry(0, 16, 16, 4), PlaneGeometry(64, 16, 16, 4)]
    rp = [PlaneGeometry(1000, 16, 16, 4), PlaneGeometry(1064, 16, 16, 4)]
    assert builder(lp, rp, [0, 1, 2, 3], [0, 1, 2, 3]) == ([0, 64], [1000, 1064], [64, 64])


@pytest.mark.parametrize("builder", BUILDERS)
def test_empty_inputs(builder):
    planes = [PlaneGeometry(0, 16, 16, 4)]
    assert builder([], [], [], []) == ([], [], [])
    assert builder(planes, planes, [], []) == ([], [], [])
    assert builder([], [], [1, 2], [3, 4]) == ([], [], [])  # no planes: nothing to move, ids unchecked


@pytest.mark.parametrize("builder", BUILDERS)
@pytest.mark.parametrize(
    ("lp", "rp", "li", "ri", "message"),
    [
        ([PlaneGeometry(0, 16, 16, 4)], [], [], [], "1 local planes but 0 remote planes"),
        ([], [], [1], [], "1 local blocks but 0 remote blocks"),
        ([PlaneGeometry(0, 16, 16, 4)], [PlaneGeometry(0, 32, 32, 4)], [], [], "local block is 16 B but remote"),
        ([PlaneGeometry(0, 16, 16, 4)], [PlaneGeometry(0, 16, 16, 8)], [4], [4], "local block id 4 out of range"),
        ([PlaneGeometry(0, 16, 16, 8)], [PlaneGeometry(0, 16, 16, 4)], [4], [4], "remote block id 4 out of range"),
        ([PlaneGeometry(0, 16, 16, 8)], [PlaneGeometry(0, 16, 16, 4)], [0], [-1], "remote block id -1 out of range"),
        (
            [PlaneGeometry(0, 16, 16, 8), PlaneGeometry(0, 16, 16, 2)],
            [PlaneGeometry(0, 16, 16, 8)] * 2,
            [1, 3],
            [1, 3],
            "local block id 3 out of range for plane 1 with 2 blocks",
        ),
    ],
)
def test_error_examples(builder, lp, rp, li, ri, message):
    with pytest.raises(ValueError, match=message):
        builder(lp, rp, li, ri)
