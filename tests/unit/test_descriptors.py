"""Descriptor building: the C++ extension against the Python reference, and the properties both must have.

Properties (for every implementation): descriptors cover exactly the requested bytes, never overlap on either
side (for distinct ids), never leave their plane (even when planes are adjacent in memory), and pair a local
plane with the same remote plane. The C++ builder (vllm_kvp2p._C through vllm_kvp2p.transfer.native, called by
build_descriptors) must give output identical to build_descriptors_py, including which ValueError it raises.
"""

from __future__ import annotations

import bisect
import subprocess
import sys
from collections.abc import Callable, Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_kvp2p.transfer import native as _ext
from vllm_kvp2p.transfer.descriptors import (
    Descriptors,
    PlaneGeometry,
    block_runs,
    build_descriptors,
    build_descriptors_py,
)

pytestmark = pytest.mark.timeout(300)

requires_ext = pytest.mark.skipif(
    not _ext.AVAILABLE,
    reason="C++ extension vllm_kvp2p._C is not built (VLLM_KVP2P_SKIP_EXT=1 or a failed build): "
    "C++ vs Python comparisons skipped, only the Python reference is tested",
)

Triple = tuple[list[int], list[int], list[int]]
Builder = Callable[[Sequence[PlaneGeometry], Sequence[PlaneGeometry], Sequence[int], Sequence[int]], Triple]


def py_builder(lp, rp, li, ri) -> Triple:
    d = build_descriptors_py(lp, rp, li, ri)
    return d.local_addrs, d.remote_addrs, d.lengths


def raw_cpp_builder(lp, rp, li, ri) -> Triple:
    from vllm_kvp2p import _C

    return _C.build_descriptors(lp, rp, li, ri)


def dispatch_builder(lp, rp, li, ri) -> Triple:
    """What the package calls: the C++ builder, with the reference outside its 64-bit domain."""
    assert _ext.build_descriptors is not None
    d = build_descriptors(lp, rp, li, ri)
    return d.local_addrs, d.remote_addrs, d.lengths


BUILDERS = [
    pytest.param(py_builder, id="python"),
    pytest.param(raw_cpp_builder, id="cpp", marks=requires_ext),
    pytest.param(dispatch_builder, id="dispatch", marks=requires_ext),
]

PROPERTY_SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def outcome(builder: Builder, lp, rp, li, ri) -> tuple[str, object]:
    """A result or the ValueError message, so both kinds of outcome can be compared."""
    try:
        out = builder(lp, rp, li, ri)
    except ValueError as exc:
        return "ValueError", str(exc)
    assert isinstance(out, tuple) and len(out) == 3 and all(type(x) is list for x in out)
    return "ok", out


# --------------------------------------------------------------------------------------------------------------
# Strategies
# --------------------------------------------------------------------------------------------------------------


@st.composite
def id_pairs(draw, n_local: int, n_remote: int, unique: bool = False) -> tuple[list[int], list[int]]:
    """Equal-length local/remote id lists within [0, n_local) x [0, n_remote).

    Mixes runs consecutive on both sides (mergeable), independent random ids, repeats, and shuffles.
    With ``unique`` the ids on each side are distinct (what the scheduler hands out).
    """
    kind = draw(st.sampled_from(["runs", "random", "shuffled_runs", "empty", "single"]))
    if kind == "empty":
        return [], []
    if kind == "single":
        return [draw(st.integers(0, n_local - 1))], [draw(st.integers(0, n_remote - 1))]
    if kind == "random":
        if unique:
            n = draw(st.integers(0, min(n_local, n_remote)))
            li = draw(st.permutations(range(n_local)))[:n]
            ri = draw(st.permutations(range(n_remote)))[:n]
            return list(li), list(ri)
        n = draw(st.integers(0, 80))
        li = draw(st.lists(st.integers(0, n_local - 1), min_size=n, max_size=n))
        ri = draw(st.lists(st.integers(0, n_remote - 1), min_size=n, max_size=n))
        return li, ri
    if unique:
        return draw(unique_run_ids(n_local, n_remote))
    # runs: chunks consecutive on both sides, at possibly unrelated starts (chunks may overlap: repeats)
    li: list[int] = []
    ri: list[int] = []
    for _ in range(draw(st.integers(1, 8))):
        length = draw(st.integers(1, min(n_local, n_remote)))
        l0 = draw(st.integers(0, n_local - length))
        r0 = draw(st.integers(0, n_remote - length))
        li.extend(range(l0, l0 + length))
        ri.extend(range(r0, r0 + length))
    if kind == "shuffled_runs" and li:
        perm = draw(st.permutations(range(len(li))))
        li = [li[p] for p in perm]
        ri = [ri[p] for p in perm]
    return li, ri


