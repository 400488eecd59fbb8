"""The negative side of the coverage property (test_coverage_property.py): params whose block list is cut (fewer
ids than the coverage rule requires, while ``remote_num_tokens`` still claims the prompt) are refused by the
verdict and never read; under the rule before the exact-coverage check (``len(ids) <= prompt_blocks``, copied
below) such params gave pulls that report success with told tokens not read (two hand-made cases, and one
hypothesis finds among the generated ones).
"""

from __future__ import annotations

import random
from unittest import mock

import pytest
from hypothesis import HealthCheck, Phase, assume, find, given, settings
from hypothesis import strategies as st

from tests.unit.coverage_model import holes, run
from tests.unit.coverage_scenarios import NUM_BLOCKS, Scenario, scenarios
from vllm_kvp2p.contract.protocol import RemotePrefill
from vllm_kvp2p.lifecycle import admission
from vllm_kvp2p.lifecycle.admission import Admitted, Decoder, Prompt, Refused, judge
from vllm_kvp2p.lifecycle.pull import Outcome
from vllm_kvp2p.transfer.kv_groups import FULL, NULL_BLOCK_ID, SLIDING, needed_count, prompt_blocks
from vllm_kvp2p.transfer.tp_mapping import rank_plan


@st.composite
def cut_scenarios(draw: st.DrawFn) -> tuple[Scenario, list[list[int]]]:
    """P's params with one group's list cut (fewer ids than the coverage rule requires), remote_num_tokens
    unchanged: from its front or its end."""
    sc = draw(scenarios())
    offered = sc.offered
    cuttable = [g for g, ids in enumerate(offered) if ids]  # a window of one token may offer no block
    assume(cuttable)
    g = draw(st.sampled_from(cuttable))
    cut = draw(st.integers(1, len(offered[g])))
    ids = offered[g]
    offered[g] = ids[cut:] if draw(st.booleans()) else ids[:len(ids) - cut]
    return sc, offered


def old_at_most_rule(remote_: RemotePrefill, prompt_: Prompt, decoder: Decoder) -> str:
    """``admission._content_problem`` with the coverage rule it replaced
    (vllm_kvp2p/contract/protocol.py before 7a2381c,
    ``RemotePrefill.problem``): a group may offer *at most* the prompt's blocks."""
    n = remote_.remote_num_tokens
    if n > prompt_.num_tokens:
        return f"remote_num_tokens {n} outside 1..{prompt_.num_tokens} (the prompt)"
    if remote_.remote_prompt_digest != prompt_.digest(n):
        return "remote_prompt_digest does not match"
    offered, p_bs, d_bs = remote_.remote_block_ids, remote_.remote_block_size, decoder.block_size
    if len(offered) != len(decoder.groups):
        return "KV-cache groups differ"
    if decoder.single_full_group:
        if p_bs % d_bs and d_bs % p_bs:
            return "block sizes incompatible"
    elif p_bs != d_bs:
        return "hybrid models need one block size"
    elif n > prompt_.num_tokens - decoder.holdback:
        return "models with a linear-attention state pull all but the prompt's last token"
    most = prompt_blocks(n, p_bs)
    for i, ids in enumerate(offered):
        if len(ids) > most:
            return f"remote_block_ids[{i}] has {len(ids)} blocks; {n} tokens fill at most {most}"
        if NULL_BLOCK_ID in ids or len(set(ids)) != len(ids):
            return f"remote_block_ids[{i}] repeats a block id or names the null block"
    return ""


@settings(max_examples=100, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cut_scenarios())
def test_cut_block_lists_are_refused_and_never_read(case: tuple[Scenario, list[list[int]]]) -> None:
    sc, offered = case
    params = sc.params(offered)
    verdict = judge(params, sc.prompt, Decoder(sc.d_bs, sc.d_groups))
    assert isinstance(verdict, Refused) and "need exactly" in verdict.reason and verdict.contact_p
    r = run(sc, params)
    assert r.plan is not None and r.plan.error and r.plan.remote_block_ids == ()
    assert not r.reads, "a refused plan must read nothing"
    assert r.result is not None and not r.told_loaded
    if r.external > 0:  # vLLM waits for it: the failure is reported, so it does not count the tokens as loaded
        assert r.result.outcome is Outcome.FAILED and r.result.report_failed
    mapping = rank_plan(sc.layout(sc.p_tp), sc.layout(sc.d_tp), sc.d_rank)
    assert sorted(r.released) == sorted(mapping.p_ranks)  # P is still released (its address is valid)


