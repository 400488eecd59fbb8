"""Which P ranks and heads each D rank reads: pure function, both sides agree on every count.

The heads each TP rank holds are not taken from ``Layout.heads_of`` (the code under test) but from
``VLLM_KV_HEADS``, a table written out by hand from vLLM's own sharding of the attention weights;
tests/worker/test_tp_layouts.py holds the table to vLLM's real ``QKVParallelLinear`` weight loading, so it cannot
drift."""

from __future__ import annotations

import pytest

from vllm_kvp2p.transfer.tp_mapping import HeadSlice, Layout, UnsupportedLayout, rank_plan

# (total KV heads, TP size) -> the global KV heads of each TP rank, rank 0 first. Transcribed from vLLM 0.32.0 (the
# same lines in 0.23.0), vllm/model_executor/layers/linear.py, QKVParallelLinear.__init__ (:1053-1058):
#     if tp_size >= self.total_num_kv_heads:
#         self.num_kv_heads = 1
#         self.num_kv_head_replicas = divide(tp_size, self.total_num_kv_heads)
#     else:
#         self.num_kv_heads = divide(self.total_num_kv_heads, tp_size)
#         self.num_kv_head_replicas = 1
# QKVParallelLinear.weight_loader_v2 (:1190-1196) loads "k" and "v" with num_heads=self.num_kv_head_replicas and
# shard_size = num_kv_heads * head_size, and vllm/model_executor/parameter.py, _ColumnvLLMParameter.load_qkv_weight
# (:191-195):
#     shard_id_int = self.tp_rank if shard_id == "q" else self.tp_rank // num_heads
#     loaded_weight = loaded_weight.narrow(self.output_dim, shard_id_int * shard_size, shard_size)
# i.e. rank r loads the checkpoint's K/V heads [(r // replicas) * num_kv_heads, ... + num_kv_heads).
VLLM_KV_HEADS: dict[tuple[int, int], tuple[tuple[int, ...], ...]] = {
    (8, 1): ((0, 1, 2, 3, 4, 5, 6, 7),),
    (8, 2): ((0, 1, 2, 3), (4, 5, 6, 7)),
    (8, 4): ((0, 1), (2, 3), (4, 5), (6, 7)),
    (8, 8): ((0,), (1,), (2,), (3,), (4,), (5,), (6,), (7,)),
    (8, 16): ((0,), (0,), (1,), (1,), (2,), (2,), (3,), (3,), (4,), (4,), (5,), (5,), (6,), (6,), (7,), (7,)),
    (4, 1): ((0, 1, 2, 3),),
    (4, 2): ((0, 1), (2, 3)),
    (4, 4): ((0,), (1,), (2,), (3,)),
    (4, 8): ((0,), (0,), (1,), (1,), (2,), (2,), (3,), (3,)),
    (2, 1): ((0, 1),),
    (2, 2): ((0,), (1,)),
    (2, 4): ((0,), (0,), (1,), (1,)),
    (2, 8): ((0,), (0,), (0,), (0,), (1,), (1,), (1,), (1,)),
    (1, 1): ((0,),),
    (1, 4): ((0,), (0,), (0,), (0,)),
}


def vllm_heads(total_kv_heads: int, tp: int, rank: int) -> tuple[int, ...]:
    """What vLLM's rank ``rank`` of ``tp`` holds (the table, never the code under test)."""
    return VLLM_KV_HEADS[(total_kv_heads, tp)][rank]


@pytest.mark.parametrize(("total_kv_heads", "tp"), sorted(VLLM_KV_HEADS))
def test_layout_holds_the_heads_vllm_gives_each_rank(total_kv_heads: int, tp: int) -> None:
    layout = Layout(tp, total_kv_heads)
    assert [tuple(layout.heads_of(r)) for r in range(tp)] == list(VLLM_KV_HEADS[(total_kv_heads, tp)])
    assert layout.heads_per_rank == len(vllm_heads(total_kv_heads, tp, 0))
    for head in range(total_kv_heads):
        assert layout.holders_of(head) == [r for r in range(tp) if head in vllm_heads(total_kv_heads, tp, r)]


def plans(p_tp: int, d_tp: int, heads: int = 8, mla: bool = False):
    p, d = Layout(p_tp, heads, mla), Layout(d_tp, heads, mla)
    return [rank_plan(p, d, r) for r in range(d_tp)]


@pytest.mark.parametrize(("p_tp", "d_tp", "total"), [
    (1, 1, 8), (2, 1, 8), (1, 2, 8), (4, 2, 8), (2, 4, 8), (8, 1, 8), (1, 8, 8), (16, 2, 8), (2, 16, 8),
    (4, 2, 2), (8, 2, 2), (2, 8, 2), (8, 4, 4), (4, 8, 4), (4, 1, 1),
])
def test_every_head_read_once_and_every_p_rank_released(p_tp: int, d_tp: int, total: int) -> None:
    all_plans = plans(p_tp, d_tp, total)
    for r, plan in enumerate(all_plans):
        mine = vllm_heads(total, d_tp, r)
        got = []
        for s in plan.reads:
            theirs = vllm_heads(total, p_tp, s.p_rank)
            assert 0 <= s.remote_head and s.remote_head + s.num_heads <= len(theirs), (s, theirs)
            assert 0 <= s.local_head and s.local_head + s.num_heads <= len(mine), (s, mine)
            for i in range(s.num_heads):
                # P rank's remote head i is the global head that goes to this D rank's local head i
                assert theirs[s.remote_head + i] == mine[s.local_head + i], (r, s, theirs, mine)
                got.append(theirs[s.remote_head + i])
        assert sorted(got) == list(mine)  # exactly this D rank's heads, each once, from ranks that hold them
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
