"""Which P ranks and heads each D rank reads: pure function, both sides agree on every count."""

from __future__ import annotations

import pytest

from vllm_kvp2p.tp_mapping import HeadSlice, Layout, UnsupportedLayout, rank_plan


def plans(p_tp: int, d_tp: int, heads: int = 8, mla: bool = False):
    p, d = Layout(p_tp, heads, mla), Layout(d_tp, heads, mla)
    return [rank_plan(p, d, r) for r in range(d_tp)]


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (2, 1), (1, 2), (4, 2), (2, 4), (8, 1), (1, 8), (16, 2), (2, 16)])
def test_every_head_read_once_and_every_p_rank_released(p_tp: int, d_tp: int) -> None:
    heads = 8
    p, d = Layout(p_tp, heads), Layout(d_tp, heads)
    all_plans = plans(p_tp, d_tp, heads)
    for r, plan in enumerate(all_plans):
        got = sorted(p.heads_of(s.p_rank)[s.remote_head + i] for s in plan.reads for i in range(s.num_heads))
        assert got == list(d.heads_of(r))  # exactly this D rank's heads, from ranks that hold them
        for s in plan.reads:
            assert list(range(s.local_head, s.local_head + s.num_heads)) == [
                d.heads_of(r).index(p.heads_of(s.p_rank)[s.remote_head + i]) for i in range(s.num_heads)
            ]
    # Every P rank is released by exactly as many D ranks as it is told to expect, and all D ranks agree.
    releases = {q: 0 for q in range(p_tp)}
    for plan in all_plans:
        assert plan.expected_readers == all_plans[0].expected_readers
        for q in plan.p_ranks:
            releases[q] += 1
    assert releases == all_plans[0].expected_readers
    assert all(n >= 1 for n in releases.values())


def test_p_tp_greater_reads_contiguous_slices_from_several_ranks() -> None:
    (plan,) = plans(4, 1, heads=8)
    assert plan.reads == tuple(HeadSlice(q, 0, 2 * q, 2) for q in range(4))
    assert plan.notify == ()


def test_d_tp_greater_reads_a_sub_slice_of_one_rank() -> None:
    plan = plans(2, 4, heads=8)[3]
    assert plan.reads == (HeadSlice(1, 2, 0, 2),)
    assert plan.expected_readers == {0: 2, 1: 2}


def test_replicated_heads_pick_one_replica_deterministically() -> None:
    # 2 KV heads, P TP 8: each head has 4 replicas; D TP 2 reads one of each.
    a, b = plans(8, 2, heads=2), plans(8, 2, heads=2)
    assert a == b
    read = [s.p_rank for plan in a for s in plan.reads]
    assert len(read) == 2 and len(set(read)) == 2
    notified = [q for plan in a for q in plan.notify]
    assert sorted(read + notified) == list(range(8))


def test_mla_reads_exactly_one_rank_and_releases_the_others() -> None:
    all_plans = plans(4, 2, heads=1, mla=True)
    assert [plan.reads for plan in all_plans] == [(HeadSlice(0, 0, 0, 1),), (HeadSlice(1, 0, 0, 1),)]
    assert [plan.notify for plan in all_plans] == [(2,), (3,)]
    assert all_plans[0].expected_readers == {0: 1, 1: 1, 2: 1, 3: 1}


@pytest.mark.parametrize(("p", "d", "message"), [
    (Layout(2, 8), Layout(1, 4), "total KV heads differ: P has 8, D has 4"),
    (Layout(2, 8, True), Layout(1, 8), "MLA on P is True, on D False"),
])
def test_incompatible_layouts_are_refused_with_both_values(p: Layout, d: Layout, message: str) -> None:
    with pytest.raises(UnsupportedLayout, match=message):
        rank_plan(p, d, 0)


def test_heads_and_tp_must_divide() -> None:
    with pytest.raises(UnsupportedLayout, match="tensor_parallel_size=3 and 8 KV heads"):
        Layout(3, 8)
