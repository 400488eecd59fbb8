"""DeepSeek MTP (multi-token prediction) through P/D on real engines (vLLM 0.32's ``deepseek_mtp`` on CPU).

The MTP layer is an attention layer with a KV cache of its own. P's prefill fills it for the prompt; D pulls it
with the model's layers, and its drafter then attends to the prompt exactly as a single instance's does. Answers
alone cannot show that: with greedy sampling a draft only decides how many tokens a step yields, never which, so
a D that drafted from garbage (the "dirty KV blocks" of P/D with MTP elsewhere) answers the same, just slower.
What shows it is the number of drafts the model accepted: equal to the single instance's for the same prompts,
and visibly lower when D's copy of the MTP layer is overwritten after the pull, as the last test shows.
"""

from __future__ import annotations

import pytest

from tests.e2e.helpers import LOGPROB_TOL, max_logprob_gap, tokens_and_logprobs, wait_kv_idle
from tests.e2e_spec.helpers import Drafts, direct, single, through_proxy
from vllm_kvp2p.connector.scheduler import PULL_REPORT_KEY
from vllm_kvp2p.testing.cluster import PDCluster
from vllm_kvp2p.testing.tiny_deepseek import MLA_BLOCK_SIZE

pytestmark = pytest.mark.e2e

LATENT, FLOAT32 = 512 + 64, 4
MODEL_LAYER, MTP_LAYER = "model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"
LENGTHS = (40, 90, 128)  # 128: whole blocks, so P allocated one more for the draft token
MAX_TOKENS = 24
#: Drafts each request must carry, on D and on the single instance: with one speculative token every decode step
#: proposes one, MAX_TOKENS // 2 steps when every draft lands, more when not (measured: 11 to 12 per request). A
#: drafter silently off would pass every other check here with 0 == 0.
MIN_DRAFTS = MAX_TOKENS // 2 - 2


def _prompt(n: int) -> list[int]:
    return list(range(300, 300 + n))


def test_d_pulls_the_mtp_layer_and_drafts_and_answers_as_the_single_instance(mtp_cluster: PDCluster) -> None:
    ours, theirs = Drafts(0, 0), Drafts(0, 0)
    for n in LENGTHS:
        pd, d_drafts = through_proxy(mtp_cluster, _prompt(n), MAX_TOKENS)
        alone, s_drafts = single(mtp_cluster, _prompt(n), MAX_TOKENS)
        assert max_logprob_gap(pd, alone) <= LOGPROB_TOL, (tokens_and_logprobs(pd), tokens_and_logprobs(alone))
        pull = pd["kv_transfer_params"][PULL_REPORT_KEY]
        blocks = -(-n // MLA_BLOCK_SIZE)
        # Two layers' latent rows: the model's and the MTP layer's, every block of each, each one verified.
        assert pull["ok"] and pull["blocks"] == blocks, pull
        assert pull["bytes"] == 2 * blocks * MLA_BLOCK_SIZE * LATENT * FLOAT32, pull
        assert pull["verified"] == 2 * blocks, pull
        # vLLM pads a request's first step on D (one token to compute, the prompt already there) with a
        # placeholder draft, always rejected: at most one more proposal than the single instance, never more.
        assert s_drafts.proposed <= d_drafts.proposed <= s_drafts.proposed + 1, (n, d_drafts, s_drafts)
        assert s_drafts.proposed >= MIN_DRAFTS and s_drafts.accepted >= 1, (n, s_drafts)  # speculation ran
        ours, theirs = Drafts(ours.proposed + d_drafts.proposed, ours.accepted + d_drafts.accepted), \
            Drafts(theirs.proposed + s_drafts.proposed, theirs.accepted + s_drafts.accepted)
    assert theirs.accepted >= 0.8 * theirs.proposed  # the tiny MTP layer predicts well: the check has room
    assert ours.accepted == theirs.accepted >= len(LENGTHS) * MIN_DRAFTS * 0.8, (ours, theirs)


def test_an_mtp_layer_not_the_prompts_shows_in_accepted_drafts_not_in_answers(mtp_cluster: PDCluster) -> None:
    """What a D decoding from an MTP KV cache that is not P's would look like: the same answers, fewer accepted
    drafts. D overwrites its copy of the MTP layer with noise right after the pull (test hook)."""
    corrupted, alone = Drafts(0, 0), Drafts(0, 0)
    for n in LENGTHS:
        out, drafts = direct(mtp_cluster, _prompt(n), MAX_TOKENS, kvp2p_test_corrupt=f"layer:{MTP_LAYER}")
        reference, s_drafts = single(mtp_cluster, _prompt(n), MAX_TOKENS)
        assert max_logprob_gap(out, reference) <= LOGPROB_TOL  # the model's own layer is intact
        assert drafts.proposed >= MIN_DRAFTS and s_drafts.proposed >= MIN_DRAFTS, (n, drafts, s_drafts)  # both drafted
        corrupted = Drafts(corrupted.proposed + drafts.proposed, corrupted.accepted + drafts.accepted)
        alone = Drafts(alone.proposed + s_drafts.proposed, alone.accepted + s_drafts.accepted)
    assert corrupted.accepted < alone.accepted / 2, (corrupted, alone)  # measured: 1 of 71 against 35 of 36


def test_a_corrupted_model_layer_changes_the_answer(mtp_cluster: PDCluster) -> None:
    out, _ = direct(mtp_cluster, _prompt(90), MAX_TOKENS, kvp2p_test_corrupt=f"layer:{MODEL_LAYER}")
    reference, _ = single(mtp_cluster, _prompt(90), MAX_TOKENS)
    assert max_logprob_gap(out, reference) > 10 * LOGPROB_TOL


def test_both_engines_end_idle(mtp_cluster: PDCluster) -> None:
    """Every hold P made for this module's pulls was released, and D keeps no block of a finished request."""
    assert wait_kv_idle(mtp_cluster.prefill, timeout=60) == 0.0, mtp_cluster.prefill.log_path
    assert wait_kv_idle(mtp_cluster.decode, timeout=30) == 0.0, mtp_cluster.decode.log_path
