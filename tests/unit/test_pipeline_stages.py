"""Pipeline stages, pure: which P ranks a D rank talks to, which of their layers fill which of D's planes, and
the refusals when P's stages do not fill D (vllm_kvp2p/lifecycle/stages.py, driven through the pull state machine)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from vllm_kvp2p.contract.protocol import ANY_PORT, ClaimReply, ClaimStatus, RankRegistration, Released, RemotePrefill
from vllm_kvp2p.lifecycle.consumer import PullPlan
from vllm_kvp2p.lifecycle.pull import (
    ConsumerPull,
    FetchRegistration,
    Finish,
    LocalKV,
    Outcome,
    ReadBatch,
    SendClaim,
    SendRelease,
    Source,
)
from vllm_kvp2p.lifecycle.rank_table import entry_only, table_of, table_problem
from vllm_kvp2p.lifecycle.stages import coverage_problem, plane_pairs, sources_of
from vllm_kvp2p.transfer.descriptors import PlaneGeometry
from vllm_kvp2p.transfer.slicing import BlockShape
from vllm_kvp2p.transfer.tp_mapping import HeadSlice, Layout, rank_plan

BS = 16
SHAPE = BlockShape(True, 2, BS, 16)  # two heads, 512-byte blocks
LAYERS = ("l0", "l1", "l2", "l3")
D_BASE, P_BASE = 1 << 20, 1 << 30


def plane(base: int, layer: int) -> PlaneGeometry:
    return PlaneGeometry(base + layer * 100_000, 512, 512, 100)


def d_local(layers: Sequence[str] = LAYERS, pp_size: int = 1) -> LocalKV:
    return LocalKV(tuple(plane(D_BASE, i) for i in range(len(layers))), (SHAPE,) * len(layers), BS, tuple(layers),
                   "bfloat16", 2, pp_size=pp_size)


def stage_registration(layers: Sequence[str], pp_rank: int, pp_size: int, tp_rank: int = 0,
                       tp_size: int = 1) -> RankRegistration:
    """P rank (pp_rank, tp_rank): its stage's layers, each plane at P_BASE + (rank, layer)."""
    rank = pp_rank * tp_size + tp_rank
    base = P_BASE + rank * 10_000_000
    heads = 2 // tp_size
    shape = BlockShape(True, heads, BS, 16)
    return RankRegistration("P", tp_rank, tp_size, "127.0.0.1:15000",
                            [plane(base, i) for i in range(len(layers))], [shape] * len(layers), list(layers), BS,
                            100, "bfloat16", heads, 2, 8, pp_rank=pp_rank, pp_size=pp_size)


def plan(pp_size: int = 2, tp_size: int = 1) -> PullPlan:
    remote = RemotePrefill("P", "p-req", "127.0.0.1", 14600, [[1, 2]], "hold", 32, BS, tp_size=tp_size,
                           pp_size=pp_size)
    return PullPlan("d1", remote, ((3, 4),), ((1, 2),), awaiting=True)


def run(job: ConsumerPull, registrations: dict[int, RankRegistration]) -> tuple[Outcome, str, dict[int, set]]:
    """Drive a pull to its end, every P rank granting with its registration; what was read, per P rank: the
    (D address, P address) pairs."""
    reads: dict[int, set] = {}
    for _ in range(100):
        action = job.next_action(0.0)
        if isinstance(action, FetchRegistration):
            job.with_claim(action.source)
        elif isinstance(action, SendClaim):
            job.on_claim_reply(action.source, ClaimReply(ClaimStatus.GRANTED, lease=30, lease_token="t",
                                                         registration=registrations[action.source.p_rank]), now=0.0)
        elif isinstance(action, ReadBatch):
            batch = action.descriptors
            reads.setdefault(action.source.p_rank, set()).update(zip(batch.local_addrs, batch.remote_addrs))
            job.on_batch_done(action.source, True)
        elif isinstance(action, SendRelease):
            job.on_release_sent(action.source, Released(lease_held=True).lease_held)
        elif isinstance(action, Finish):
            return action.result.outcome, action.result.reason, reads
    raise AssertionError("the pull did not finish")


