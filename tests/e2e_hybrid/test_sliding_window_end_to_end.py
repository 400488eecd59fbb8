"""Mixed sliding-window and full-attention layers through real P and D engines with vLLM's hybrid allocator on.

Each full-attention layer moves every block of the prompt; each sliding-window layer only the blocks inside its
window (at most ``cdiv(window, block_size) + 1``), so the bytes per pull are known exactly. D's answers equal the
single instance's, a corrupted transfer changes them, and both engines are idle afterwards.
"""

from __future__ import annotations

import math

import pytest

from tests.e2e.helpers import (
    BLOCK_SIZE,
    HEAD_SIZE,
    KV_HEADS,
    LOGPROB_TOL,
    baseline,
    completion_body,
    max_logprob_gap,
    post,
    prefill_then_decode,
    prompt_ids,
    wait_kv_idle,
)
from tests.e2e_hybrid.conftest import LAYER_TYPES, WINDOW
from vllm_kvp2p.connector.scheduler import PULL_REPORT_KEY
from vllm_kvp2p.testing.cluster import PDCluster

LAYER_BLOCK_BYTES = KV_HEADS * BLOCK_SIZE * 2 * HEAD_SIZE * 4  # K and V of one layer's block, float32
MAX_WINDOW_BLOCKS = math.ceil(WINDOW / BLOCK_SIZE) + 1
NUM_FULL = LAYER_TYPES.count("full_attention")
NUM_SLIDING = LAYER_TYPES.count("sliding_attention")


def expected_bytes(num_tokens: int) -> tuple[int, int]:
    """(bytes this connector moves with the window, bytes for the same model with the window removed)."""
    blocks = math.ceil(num_tokens / BLOCK_SIZE)
    windowed = (NUM_FULL * blocks + NUM_SLIDING * min(blocks, MAX_WINDOW_BLOCKS)) * LAYER_BLOCK_BYTES
    return windowed, len(LAYER_TYPES) * blocks * LAYER_BLOCK_BYTES


def test_both_engines_run_the_hybrid_allocator_with_two_groups(hybrid_cluster: PDCluster) -> None:
    for server in (hybrid_cluster.prefill, hybrid_cluster.decode):
        log = server.log_path.read_text()
        assert "Turning off hybrid kv cache manager" not in log, server.log_path
        assert "in 2 KV-cache group(s) (full attention, sliding window 64)" in log or \
            "in 2 KV-cache group(s) (sliding window 64, full attention)" in log, server.log_path


@pytest.mark.parametrize("num_tokens", [40, 150, 420], ids=["inside-window", "beyond-window", "far-beyond"])
def test_pd_answer_equals_single_instance_and_moves_only_the_window(hybrid_cluster: PDCluster,
                                                                    num_tokens: int) -> None:
    prompt = prompt_ids(num_tokens, seed=9000 + num_tokens)
    out = prefill_then_decode(hybrid_cluster, prompt)
    pull = out["kv_transfer_params"][PULL_REPORT_KEY]
    windowed, unwindowed = expected_bytes(num_tokens)
    assert pull["ok"], pull
    assert pull["bytes"] == windowed, (pull, windowed, unwindowed)
    assert pull["verified"] == windowed // LAYER_BLOCK_BYTES and "unverified" not in pull  # every block-layer
    if num_tokens > WINDOW + BLOCK_SIZE:
        assert pull["bytes"] < unwindowed
    assert max_logprob_gap(out, baseline(hybrid_cluster, prompt)) <= LOGPROB_TOL


def test_a_corrupted_transfer_changes_the_answer(hybrid_cluster: PDCluster) -> None:
    prompt = prompt_ids(150, seed=4343)
    corrupted = prefill_then_decode(hybrid_cluster, prompt, kvp2p_test_corrupt=True)
    assert corrupted["kv_transfer_params"][PULL_REPORT_KEY]["ok"]
    assert max_logprob_gap(corrupted, baseline(hybrid_cluster, prompt)) > 100 * LOGPROB_TOL


def test_a_byte_changed_in_flight_is_caught_and_d_recomputes_the_right_answer(hybrid_cluster: PDCluster) -> None:
    prompt = prompt_ids(150, seed=4344)
    out = prefill_then_decode(hybrid_cluster, prompt, kvp2p_test_corrupt="in_flight")
    pull = out["kv_transfer_params"][PULL_REPORT_KEY]
    assert not pull["ok"] and pull["failure"] == "corrupted", pull
    assert max_logprob_gap(out, baseline(hybrid_cluster, prompt)) <= LOGPROB_TOL


def test_through_the_proxy_and_engines_idle_afterwards(hybrid_cluster: PDCluster) -> None:
    prompt = prompt_ids(200, seed=77)
    via_proxy = post(hybrid_cluster.proxy_url + "/v1/completions", completion_body(prompt))
    assert max_logprob_gap(via_proxy, baseline(hybrid_cluster, prompt)) <= LOGPROB_TOL
    assert wait_kv_idle(hybrid_cluster.prefill) == 0.0
    assert wait_kv_idle(hybrid_cluster.decode) == 0.0


def test_d_prefix_cache_hit_pulls_only_the_rest(hybrid_cluster: PDCluster) -> None:
    """D already computed the first 256 tokens (8 blocks) of the prompt for another request: it pulls the other
    6 full-attention blocks per full layer and the window's blocks per sliding layer, and answers the same."""
    prompt = prompt_ids(420, seed=5151)
    post(hybrid_cluster.decode.url + "/v1/completions",
         {"model": "tiny", "prompt": prompt[:256] + prompt_ids(20, seed=1), "max_tokens": 1})
    out = prefill_then_decode(hybrid_cluster, prompt)
    pull = out["kv_transfer_params"][PULL_REPORT_KEY]
    assert pull["ok"], pull
    full_blocks = math.ceil(420 / BLOCK_SIZE) - 256 // BLOCK_SIZE
    assert pull["bytes"] == (NUM_FULL * full_blocks + NUM_SLIDING * MAX_WINDOW_BLOCKS) * LAYER_BLOCK_BYTES, pull
    assert pull["verified"] == NUM_FULL * full_blocks + NUM_SLIDING * MAX_WINDOW_BLOCKS
    assert max_logprob_gap(out, baseline(hybrid_cluster, prompt)) <= LOGPROB_TOL
