"""A hybrid linear-attention model (Qwen3-Next architecture) through real P and D engines.

P prefills all but the last prompt token and offers, per linear-attention layer, the one page holding its running
state (conv + SSM state), and every full-attention block; D pulls exactly those, computes the last prompt token
itself (applying it to the pulled state) and answers as the single instance does. In bfloat16 the single instance
(one chunked GDN prefill) and D (recurrent GDN decode of the last token) round differently, so logprobs agree to
0.1, not exactly; a corrupted transfer changes the answer.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.e2e_state.conftest import StatePair
from vllm_kvp2p.connector.scheduler import PULL_REPORT_KEY
from vllm_kvp2p.testing.server import VllmServer
from vllm_kvp2p.testing.tiny_qwen3_next import LAYER_TYPES

NUM_STATE = LAYER_TYPES.count("linear_attention")
NUM_FULL = LAYER_TYPES.count("full_attention")
LOGPROB_TOL = 0.1
COMPARED_TOKENS = 4


@dataclass(frozen=True)
class Group:
    kind: str  # "linear-attention state" or "full attention"
    block_size: int  # tokens
    block_bytes: int  # what a pull moves per block of this group (all its planes)


def geometry(server: VllmServer) -> list[Group]:
    """The KV-cache groups as this engine's connector registered them (its start-up log): vLLM raises the
    attention block size to fit the state pages (288 tokens on one CPU, 544 on another where its accelerated GDN
    backend keeps the SSM state in float32), so nothing here is a constant."""
    line = re.search(r"rank 0 KV geometry: (.*)", server.log_path.read_text(errors="replace"))
    assert line, server.log_path
    return [Group(kind, int(block), int(size)) for kind, block, size in
            re.findall(r"group \d+ ([a-z -]+): block (\d+) tokens, (\d+) B per block", line.group(1))]


def expected_pull(groups: list[Group], num_tokens: int, hit_tokens: int = 0) -> tuple[list[int], int]:
    """Blocks per group P offers for a prompt whose first ``num_tokens`` it computed, and the bytes D pulls when
    it already caches ``hit_tokens``: one state page per linear-attention layer, every attention block past the
    hit."""
    offered = [1 if g.kind == "linear-attention state" else math.ceil(num_tokens / g.block_size) for g in groups]
    pulled = sum(g.block_bytes * (1 if g.kind == "linear-attention state"
                                  else math.ceil(num_tokens / g.block_size) - hit_tokens // g.block_size)
                 for g in groups)
    return offered, pulled


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
    p_groups, d_groups = geometry(state_pair.prefill), geometry(state_pair.decode)
    assert p_groups == d_groups and [g.kind for g in p_groups] == groups.split(", ")
    assert len({g.block_size for g in p_groups}) == 1  # vLLM gives every group of a hybrid model one block size


@pytest.mark.parametrize("num_tokens", [40, 300, 700])
def test_pd_answer_matches_single_instance_with_state_pages_pulled(state_pair: StatePair, num_tokens: int) -> None:
    prompt = prompt_of(num_tokens)
    params = params_from_p(state_pair, prompt)
    # P prefilled all but the last token: one state page per linear-attention layer, every attention block.
    assert params["remote_num_tokens"] == num_tokens - 1
    offered, pulled = expected_pull(geometry(state_pair.prefill), num_tokens - 1)
    assert [len(g) for g in params["remote_block_ids"]] == offered
    out = post(state_pair.decode, {"prompt": prompt, "max_tokens": COMPARED_TOKENS, "kv_transfer_params": params})
    pull = out["kv_transfer_params"][PULL_REPORT_KEY]
    assert pull["ok"], pull
    assert pull["bytes"] == pulled, pull
    assert pull["verified"] > 0 and "unverified" not in pull, pull  # integrity=full: state pages and blocks
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


def test_a_byte_changed_in_flight_is_caught_and_d_recomputes_the_right_answer(state_pair: StatePair) -> None:
    prompt = prompt_of(300)
    params = {**params_from_p(state_pair, prompt), "kvp2p_test_corrupt": "in_flight"}
    out = post(state_pair.decode, {"prompt": prompt, "max_tokens": COMPARED_TOKENS, "kv_transfer_params": params})
    pull = out["kv_transfer_params"][PULL_REPORT_KEY]
    assert not pull["ok"] and pull["failure"] == "corrupted", pull
    single = post(state_pair.prefill, {"prompt": prompt, "max_tokens": COMPARED_TOKENS, "cache_salt": "single"})
    (d_tokens, d_lp), (s_tokens, s_lp) = answer(out), answer(single)
    assert d_tokens == s_tokens
    assert max(abs(a - b) for a, b in zip(d_lp, s_lp)) <= LOGPROB_TOL, (d_lp, s_lp)


def test_d_prefix_cache_hit_pulls_only_the_rest(state_pair: StatePair) -> None:
    """D already computed the first block and more of the prompt for another request (its cache keeps the state at
    block boundaries): it pulls the attention blocks past its hit and the state pages, and answers the same."""
    block = geometry(state_pair.decode)[0].block_size
    prompt = prompt_of(3 * block + 50)  # long enough that the part past the hit is more than a block
    post(state_pair.decode, {"prompt": prompt[: block + 56] + prompt_of(30), "max_tokens": 1})
    params = params_from_p(state_pair, prompt)
    out = post(state_pair.decode, {"prompt": prompt, "max_tokens": COMPARED_TOKENS, "kv_transfer_params": params})
    pull = out["kv_transfer_params"][PULL_REPORT_KEY]
    assert pull["ok"], pull
    assert pull["bytes"] == expected_pull(geometry(state_pair.decode), len(prompt) - 1, hit_tokens=block)[1], pull
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