def test_each_p_stage_is_a_source_with_the_tp_mapping_inside_it() -> None:
    same = rank_plan(Layout(1, 2), Layout(1, 2), 0)
    assert sources_of(same, 1, 2, 1) == (Source(0, 1, (HeadSlice(0, 0, 0, 2),)),
                                         Source(1, 1, (HeadSlice(1, 0, 0, 2),)))
    # P at PP 2 x TP 1 -> D at TP 2: D rank 1 reads head 1 of every stage; each P rank waits for both D ranks.
    split = rank_plan(Layout(1, 2), Layout(2, 2), 1)
    assert sources_of(split, 1, 2, 1) == (Source(0, 2, (HeadSlice(0, 1, 0, 1),)),
                                          Source(1, 2, (HeadSlice(1, 1, 0, 1),)))
    # P at PP 2 x TP 2 -> D TP 1: ranks stage * 2 + tp rank.
    four = sources_of(rank_plan(Layout(2, 2), Layout(1, 2), 0), 2, 2, 1)
    assert [s.p_rank for s in four] == [0, 1, 2, 3] and all(s.expected_readers == 1 for s in four)
    # D at PP 2: each P rank is released by every D stage's readers.
    assert [s.expected_readers for s in sources_of(same, 1, 1, 2)] == [2]


def test_a_pull_reads_each_stages_layers_from_that_stage() -> None:
    registrations = {0: stage_registration(LAYERS[:3], 0, 2), 1: stage_registration(LAYERS[3:], 1, 2)}
    job = ConsumerPull(plan(), sources_of(rank_plan(Layout(1, 2), Layout(1, 2), 0), 1, 2, 1), "D:0", d_local(),
                       claim_wait=1.0, max_batch_entries=64, now=0.0)
    outcome, reason, reads = run(job, registrations)
    assert (outcome, reason) == (Outcome.PULLED, "")
    stage1 = P_BASE + 10_000_000
    # Block 3,4 <- 1,2 of each layer (one merged run per plane): l0..l2 from stage 0, l3 from stage 1's plane 0.
    assert reads[0] == {(D_BASE + i * 100_000 + 3 * 512, P_BASE + i * 100_000 + 512) for i in range(3)}
    assert reads[1] == {(D_BASE + 3 * 100_000 + 3 * 512, stage1 + 512)}


@pytest.mark.parametrize(("stage1_layers", "message"), [
    (("l3",), ""),
    ((), "no P stage holds D's layers l3"),
    (("l2", "l3"), "P's stages hold layers l2 more than once"),
    (("l3", "mtp.0"), "KV layers of P stage 1 that D lacks: mtp.0"),
    (("l3", "l3"), "registration names a layer twice"),
])
def test_stages_that_do_not_fill_d_exactly_fail_the_pull_naming_the_layers(stage1_layers: tuple[str, ...],
                                                                           message: str) -> None:
    registrations = {0: stage_registration(LAYERS[:3], 0, 2), 1: stage_registration(stage1_layers, 1, 2)}
    job = ConsumerPull(plan(), sources_of(rank_plan(Layout(1, 2), Layout(1, 2), 0), 1, 2, 1), "D:0", d_local(),
                       claim_wait=1.0, max_batch_entries=64, now=0.0)
    outcome, reason, _ = run(job, registrations)
    assert (outcome is Outcome.PULLED) == (not message) and message in reason, reason


def test_mixed_layouts_p_stages_to_d_tensor_parallel() -> None:
    """P at PP 2 x TP 1 -> D at PP 1 x TP 2: each D rank reads its head of every layer, from the stage holding it."""
    registrations = {0: stage_registration(LAYERS[:2], 0, 2), 1: stage_registration(LAYERS[2:], 1, 2)}
    local = LocalKV(tuple(plane(D_BASE, i) for i in range(4)), (BlockShape(True, 1, BS, 16),) * 4, BS, LAYERS,
                    "bfloat16", 2, tp_size=2)
    job = ConsumerPull(plan(), sources_of(rank_plan(Layout(1, 2), Layout(2, 2), 1), 1, 2, 1), "D:1", local,
                       claim_wait=1.0, max_batch_entries=64, now=0.0)
    outcome, reason, reads = run(job, registrations)
    assert (outcome, reason) == (Outcome.PULLED, "")
    assert {layer for layer in range(4) for (d, _) in reads[0] | reads[1]
            if D_BASE + layer * 100_000 <= d < D_BASE + (layer + 1) * 100_000} == {0, 1, 2, 3}
    assert len(reads[0]) == len(reads[1]) == 2 * 2  # 2 layers x 2 blocks of head 1 (head-major: one run each)


