"""KV-cache groups (vLLM's hybrid allocator) in the pure core: which blocks of each group P offers and D pulls,
how the two lists pair, and what a mismatch gives. No I/O."""

from __future__ import annotations

import msgspec
import pytest

from tests.support.prompts import prompt, remote
from vllm_kvp2p.contract.protocol import RankRegistration, RemotePrefill
from vllm_kvp2p.lifecycle.consumer import ConsumerSchedule, PullPlan
from vllm_kvp2p.lifecycle.pull import ConsumerPull, FetchRegistration, LocalKV, Source
from vllm_kvp2p.lifecycle.read_plan import read_descriptors
from vllm_kvp2p.lifecycle.stages import plane_pairs
from vllm_kvp2p.transfer.descriptors import PlaneGeometry
from vllm_kvp2p.transfer.kv_groups import FULL, SLIDING, STATE, KVGroup, has_state, load_failure_problem, needed_tail
from vllm_kvp2p.transfer.slicing import BlockShape
from vllm_kvp2p.transfer.tp_mapping import HeadSlice

BS = 16
FULL_G = KVGroup(FULL, BS)
SLIDING_G = KVGroup(SLIDING, BS, sliding_window=40)  # at most cdiv(40, 16) + 1 = 4 blocks
STATE_G = KVGroup(STATE, BS)


def test_blocks_a_decoder_needs_per_group() -> None:
    ids = list(range(1, 11))  # a 150-token prompt has 10 blocks; vLLM may list more (lookahead)
    assert needed_tail(FULL_G, ids + [99], 150) == ids
    assert needed_tail(SLIDING_G, [0] * 6 + ids[6:] + [99], 150) == ids[6:]  # the window, never a null block
    assert needed_tail(SLIDING_G, ids[:2], 20) == ids[:2]  # a prompt inside the window: all of it
    assert needed_tail(STATE_G, [0, 0, 7, 0], 60) == [7]  # the running state: the one real block
    assert (FULL_G.max_blocks, SLIDING_G.max_blocks, STATE_G.max_blocks) == (None, 4, 1)
    assert has_state((FULL_G, STATE_G)) and not has_state((FULL_G, SLIDING_G))


@pytest.mark.parametrize(("groups", "loads", "reports_requests", "refused"), [
    (2, True, False, True),  # D on vLLM 0.23 with the hybrid allocator: one failed pull would stop the engine
    (3, True, False, True),
    (1, True, False, False),  # one group: vLLM maps failed block ids back to requests
    (2, False, False, False),  # P never loads
    (2, True, True, False),  # vLLM 0.32 takes failed requests
])
def test_a_decoder_that_could_not_survive_a_failed_pull_is_refused(groups: int, loads: bool,
                                                                   reports_requests: bool, refused: bool) -> None:
    problem = load_failure_problem(groups, loads, reports_requests)
    assert (problem is not None) == refused
    if problem:
        assert "--disable-hybrid-kv-cache-manager" in problem and f"{groups} KV-cache groups" in problem


def hybrid_params(lists: list[list[int]], num_tokens: int, block_size: int = BS) -> dict:
    return remote(lists, num_tokens, block_size).to_params()


def test_sliding_group_pairs_the_tails_of_both_lists() -> None:
    s = ConsumerSchedule(BS, (FULL_G, SLIDING_G))
    params = hybrid_params([list(range(100, 110)), [106, 107, 108, 109]], 150)
    # D: 10 full blocks; its sliding group got 4 in-window blocks (vLLM nulls the older ones).
    plan = s.on_alloc("d1", params, 150, [list(range(1, 11)), [21, 22, 23, 24]], 0, prompt(150))
    assert plan is not None and plan.error == ""
    assert plan.local_block_ids == (tuple(range(1, 11)), (21, 22, 23, 24))
    assert plan.remote_block_ids == (tuple(range(100, 110)), (106, 107, 108, 109))
    assert plan.num_blocks == 14


def test_local_prefix_hit_pulls_the_rest_of_each_group() -> None:
    s = ConsumerSchedule(BS, (FULL_G, SLIDING_G))
    params = hybrid_params([list(range(100, 110)), [106, 107, 108, 109]], 150)
    plan = s.on_alloc("d1", params, 86, [[5, 6, 7, 8], [31, 32]], 64, prompt(150))  # 4 blocks cached locally
    assert plan is not None and plan.error == ""
    assert plan.remote_block_ids == ((106, 107, 108, 109), (108, 109))


@pytest.mark.parametrize(("lists", "tokens", "block_size", "message"), [
    ([[1, 2]], 20, BS, "KV-cache groups differ: P sent 1, D has 2"),
    ([[1], [2]], 20, 32, "hybrid models need one block size: P uses 32, D 16"),
    ([[1, 2], [2]], 30, BS, "remote_num_tokens 30 outside 1..20 (the prompt)"),
    ([[1, 2], []], 20, BS, "remote_block_ids[1] has 0 blocks; 20 tokens in blocks of 16 need exactly 2 (sliding"),
    ([[1, 2], [2]], 20, BS, "remote_block_ids[1] has 1 blocks; 20 tokens in blocks of 16 need exactly 2"),
    ([[1, 2, 3], [2, 3]], 20, BS, "remote_block_ids[0] has 3 blocks; 20 tokens in blocks of 16 need exactly 2"),
    ([[1, 1], [2, 3]], 20, BS, "remote_block_ids[0] repeats a block id or names block 0"),
    ([[0, 1], [2, 3]], 20, BS, "remote_block_ids[0] repeats a block id or names block 0"),
])
def test_hybrid_plans_that_cannot_work_fail_with_a_reason(lists: list[list[int]], tokens: int, block_size: int,
                                                          message: str) -> None:
    s = ConsumerSchedule(BS, (FULL_G, SLIDING_G))
    plan = s.on_alloc("d1", hybrid_params(lists, tokens, block_size), 20, [[5, 6], [5, 6]], 0, prompt(20))
    assert plan is not None and plan.awaiting and message in plan.error


