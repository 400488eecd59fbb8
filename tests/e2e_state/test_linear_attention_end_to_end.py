"""A hybrid linear-attention model (Qwen3-Next architecture) through real P and D engines.

P prefills all but the last prompt token and offers, per linear-attention layer, the one page holding its running
state (conv + SSM state), and every full-attention block; D pulls exactly those, computes the last prompt token
itself (applying it to the pulled state) and answers as the single instance does. In bfloat16 the single instance
(one chunked GDN prefill) and D (recurrent GDN decode of the last token) round differently, so logprobs agree to
0.1, not exactly; a corrupted transfer changes the answer.
"""

from __future__ import annotations

import math
import time
from typing import Any

import httpx
import pytest

from tests.e2e_state.conftest import StatePair
from vllm_kvp2p.scheduler import PULL_REPORT_KEY
from vllm_kvp2p.testing.server import VllmServer
from vllm_kvp2p.testing.tiny_qwen3_next import LAYER_TYPES

BLOCK = 288  # the attention block size vLLM picks for this model (state page <= attention page)
# One state page: conv state (kernel 4 - 1) x (2 * 2 key heads * 128 + 4 value heads * 128), and SSM state
# 4 value heads x 128 x 128, bfloat16.
STATE_PAGE = (3 * 1024 + 4 * 128 * 128) * 2
ATTN_BLOCK = 2 * BLOCK * 128 * 2  # 2 KV heads x 288 tokens x (K 64 + V 64) x bfloat16
NUM_STATE = LAYER_TYPES.count("linear_attention")
NUM_FULL = LAYER_TYPES.count("full_attention")
LOGPROB_TOL = 0.1
COMPARED_TOKENS = 4


def post(server: VllmServer, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "model": "tiny", "temperature": 0, "logprobs": 1, "ignore_eos": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


def answer(resp: dict[str, Any]) -> tuple[list[str], list[float]]:
    lp = resp["choices"][0]["logprobs"]
    return lp["tokens"], lp["token_logprobs"]


def prompt_of(n: int) -> list[int]:
    return [4 + (i * 37 + n) % 500 for i in range(n)]


def params_from_p(pair: StatePair, prompt: list[int]) -> dict[str, Any]:
    out = post(pair.prefill, {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    return out["kv_transfer_params"]


def test_both_engines_move_state_and_attention_groups(state_pair: StatePair) -> None:
    groups = ", ".join(["linear-attention state"] * NUM_STATE + ["full attention"] * NUM_FULL)
    for server in (state_pair.prefill, state_pair.decode):
        log = server.log_path.read_text()
        assert f"in {len(LAYER_TYPES)} KV-cache group(s) ({groups})" in log, server.log_path


@pytest.mark.parametrize("num_tokens", [40, 300, 700])
def test_pd_answer_matches_single_instance_with_state_pages_pulled(state_pair: StatePair, num_tokens: int) -> None:
    prompt = prompt_of(num_tokens)
    params = params_from_p(state_pair, prompt)
    # P prefilled all but the last token: one state page per linear-attention layer, every attention block.
    assert params["remote_num_tokens"] == num_tokens - 1
    attn_blocks = math.ceil((num_tokens - 1) / BLOCK)
    assert [len(g) for g in params["remote_block_ids"]] == [1] * NUM_STATE + [attn_blocks] * NUM_FULL
    out = post(state_pair.decode, {"prompt": prompt, "max_tokens": COMPARED_TOKENS, "kv_transfer_params": params})
    pull = out["kv_transfer_params"][PULL_REPORT_KEY]
    assert pull["ok"], pull
    assert pull["bytes"] == NUM_STATE * STATE_PAGE + NUM_FULL * attn_blocks * ATTN_BLOCK, pull
    single = post(state_pair.prefill, {"prompt": prompt, "max_tokens": COMPARED_TOKENS, "cache_salt": "single"})
    (d_tokens, d_lp), (s_tokens, s_lp) = answer(out), answer(single)
    assert d_tokens == s_tokens
    assert max(abs(a - b) for a, b in zip(d_lp, s_lp)) <= LOGPROB_TOL, (d_lp, s_lp)


def test_a_corrupted_transfer_changes_the_answer(state_pair: StatePair) -> None:
    prompt = prompt_of(300)
    params = {**params_from_p(state_pair, prompt), "kvp2p_test_corrupt": True}
    out = post(state_pair.decode, {"prompt": prompt, "max_tokens": COMPARED_TOKENS, "kv_transfer_params": params})
    assert out["kv_transfer_params"][PULL_REPORT_KEY]["ok"]
    single = post(state_pair.prefill, {"prompt": prompt, "max_tokens": COMPARED_TOKENS, "cache_salt": "single"})
    (d_tokens, d_lp), (s_tokens, s_lp) = answer(out), answer(single)
    assert d_tokens != s_tokens or max(abs(a - b) for a, b in zip(d_lp, s_lp)) > 10 * LOGPROB_TOL


def test_d_prefix_cache_hit_pulls_only_the_rest(state_pair: StatePair) -> None:
    """D already computed the first 600 tokens of the prompt for another request (its cache keeps the state at
    block boundaries): it pulls the attention blocks past its hit and the state pages, and answers the same."""
    prompt = prompt_of(1000)
    post(state_pair.decode, {"prompt": prompt[:600] + prompt_of(30), "max_tokens": 1})
    params = params_from_p(state_pair, prompt)
    out = post(state_pair.decode, {"prompt": prompt, "max_tokens": COMPARED_TOKENS, "kv_transfer_params": params})
    pull = out["kv_transfer_params"][PULL_REPORT_KEY]
    hit_blocks = 600 // BLOCK
    assert pull["ok"], pull
    assert pull["bytes"] == NUM_STATE * STATE_PAGE + NUM_FULL * (math.ceil(999 / BLOCK) - hit_blocks) * ATTN_BLOCK, pull
    single = post(state_pair.prefill, {"prompt": prompt, "max_tokens": COMPARED_TOKENS, "cache_salt": "single"})
    (d_tokens, d_lp), (s_tokens, s_lp) = answer(out), answer(single)
    assert d_tokens == s_tokens
    assert max(abs(a - b) for a, b in zip(d_lp, s_lp)) <= LOGPROB_TOL, (d_lp, s_lp)


def test_engines_are_idle_afterwards(state_pair: StatePair) -> None:
    for server in (state_pair.prefill, state_pair.decode):
        deadline = time.monotonic() + 30
        while server.metric("vllm:kv_cache_usage_perc") > 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert server.metric("vllm:kv_cache_usage_perc") == 0.0, server.log_path