def test_d_stages_read_their_layers_from_a_p_of_one_stage() -> None:
    """P at PP 1 x TP 2 -> D at PP 2 x TP 1: D's second stage (l2, l3) reads those layers from both P ranks, and
    tells each P rank it is one of two readers (one per D stage)."""
    registrations = {q: stage_registration(LAYERS, 0, 1, q, 2) for q in range(2)}
    sources = sources_of(rank_plan(Layout(2, 2), Layout(1, 2), 0), 2, 1, 2)
    assert [s.expected_readers for s in sources] == [2, 2]
    job = ConsumerPull(plan(pp_size=1, tp_size=2), sources, "D:1", d_local(LAYERS[2:], pp_size=2), claim_wait=1.0,
                       max_batch_entries=64, now=0.0)
    outcome, reason, reads = run(job, registrations)
    assert (outcome, reason) == (Outcome.PULLED, "")
    assert {(r - P_BASE) // 100_000 for (_, r) in reads[0]} == {2, 3}  # P rank 0's planes of l2 and l3 only
    assert {(d - D_BASE) // 100_000 for (d, _) in reads[0] | reads[1]} == {0, 1}  # into D's two planes


def test_a_registration_of_another_stage_is_refused_at_its_rank() -> None:
    registrations = {0: stage_registration(LAYERS[:2], 0, 2), 1: stage_registration(LAYERS[2:], 0, 2)}
    job = ConsumerPull(plan(), sources_of(rank_plan(Layout(1, 2), Layout(1, 2), 0), 1, 2, 1), "D:0", d_local(),
                       claim_wait=1.0, max_batch_entries=64, now=0.0)
    outcome, reason, _ = run(job, registrations)
    assert outcome is Outcome.FAILED
    assert "it is rank 0 (stage 0 of 2, TP rank 0 of 1), the params name rank 1 of tp_size 1 x pp_size 2" in reason


def test_without_stages_layers_still_pair_by_position_and_must_be_equal() -> None:
    local = d_local()
    one = stage_registration(LAYERS, 0, 1)
    assert plane_pairs(local, one) == ((0, 0), (1, 1), (2, 2), (3, 3))
    assert coverage_problem(local, [(0, LAYERS)]) == ""


def test_the_rank_table_of_a_staged_engine_lists_every_stage() -> None:
    remote = plan(pp_size=2, tp_size=2).remote
    table = table_of("P", "", {r: (f"10.0.0.{1 + r // 2}", 14600 + r) for r in range(4)})
    good = RemotePrefill("P", "p-req", "10.0.0.1", 14600, [[1, 2]], "hold", 32, BS, tp_size=2, pp_size=2)
    assert table_problem(table, good, ANY_PORT) == ""
    assert "the params name 4 (tp_size 2 x pp_size 2)" in table_problem(table_of("P", "", {0: ("10.0.0.1", 14600),
                                                                                         1: ("10.0.0.1", 14601)}),
                                                                       good, ANY_PORT)
    assert entry_only(remote) is None and entry_only(plan(pp_size=1).remote) is not None


@pytest.mark.parametrize(("change", "message"), [
    ({"plane_layers": [0, 9]}, "registration puts a plane in no layer"),
    ({"plane_layers": [0, -1]}, "registration puts a plane in no layer"),
    ({"plane_layers": [0] * 100_000}, "gives 100000 plane layers for 2 planes"),
    ({"layer_names": ["l2"] * 100_000}, "registration names a layer twice"),
    ({"block_shapes": []}, "describes 2 KV planes with 0 block shapes"),
    ({"pp_rank": 7}, "it is rank 7 (stage 7 of 2"),
    ({"pp_size": 1 << 40}, "the params name rank 1 of tp_size 1 x pp_size 2"),
])
def test_a_hostile_stage_registration_gets_a_bounded_refusal(change: dict, message: str) -> None:
    """Whatever a peer puts in the stage fields of its registration, the pull fails naming it (never an index
    error in the state machine), and the message stays short."""
    import msgspec

    stage1 = msgspec.structs.replace(stage_registration(LAYERS[2:], 1, 2), **change)
    registrations = {0: stage_registration(LAYERS[:2], 0, 2), 1: stage1}
    job = ConsumerPull(plan(), sources_of(rank_plan(Layout(1, 2), Layout(1, 2), 0), 1, 2, 1), "D:0", d_local(),
                       claim_wait=1.0, max_batch_entries=64, now=0.0)
    outcome, reason, _ = run(job, registrations)
    assert outcome is Outcome.FAILED and message in reason and len(reason) <= 1010, reason