def test_a_state_model_loads_all_but_the_last_prompt_token() -> None:
    s = ConsumerSchedule(BS, (STATE_G, FULL_G))
    params = hybrid_params([[7], [1, 2, 3, 4]], 59)  # P prefilled 59 of the 60 prompt tokens
    assert s.matched_tokens("d1", params, prompt(60), 0) == (59, True)
    # A P that did not hold the last token back (60 computed): D still loads 59, and the plan refuses the
    # mismatch rather than apply the last token to the state twice.
    stale = hybrid_params([[7], [1, 2, 3, 4]], 60)
    assert s.matched_tokens("d2", stale, prompt(60), 0) == (59, True)
    plan = s.on_alloc("d2", stale, 59, [[9], [11, 12, 13, 14]], 0, prompt(60))
    assert plan is not None and "P computed 60 tokens, D loads 59" in plan.error
    plan = s.on_alloc("d1", params, 59, [[9], [11, 12, 13, 14]], 0, prompt(60))
    assert plan is not None and plan.error == "" and plan.local_block_ids == ((9,), (11, 12, 13, 14))
    assert plan.remote_block_ids == ((7,), (1, 2, 3, 4))
    assert s.matched_tokens("d3", hybrid_params([[7], [1]], 1), prompt(1), 0) == (0, False)  # nothing to load


# ----------------------------------------------------------------------------- pull

SHAPE = BlockShape(True, 2, BS, 16)  # 512-byte attention blocks
STATE_SHAPE = BlockShape(False, 1, 1, 4096)  # a whole state page


def local_kv(base: int, groups: tuple[KVGroup, ...], tp_size: int = 1) -> LocalKV:
    planes = (PlaneGeometry(base, 512, 512, 100), PlaneGeometry(base + 1_000_000, 8192, 4096, 100))
    return LocalKV(planes, (SHAPE, STATE_SHAPE), BS, ("attn", "linear"), "bfloat16", 2, groups=groups,
                   plane_groups=(0, 1), tp_size=tp_size)


def registration_of(local: LocalKV, tp_size: int = 1) -> RankRegistration:
    return RankRegistration("P", 0, tp_size, "127.0.0.1:15000", list(local.planes), list(local.shapes),
                            list(local.layer_names), BS, 100, local.dtype, 2, 2, 8, groups=list(local.groups),
                            plane_groups=list(local.plane_groups))


def state_plan(p_tp_size: int = 1) -> PullPlan:
    remote = RemotePrefill.from_params({**hybrid_params([[1, 2], [5]], 20), "tp_size": p_tp_size})
    return PullPlan("d1", remote, ((3, 4), (9,)), ((1, 2), (5,)), awaiting=True)


def started_pull(local: LocalKV, p_tp_size: int = 1) -> ConsumerPull:
    job = ConsumerPull(state_plan(p_tp_size), [Source(0, 1, (HeadSlice(0, 0, 0, 2),))], "d:0", local, claim_wait=1.0,
                       max_batch_entries=1024, now=0.0)
    assert isinstance(job.next_action(0), FetchRegistration)
    return job


def test_each_group_reads_its_own_planes_with_its_own_block_ids() -> None:
    local = local_kv(1 << 20, (FULL_G, STATE_G))
    p = registration_of(local_kv(1 << 30, (FULL_G, STATE_G)))
    source = Source(0, 1, (HeadSlice(0, 0, 0, 2),))
    descriptors = read_descriptors(state_plan(1), local, source, p, plane_pairs(local, p))
    pairs = sorted(zip(descriptors.local_addrs, descriptors.remote_addrs, descriptors.lengths))
    attn_l, attn_r, state_l, state_r = (1 << 20), (1 << 30), (1 << 20) + 1_000_000, (1 << 30) + 1_000_000
    # attention blocks 3, 4 <- 1, 2 (adjacent on both sides: one run); state page 9 <- 5, whole (4096 bytes).
    assert pairs == [(attn_l + 3 * 512, attn_r + 1 * 512, 1024), (state_l + 9 * 8192, state_r + 5 * 8192, 4096)]


@pytest.mark.parametrize(("change", "message"), [
    ({"groups": [FULL_G, SLIDING_G]}, "KV-cache groups: P has [full attention, sliding window 40], D has "
                                      "[full attention, linear-attention state]"),
    ({"tp_size": 2}, "tensor parallel size: P 2, D 1; models with a linear-attention state need the same"),
])
def test_registration_of_another_group_layout_is_refused(change: dict, message: str) -> None:
    local = local_kv(1 << 20, (FULL_G, STATE_G))
    job = started_pull(local, p_tp_size=change.get("tp_size", 1))
    p = msgspec.structs.replace(registration_of(local_kv(1 << 30, (FULL_G, STATE_G))), **change)
    job.on_registration(Source(0, 1, (HeadSlice(0, 0, 0, 2),)), p)
    job.on_release_sent(Source(0, 1, (HeadSlice(0, 0, 0, 2),)))
    result = job.next_action(0).result
    assert result.report_failed and message in result.reason
