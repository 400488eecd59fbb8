"""n-gram speculative decoding (prompt lookup) on P and D, through the proxy, on real engines.

The n-gram drafter reads token ids only (the prompt D was sent and what D generated), so the connector moves the
same layers as without it. What must hold: D drafts, verifies and answers as a single instance with the same
speculative config does, and vLLM's first-step padding of a request whose prompt arrived by transfer costs no
accepted draft.
"""

from __future__ import annotations

import random

import pytest

from tests.e2e.helpers import (
    BLOCK_SIZE,
    BYTES_PER_BLOCK,
    LOGPROB_TOL,
    max_logprob_gap,
    prompt_ids,
    tokens_and_logprobs,
    wait_kv_idle,
)
from tests.e2e_spec.helpers import Drafts, direct, single, through_proxy
from vllm_kvp2p.connector.scheduler import PULL_REPORT_KEY
from vllm_kvp2p.testing.cluster import PDCluster

pytestmark = pytest.mark.e2e

MAX_TOKENS = 32


def _one_token(n: int, seed: int) -> list[int]:
    """One token repeated: the tiny model falls into loops on these, which the drafter then finds (on random
    prompts it drafts almost nothing: measured 0-2 drafts per 32 tokens)."""
    return [random.Random(seed).randrange(4, 512)] * n


# Two that draft a lot (measured on a single instance: 11 and 8 drafts, 20 and 13 accepted) and a random one
# (few drafts, every position different).
PROMPTS = [_one_token(90, 1), _one_token(40, 4), prompt_ids(96, seed=3)]  # 96: whole blocks


def test_d_with_ngram_speculation_answers_as_the_single_instance(ngram_cluster: PDCluster) -> None:
    ours, theirs = Drafts(0, 0), Drafts(0, 0)
    for prompt in PROMPTS:
        pd, d_drafts = through_proxy(ngram_cluster, prompt, MAX_TOKENS)
        alone, s_drafts = single(ngram_cluster, prompt, MAX_TOKENS)
        assert max_logprob_gap(pd, alone) <= LOGPROB_TOL, (tokens_and_logprobs(pd), tokens_and_logprobs(alone))
        pull = pd["kv_transfer_params"][PULL_REPORT_KEY]
        blocks = -(-len(prompt) // BLOCK_SIZE)
        assert pull["ok"] and pull["blocks"] == blocks and pull["bytes"] == blocks * BYTES_PER_BLOCK, pull
        ours = Drafts(ours.proposed + d_drafts.proposed, ours.accepted + d_drafts.accepted)
        theirs = Drafts(theirs.proposed + s_drafts.proposed, theirs.accepted + s_drafts.accepted)
    assert theirs.accepted >= 20, (ours, theirs)  # speculation ran and drafts landed: the check has room
    assert ours.accepted == theirs.accepted, (ours, theirs)


def test_a_corrupted_transfer_changes_the_answer(ngram_cluster: PDCluster) -> None:
    prompt = prompt_ids(100, seed=4)  # not one D has cached: all of it is pulled
    out, _ = direct(ngram_cluster, prompt, MAX_TOKENS, kvp2p_test_corrupt=True)
    reference, _ = single(ngram_cluster, prompt, MAX_TOKENS)
    assert max_logprob_gap(out, reference) > 10 * LOGPROB_TOL


def test_both_engines_end_idle(ngram_cluster: PDCluster) -> None:
    """Every hold P made for this module's pulls was released, and D keeps no block of a finished request."""
    assert wait_kv_idle(ngram_cluster.prefill, timeout=60) == 0.0, ngram_cluster.prefill.log_path
    assert wait_kv_idle(ngram_cluster.decode, timeout=30) == 0.0, ngram_cluster.decode.log_path
