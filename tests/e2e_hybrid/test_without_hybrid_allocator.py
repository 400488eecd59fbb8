"""The sliding-window model of this package with vLLM's hybrid allocator turned off on P and D
(``--disable-hybrid-kv-cache-manager``): vLLM then keeps every block of every layer in one group, the connector
moves all of them (the bytes the window saves with the allocator on, measured), and answers still equal the
single instance."""

from __future__ import annotations

import math

from tests.e2e.helpers import BLOCK_SIZE, LOGPROB_TOL, baseline, max_logprob_gap, prefill_then_decode, prompt_ids
from tests.e2e_hybrid.conftest import LAYER_TYPES
from tests.e2e_hybrid.test_sliding_window_end_to_end import LAYER_BLOCK_BYTES, expected_bytes
from vllm_kvp2p.connector.scheduler import PULL_REPORT_KEY
from vllm_kvp2p.testing.cluster import PDCluster


def test_one_group_moves_every_block_and_answers_equal_the_single_instance(no_hma_cluster: PDCluster) -> None:
    log = no_hma_cluster.decode.log_path.read_text()
    assert "in 1 KV-cache group(s) (full attention)" in log
    num_tokens = 420
    prompt = prompt_ids(num_tokens, seed=9000 + num_tokens)
    out = prefill_then_decode(no_hma_cluster, prompt)
    pull = out["kv_transfer_params"][PULL_REPORT_KEY]
    windowed, unwindowed = expected_bytes(num_tokens)
    assert pull["ok"] and pull["bytes"] == unwindowed == len(LAYER_TYPES) * math.ceil(num_tokens / BLOCK_SIZE) * \
        LAYER_BLOCK_BYTES, pull
    assert windowed < unwindowed
    assert max_logprob_gap(out, baseline(no_hma_cluster, prompt)) <= LOGPROB_TOL