@st.composite
def unique_run_ids(draw, n_local: int, n_remote: int) -> tuple[list[int], list[int]]:
    """Distinct ids on each side made of long runs consecutive on both sides (the common case: a prompt's
    blocks allocated back to back), optionally shuffled."""
    n = draw(st.integers(0, min(n_local, n_remote)))
    l_cuts = sorted(draw(st.lists(st.integers(0, n), max_size=6)))
    bounds = [0, *l_cuts, n]
    chunks = [(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1) if bounds[i] < bounds[i + 1]]
    # place the chunks at shuffled positions on each side (a permutation of chunks keeps them disjoint)
    lorder = draw(st.permutations(range(len(chunks))))
    rorder = draw(st.permutations(range(len(chunks))))
    loff = draw(st.integers(0, n_local - n))
    roff = draw(st.integers(0, n_remote - n))

    def place(order: Sequence[int], offset: int) -> dict[int, int]:
        start, pos = {}, offset
        for c in order:
            start[c] = pos
            pos += chunks[c][1] - chunks[c][0]
        return start

    lstart, rstart = place(lorder, loff), place(rorder, roff)
    li: list[int] = []
    ri: list[int] = []
    for c, (a, b) in enumerate(chunks):
        li.extend(range(lstart[c], lstart[c] + b - a))
        ri.extend(range(rstart[c], rstart[c] + b - a))
    if draw(st.booleans()) and li:
        perm = draw(st.permutations(range(len(li))))
        li = [li[p] for p in perm]
        ri = [ri[p] for p in perm]
    return li, ri


@st.composite
def realistic_case(draw, unique: bool = True):
    """Planes laid out as real registrations: stride >= bytes, no two planes overlap, sometimes adjacent."""
    n_planes = draw(st.integers(0, 6))
    n_local = draw(st.integers(1, 48))
    n_remote = draw(st.integers(1, 48))

    def side(n_blocks: int, block_bytes: list[int]) -> list[PlaneGeometry]:
        planes = []
        addr = draw(st.integers(0, 2**40)) * 64
        for bb in block_bytes:
            stride = bb if draw(st.booleans()) else bb + draw(st.integers(1, 512))
            nb = n_blocks + draw(st.sampled_from([0, 0, 1, 7]))
            planes.append(PlaneGeometry(addr, stride, bb, nb))
            addr += nb * stride + draw(st.sampled_from([0, 0, 64, 4096]))  # 0: adjacent planes
        return planes

    block_bytes = [draw(st.sampled_from([1, 16, 64, 96, 4096, 16384])) for _ in range(n_planes)]
    lp = side(n_local, block_bytes)
    rp = side(n_remote, block_bytes)
    if unique:
        li, ri = draw(st.one_of(unique_run_ids(n_local, n_remote), id_pairs(n_local, n_remote, unique=True)))
    else:
        li, ri = draw(id_pairs(n_local, n_remote))
    return lp, rp, li, ri


@st.composite
def general_case(draw):
    """Valid inputs without the realism: any 64-bit geometry (stride < bytes, zero stride, overlapping planes)."""
    n_planes = draw(st.integers(0, 5))
    n_local = draw(st.integers(1, 40))
    n_remote = draw(st.integers(1, 40))
    addr = st.integers(0, 2**62)
    small = st.integers(0, 2**20)

    lp, rp = [], []
    for _ in range(n_planes):
        bb = draw(small)
        lstride = draw(st.one_of(st.just(bb), small))
        rstride = draw(st.one_of(st.just(bb), small))
        lp.append(PlaneGeometry(draw(addr), lstride, bb, n_local + draw(st.integers(0, 3))))
        rp.append(PlaneGeometry(draw(addr), rstride, bb, n_remote + draw(st.integers(0, 3))))
    li, ri = draw(id_pairs(n_local, n_remote))
    return lp, rp, li, ri


