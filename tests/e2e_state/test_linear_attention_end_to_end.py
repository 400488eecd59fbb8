"""A hybrid linear-attention model (Qwen3-Next architecture) through real P and D engines.

P prefills all but the last prompt token and offers, per linear-attention layer, the one page holding its running
state (conv + SSM state), and every full-attention block; D pulls exactly those, computes the last prompt token
itself (applying it to the pulled state) and answers as the single instance does. In bfloat16 the single instance
(one chunked GDN prefill) and D (recurrent GDN decode of the last token) round differently, so logprobs agree to
0.1, not exactly; a corrupted transfer changes the answer.

The bytes a pull must move come from vLLM, not from the connector: each page's size is vLLM's own spec classes'
``page_size_bytes`` (``MambaSpec`` with the state shapes and dtypes vLLM's Qwen3-Next class gives for the model's
config and the engine's cache dtypes, ``FullAttentionSpec`` for an attention layer), at the block size the engine
reports on /metrics (``vllm:cache_config_info``: vLLM raises it to fit the state pages, by the CPU's kernels).
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
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
class Pages:
    """What vLLM's spec classes say one engine's pages hold, in bytes."""

    block_size: int  # tokens per attention block, as the engine set it
    state: int  # one linear-attention layer's state page: its conv and SSM state (the page vLLM pads is not moved)
    attention: int  # one full-attention layer's block: K and V of block_size tokens


def cache_config(server: VllmServer) -> dict[str, str]:
    """The engine's cache config as vLLM exports it (``vllm:cache_config_info``'s labels); absent fails."""
    infos = [key for key in server.metrics() if key.startswith("vllm:cache_config_info{")]
    assert len(infos) == 1, (server.url, infos)
    return dict(re.findall(r'(\w+)="([^"]*)"', infos[0]))


def vllm_pages(server: VllmServer, model: Path) -> Pages:
    """:class:`Pages` for ``server`` (serving ``model``, tensor parallel 1, bfloat16) by vLLM's own classes."""
    import torch
    from transformers import AutoConfig
    from vllm.model_executor.models.qwen3_next import Qwen3NextForCausalLM
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    cache, hf = cache_config(server), AutoConfig.from_pretrained(model)
    assert hf.architectures == ["Qwen3NextForCausalLM"] and cache["cache_dtype"] == "auto", (hf.architectures, cache)
    block_size = int(cache["block_size"])
    # What the model class reads of vLLM's config for its state (tensor parallel 1, no speculative tokens), with
    # the cache dtypes the engine settled on (the CPU platform may have set the SSM state to float32).
    config = SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=1), speculative_config=None,
        model_config=SimpleNamespace(hf_config=hf, hf_text_config=hf, dtype=torch.bfloat16),
        cache_config=SimpleNamespace(mamba_cache_dtype=cache["mamba_cache_dtype"],
                                     mamba_ssm_cache_dtype=cache["mamba_ssm_cache_dtype"]))
    state = MambaSpec(block_size=block_size, shapes=Qwen3NextForCausalLM.get_mamba_state_shape_from_config(config),
                      dtypes=Qwen3NextForCausalLM.get_mamba_state_dtype_from_config(config))
    attention = FullAttentionSpec(block_size=block_size, num_kv_heads=hf.num_key_value_heads, head_size=hf.head_dim,
                                  dtype=torch.bfloat16)
    return Pages(block_size, state.page_size_bytes, attention.page_size_bytes)


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


def expected_pull(pages: Pages, num_tokens: int, hit_tokens: int = 0) -> tuple[list[int], int]:
    """Blocks per group P offers for a prompt whose first ``num_tokens`` it computed (a state group per
    linear-attention layer, then the full-attention group), and the bytes D pulls when it already caches
    ``hit_tokens``: one state page per linear-attention layer, every attention layer's blocks past the hit."""
    blocks = math.ceil(num_tokens / pages.block_size)
    offered = [1] * NUM_STATE + [blocks]
    pulled = NUM_STATE * pages.state + NUM_FULL * (blocks - hit_tokens // pages.block_size) * pages.attention
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
    # The connector's account of its geometry is vLLM's: the block size and each group's bytes per block.
    pages = vllm_pages(state_pair.prefill, state_pair.model)
    assert pages == vllm_pages(state_pair.decode, state_pair.model)
    assert [(g.block_size, g.block_bytes) for g in p_groups] == (
        [(pages.block_size, pages.state)] * NUM_STATE + [(pages.block_size, NUM_FULL * pages.attention)]), pages


@pytest.mark.parametrize("num_tokens", [40, 300, 700])
def test_pd_answer_matches_single_instance_with_state_pages_pulled(state_pair: StatePair, num_tokens: int) -> None:
    prompt = prompt_of(num_tokens)
    params = params_from_p(state_pair, prompt)
    # P prefilled all but the last token: one state page per linear-attention layer, every attention block.
    assert params["remote_num_tokens"] == num_tokens - 1
    offered, pulled = expected_pull(vllm_pages(state_pair.prefill, state_pair.model), num_tokens - 1)
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
    pages = vllm_pages(state_pair.decode, state_pair.model)
    block = pages.block_size
    prompt = prompt_of(3 * block + 50)  # long enough that the part past the hit is more than a block
    post(state_pair.decode, {"prompt": prompt[: block + 56] + prompt_of(30), "max_tokens": 1})
    params = params_from_p(state_pair, prompt)
    out = post(state_pair.decode, {"prompt": prompt, "max_tokens": COMPARED_TOKENS, "kv_transfer_params": params})
    pull = out["kv_transfer_params"][PULL_REPORT_KEY]
    assert pull["ok"], pull
    assert pull["bytes"] == expected_pull(pages, len(prompt) - 1, hit_tokens=block)[1], pull
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