def reads_miss_told_tokens(case: tuple[Scenario, list[list[int]]]) -> bool:
    """Under the old rule: the pull reports success, and told tokens were not read."""
    sc, offered = case
    with mock.patch.object(admission, "_content_problem", old_at_most_rule):
        r = run(sc, sc.params(offered))
    return r.told_loaded and bool(holes(sc, r))


HOLE_CASES = {
    # Full attention + a sliding window of 8, blocks of 4, a 24-token prompt, D caches the first 8 tokens. P's
    # full-attention list loses its last id: the old rule (at most 6 ids) admits it, vLLM is told 16 tokens are
    # loaded, and the tail pairing fills D's blocks from P blocks one block early (position 8 gets position 4).
    "hybrid, list cut at its end": (
        Scenario("full+sliding", (0, 8), 4, 4, 1, 1, 2, False, "cpu", "element-major", "rows", 1, 24, 8, 0,
                 (FULL, SLIDING), (tuple(range(1, 7)), (0, 0, 0, 10, 11, 12)), tuple(range(1, NUM_BLOCKS)),
                 max_batch=4096, seed=0),
        [[1, 2, 3, 4, 5], [10, 11, 12]], 16, "position 8 "),
    # One full group, blocks of 4, a 5-token prompt; vLLM takes only the whole block it is offered (4 tokens).
    # P's list loses its first id: 1 block of 4 covers the 4 tokens loaded, so the plan's length check passes,
    # and positions 0..3 are filled with P's positions 4..7.
    "one group, list cut at its front": (
        Scenario("full", (0,), 4, 4, 1, 1, 1, True, "mla", "rows", "rows", 1, 5, 0, 0, (FULL,), ((1, 2),),
                 tuple(range(1, NUM_BLOCKS)), max_batch=4096, seed=0, vllm_trims=True),
        [[2]], 4, "position 0 "),
}


@pytest.mark.parametrize("name", list(HOLE_CASES))
def test_without_exact_coverage_a_cut_list_leaves_told_tokens_unread(name: str) -> None:
    sc, cut, told, first_hole = HOLE_CASES[name]
    assert judge(sc.params(), sc.prompt, Decoder(sc.d_bs, sc.d_groups)) == Admitted(
        RemotePrefill.from_params(sc.params()), sc.p_tokens)
    assert isinstance(judge(sc.params(cut), sc.prompt, Decoder(sc.d_bs, sc.d_groups)), Refused)  # today: refused
    with mock.patch.object(admission, "_content_problem", old_at_most_rule):
        r = run(sc, sc.params(cut))
    assert r.external == told and r.told_loaded and r.result is not None and r.result.outcome is Outcome.PULLED
    found = holes(sc, r)
    assert found and first_hole in found[0], found
    good = run(sc)  # the same params uncut fill every told byte
    assert good.external == told and good.told_loaded and not holes(sc, good)


def test_without_exact_coverage_the_generator_finds_unread_told_tokens() -> None:
    """The cut lists the property above refuses: under the old rule, some pull reports success with told tokens
    unread (hypothesis finds one among the generated cases)."""
    case = find(cut_scenarios(), reads_miss_told_tokens, random=random.Random(0),
                settings=settings(max_examples=500, deadline=None, database=None, phases=[Phase.generate],
                                  suppress_health_check=[HealthCheck.too_slow]))  # any one will do: no shrinking
    sc, offered = case
    assert any(len(ids) < needed_count(g, sc.p_tokens) for ids, g in zip(offered, sc.p_groups))
