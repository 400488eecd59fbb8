"""The rule "D never tells vLLM it loads a token whose bytes it did not read", checked end to end in the pure core.

For generated P/D pairs (tests/unit/coverage_scenarios.py) run through D's two halves on a memory model of both
sides (tests/unit/coverage_model.py): when the pull reports a finished receive that did not fail, every byte of
every head this D rank holds, for every told position (``[num_local_computed, num_local_computed + count)``) in
every group that keeps it (full: all; sliding window: the positions in the window's blocks vLLM gave; state: the
state page), must hold that same (plane, position, head, part, element, byte) of P, and nothing outside the plan's
blocks of D is written. P's own params are admitted, and between compatible kernels they pull.

The negative side, block lists cut short: test_coverage_cut_lists.py.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings

from tests.unit.coverage_model import holes, interiors_match, run, stray_writes
from tests.unit.coverage_scenarios import Scenario, scenarios
from vllm_kvp2p.lifecycle.admission import Admitted, Decoder, judge
from vllm_kvp2p.lifecycle.pull import Outcome
from vllm_kvp2p.transfer.kv_groups import FULL


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenarios())
def test_every_token_vllm_is_told_is_loaded_was_read_from_p(sc: Scenario) -> None:
    decoder = Decoder(sc.d_bs, sc.d_groups)
    assert isinstance(judge(sc.params(), sc.prompt, decoder), Admitted), "P's own params must be admitted"
    r = run(sc)
    assert r.plan is not None
    assert r.external <= r.matched
    if r.external == 0:
        assert not r.plan.awaiting and r.plan.num_blocks == 0 and not r.reads
        return
    assert r.plan.awaiting and r.result is not None
    for g, ids in enumerate(r.plan.local_block_ids):  # never one of D's own prefix-cache blocks
        assert set(ids) <= {b for _, b in r.allocation[g]}
    if r.told_loaded:
        found = holes(sc, r, limit=3)
        assert not found, "vLLM is told these bytes are loaded, the pull did not read them:\n" + "\n".join(found)
    else:
        assert r.result.report_failed  # vLLM is told the load failed (its kv_load_failure_policy decides)
    assert not stray_writes(r)
    # Not vacuous: P's own params between compatible kernels pull (vLLM passing fewer tokens than matched is
    # refused for hybrid models, which pull whole prompts). A model of sliding windows of 1 token may get no block
    # for the tokens it loads: the load is then complete with nothing to read (P released, nothing failed).
    whole = r.external == r.matched or len(sc.group_kinds) == 1 and sc.group_kinds[0] == FULL
    if interiors_match(sc) and whole:
        expected = Outcome.PULLED if any(r.allocation) else Outcome.NOTHING_TO_PULL
        assert r.result.outcome is expected, (r.plan.error, r.result.reason)