@st.composite
def broken_case(draw):
    """A valid case with one thing made wrong (each of the reference's ValueError conditions)."""
    lp, rp, li, ri = draw(general_case())
    what = draw(st.sampled_from(["planes", "ids", "block_bytes", "local_id", "remote_id"]))
    if what == "planes":
        if draw(st.booleans()):
            lp = lp + [PlaneGeometry(0, 64, 64, 8)]
        else:
            rp = rp[1:] if rp else [PlaneGeometry(0, 64, 64, 8)]
    elif what == "ids":
        extra = draw(st.integers(1, 3))
        if draw(st.booleans()):
            li = li + [0] * extra
        else:
            ri = ri + [0] * extra
    elif what == "block_bytes" and lp:
        i = draw(st.integers(0, len(rp) - 1))
        p = rp[i]
        changed = PlaneGeometry(p.base_addr, p.block_stride, p.block_bytes + draw(st.integers(1, 9)), p.num_blocks)
        rp = [*rp[:i], changed, *rp[i + 1 :]]
    elif what in ("local_id", "remote_id") and li and lp:
        ids, planes = (li, lp) if what == "local_id" else (ri, rp)
        pos = draw(st.integers(0, len(ids) - 1))
        limit = min(p.num_blocks for p in planes)
        bad = draw(st.one_of(st.integers(limit, limit + 5), st.integers(-5, -1)))
        ids = [*ids[:pos], bad, *ids[pos + 1 :]]
        li, ri = (ids, ri) if what == "local_id" else (li, ids)
    return lp, rp, li, ri


@st.composite
def wild_case(draw):
    """Anything integer-valued, small enough that successes and every kind of error all occur."""
    nl = draw(st.integers(0, 4))
    nr = draw(st.sampled_from([nl, nl, nl, max(nl - 1, 0), nl + 1]))
    lp, rp = [], []
    for i in range(max(nl, nr)):
        bb = draw(st.integers(-1, 12))
        rbb = bb if draw(st.integers(0, 9)) else draw(st.integers(-1, 12))
        nb = st.integers(6, 14) | st.integers(-1, 14)
        if i < nl:
            stride = draw(st.just(bb) | st.integers(-1, 12))
            lp.append(PlaneGeometry(draw(st.integers(0, 1000)), stride, bb, draw(nb)))
        if i < nr:
            stride = draw(st.just(rbb) | st.integers(-1, 12))
            rp.append(PlaneGeometry(draw(st.integers(0, 1000)), stride, rbb, draw(nb)))
    n = draw(st.integers(0, 12))
    ids = st.integers(0, 5) | st.integers(-1, 12)
    li = draw(st.lists(ids, min_size=n, max_size=n))
    m = draw(st.sampled_from([n, n, n, n, n + 1]))
    ri = draw(st.lists(ids, min_size=m, max_size=m))
    return lp, rp, li, ri


# --------------------------------------------------------------------------------------------------------------
# C++ == Python
# --------------------------------------------------------------------------------------------------------------


@requires_ext
@PROPERTY_SETTINGS
@given(case=st.one_of(realistic_case(), realistic_case(unique=False), general_case()))
def test_cpp_matches_python(case):
    lp, rp, li, ri = case
    expected = py_builder(lp, rp, li, ri)
    assert raw_cpp_builder(lp, rp, li, ri) == expected
    assert dispatch_builder(lp, rp, li, ri) == expected
    assert build_descriptors(lp, rp, li, ri) == Descriptors(*expected)


@requires_ext
@PROPERTY_SETTINGS
@given(case=broken_case())
def test_cpp_raises_like_python(case):
    lp, rp, li, ri = case
    expected = outcome(py_builder, lp, rp, li, ri)
    assert outcome(raw_cpp_builder, lp, rp, li, ri) == expected
    assert outcome(dispatch_builder, lp, rp, li, ri) == expected


@requires_ext
@settings(max_examples=400, deadline=None)
@given(case=wild_case())
def test_cpp_matches_python_on_arbitrary_integers(case):
    lp, rp, li, ri = case
    expected = outcome(py_builder, lp, rp, li, ri)
    assert outcome(dispatch_builder, lp, rp, li, ri) == expected
    try:
        raw = outcome(raw_cpp_builder, lp, rp, li, ri)
    except (TypeError, OverflowError):  # negative geometry: outside the C++ domain, the wrapper fell back
        assert any(v < 0 for p in [*lp, *rp] for v in (p.base_addr, p.block_stride, p.block_bytes))
    else:
        assert raw == expected


@requires_ext
def test_cpp_matches_python_at_scale():
    """61 layers x 2 planes, ~8k blocks of a long prompt, allocated in a few runs and then shuffled."""
    import random

    rng = random.Random(0)
    n_blocks = 8192
    lp = [PlaneGeometry(0x7F00_0000_0000 + i * n_blocks * 2048, 2048, 2048, n_blocks) for i in range(122)]
    rp = [PlaneGeometry(0x7E00_0000_0000 + i * n_blocks * 4096, 4096, 2048, n_blocks) for i in range(61)]
    rp += [PlaneGeometry(0x7D00_0000_0000 + i * n_blocks * 2048, 2048, 2048, n_blocks) for i in range(61)]
    li = list(range(100, 4100)) + rng.sample(range(4100, n_blocks), 2000)
    ri = rng.sample(range(n_blocks), 1000) + list(range(2000, 7000))
    assert py_builder(lp, rp, li, ri) == raw_cpp_builder(lp, rp, li, ri)


@requires_ext
def test_dispatch_falls_back_outside_64_bits():
    from vllm_kvp2p import _C

    top = [PlaneGeometry(2**64 - 100, 64, 64, 16)]
    low = [PlaneGeometry(0, 64, 64, 16)]
    with pytest.raises(OverflowError):
        _C.build_descriptors(top, low, [3], [3])
    assert dispatch_builder(top, low, [3], [3]) == py_builder(top, low, [3], [3]) == ([2**64 + 92], [192], [64])
    # ids beyond int64 with no planes: the reference returns nothing, whatever the ids
    assert dispatch_builder([], [], [2**80], [-(2**80)]) == py_builder([], [], [2**80], [-(2**80)]) == ([], [], [])
    # non-integer ids: whatever the reference does (here, float addresses)
    assert dispatch_builder(low, low, [1.0], [2.0]) == py_builder(low, low, [1.0], [2.0])
    # ...and its errors
    with pytest.raises(TypeError):
        py_builder(low, low, ["x"], [1])
    with pytest.raises(TypeError):
        dispatch_builder(low, low, ["x"], [1])


@requires_ext
def test_cpp_accepts_any_sequences_and_index_ints():
    planes = [PlaneGeometry(1000, 64, 64, 16)]

    class Index:
        def __init__(self, v: int) -> None:
            self.v = v

        def __index__(self) -> int:
            return self.v

    expected = py_builder(planes, planes, [3, 4, 5, 9], [1, 2, 3, 4])
    assert raw_cpp_builder(tuple(planes), planes, (3, 4, 5, 9), range(1, 5)) == expected
    assert raw_cpp_builder(planes, planes, [Index(3), 4, 5, Index(9)], [1, 2, 3, 4]) == expected


def test_ext_module_state():
    assert isinstance(_ext.AVAILABLE, bool)
    assert (_ext.build_descriptors is not None) == _ext.AVAILABLE


def test_ext_import_is_light():
    code = "import sys, vllm_kvp2p.transfer.native; print(sorted(m for m in ('torch', 'vllm') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


# --------------------------------------------------------------------------------------------------------------
# Properties of the descriptors, for every implementation
# --------------------------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------------------------
# Descriptors
# --------------------------------------------------------------------------------------------------------------


def test_batches_examples():
    d = Descriptors([1, 2, 3, 4, 5], [10, 20, 30, 40, 50], [7, 7, 7, 7, 8])
    assert len(d) == 5 and d.total_bytes == 36
    assert d.batches(2) == [
        Descriptors([1, 2], [10, 20], [7, 7]),
        Descriptors([3, 4], [30, 40], [7, 7]),
        Descriptors([5], [50], [8]),
    ]
    assert d.batches(5) == [d]
    assert d.batches(100) == [d]
    assert Descriptors([], [], []).batches(3) == []
    for bad in (0, -1):
        with pytest.raises(ValueError):
            d.batches(bad)


@given(n=st.integers(0, 200), max_entries=st.integers(1, 64))
def test_batches_property(n, max_entries):
    d = Descriptors(list(range(n)), list(range(1000, 1000 + n)), [1 + i % 3 for i in range(n)])
    batches = d.batches(max_entries)
    assert all(1 <= len(b) <= max_entries for b in batches)
    assert all(len(b) == max_entries for b in batches[:-1])  # only the last may be short
    assert len(batches) == -(-n // max_entries)
    assert [x for b in batches for x in b.local_addrs] == d.local_addrs
    assert [x for b in batches for x in b.remote_addrs] == d.remote_addrs
    assert [x for b in batches for x in b.lengths] == d.lengths
    assert sum(b.total_bytes for b in batches) == d.total_bytes
