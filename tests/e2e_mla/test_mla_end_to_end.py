"""MLA (DeepSeek-V3 architecture) through real P and D engines: what vLLM really allocates for MLA is found and
moved, and D's answers equal a single instance's.

The tiny model uses DeepSeek-V3's own RoPE (YaRN). With plain RoPE, vLLM's CPU rotary custom op rotates the wrong
rows of the strided views MLA hands it, and a single instance is not even position-consistent (appending tokens
changed earlier positions' logprobs by up to 3.3 nats): that is vLLM's bug, shown at op level by
``test_vllm_cpu_rope.py`` and ``scripts/repro_vllm_cpu_rope_mla.py``, not MLA's and not the transfer's. With YaRN
(no CPU custom op) the position check below holds, TP 1 and TP 2 single instances agree, and P/D answers are
compared with the single instance as for the Llama packages (float32, logprobs within 1e-4).
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from tests.e2e.helpers import LOGPROB_TOL
from tests.e2e_mla.conftest import MlaPair
from vllm_kvp2p.connector.scheduler import PULL_REPORT_KEY
from vllm_kvp2p.testing.server import VllmServer
from vllm_kvp2p.testing.tiny_deepseek import MLA_BLOCK_SIZE

LATENT = 512 + 64  # kv_lora_rank + qk_rope_head_dim: one row of the MLA cache per token
LAYERS = 3
FLOAT32 = 4


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "temperature": 0, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _prompt_logprobs(server: VllmServer, prompt: list[int]) -> list[float]:
    out = _post(server.url, {"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 0})
    return [next(iter(d.values()))["logprob"] for d in out["choices"][0]["prompt_logprobs"][1:]]


def _position_drift(server: VllmServer) -> float:
    """Largest change of an earlier position's prompt logprob when 6 tokens are appended (0 for a causal model)."""
    base = list(range(300, 340))
    short, longer = _prompt_logprobs(server, base), _prompt_logprobs(server, base + [7, 8, 9, 10, 11, 12])
    return max(abs(a - b) for a, b in zip(short, longer))


def _answer_through(prefill: VllmServer, decode: VllmServer, prompt: list[int],
                    **extra: Any) -> tuple[list[float], dict]:
    first = _post(prefill.url, {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    params = {**first["kv_transfer_params"], "do_remote_prefill": True, **extra}
    out = _post(decode.url, {"prompt": prompt, "max_tokens": 6, "logprobs": 1, "kv_transfer_params": params})
    return out["choices"][0]["logprobs"]["token_logprobs"], out["kv_transfer_params"][PULL_REPORT_KEY]


def test_position_consistency_check_holds_for_the_llama_control(llama_single: VllmServer) -> None:
    assert _position_drift(llama_single) == 0.0


def test_vllm_cpu_mla_prefill_is_position_consistent(mla_pair: MlaPair) -> None:
    """What makes a single instance a valid reference: earlier positions do not move when tokens are appended
    (with plain RoPE on CPU they did, by up to 3.3 nats)."""
    assert _position_drift(mla_pair.prefill) < 1e-4


def test_the_single_instance_agrees_with_an_independent_implementation(mla_pair: MlaPair) -> None:
    """The reference the P/D answers are compared with is itself checked: transformers' DeepseekV3 (float32, the
    same weights) gives the prompt logprobs vLLM's CPU MLA gives, position by position."""
    import torch
    from transformers import DeepseekV3ForCausalLM

    prompt = [300 + (i * 3) % 150 for i in range(48)]
    model = DeepseekV3ForCausalLM.from_pretrained(mla_pair.prefill.model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    theirs = torch.log_softmax(logits, dim=-1)[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])].tolist()
    assert _gap(_prompt_logprobs(mla_pair.prefill, prompt), theirs) < 1e-3


def _single(server: VllmServer, prompt: list[int]) -> list[float]:
    """The answer of one ordinary instance (a plain request; the salt keeps it off any cached prefix)."""
    out = _post(server.url, {"prompt": prompt, "max_tokens": 6, "logprobs": 1, "cache_salt": "single-instance"})
    return out["choices"][0]["logprobs"]["token_logprobs"]


def _gap(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (a, b)
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.mark.parametrize("num_tokens", [10, 16, 52, 190])
def test_d_pulls_every_latent_block_and_answers_as_the_single_instance(mla_pair: MlaPair, num_tokens: int) -> None:
    prompt = [300 + (i * 7) % 150 for i in range(num_tokens)]
    first = _post(mla_pair.prefill.url, {
        "prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True},
    })
    params = first["kv_transfer_params"]
    assert params["remote_num_tokens"] == num_tokens and params["remote_block_size"] == MLA_BLOCK_SIZE
    out = _post(mla_pair.decode.url, {
        "prompt": prompt, "max_tokens": 6, "logprobs": 1, "kv_transfer_params": {**params, "do_remote_prefill": True},
    })
    pull = out["kv_transfer_params"][PULL_REPORT_KEY]
    blocks = -(-num_tokens // MLA_BLOCK_SIZE)
    # One latent row of 576 values per token slot, one plane per layer: every block of every layer, nothing more.
    assert pull["ok"] and pull["blocks"] == blocks, pull
    assert pull["bytes"] == LAYERS * blocks * MLA_BLOCK_SIZE * LATENT * FLOAT32, pull
    assert pull["verified"] == LAYERS * blocks and "unverified" not in pull, pull  # every latent block, checked
    assert _gap(out["choices"][0]["logprobs"]["token_logprobs"], _single(mla_pair.prefill, prompt)) <= LOGPROB_TOL


def test_a_latent_byte_changed_in_flight_is_caught_and_d_recomputes(mla_pair: MlaPair) -> None:
    """The integrity digest catches one changed byte of the pulled latent cache; D then computes the prompt
    itself, and its answer is exactly the one D gives as a plain single instance."""
    prompt = [300 + (i * 17) % 150 for i in range(70)]
    first = _post(mla_pair.prefill.url, {
        "prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True},
    })
    params = {**first["kv_transfer_params"], "do_remote_prefill": True, "kvp2p_test_corrupt": "in_flight"}
    out = _post(mla_pair.decode.url, {"prompt": prompt, "max_tokens": 6, "logprobs": 1, "kv_transfer_params": params})
    pull = out["kv_transfer_params"][PULL_REPORT_KEY]
    assert not pull["ok"] and pull["failure"] == "corrupted", pull
    alone = _post(mla_pair.decode.url, {"prompt": prompt, "max_tokens": 6, "logprobs": 1, "cache_salt": "alone"})
    assert out["choices"][0]["logprobs"]["token_logprobs"] == alone["choices"][0]["logprobs"]["token_logprobs"]


def test_a_corrupted_mla_transfer_changes_the_answer(mla_pair: MlaPair) -> None:
    """D's answer depends on the pulled latent cache: overwriting it (test hook) moves it far from the single
    instance's, which the clean transfer matches."""
    prompt = [300 + (i * 11) % 150 for i in range(60)]
    reference = _single(mla_pair.prefill, prompt)
    clean, _ = _answer_through(mla_pair.prefill, mla_pair.decode, prompt)
    corrupted, pull = _answer_through(mla_pair.prefill, mla_pair.decode, prompt, kvp2p_test_corrupt=True)
    assert pull["ok"], pull
    assert _gap(clean, reference) <= LOGPROB_TOL
    assert _gap(corrupted, reference) > 100 * LOGPROB_TOL


@pytest.mark.parametrize("num_tokens", [34, 182])
def test_d_pulls_the_whole_latent_cache_from_one_rank_of_p_at_tp2(
    mla_pair: MlaPair, mla_prefill_tp2: VllmServer, num_tokens: int
) -> None:
    """The latent cache is replicated on every P rank: D (TP 1) reads all of it from one rank of P at TP 2, the
    same blocks and bytes as from P at TP 1, and answers as the single instance at TP 1 does."""
    prompt = [300 + (i * 13) % 150 for i in range(num_tokens)]
    _, pull1 = _answer_through(mla_pair.prefill, mla_pair.decode, prompt)
    answer, pull2 = _answer_through(mla_prefill_tp2, mla_pair.decode, prompt)
    assert pull1["ok"] and pull2["ok"], (pull1, pull2)
    assert (pull2["blocks"], pull2["bytes"]) == (pull1["blocks"], pull1["bytes"]), (pull1, pull2)
    assert pull2["verified"] == pull1["verified"] > 0, (pull1, pull2)  # P rank 0 of 2 answers the same question
    assert _gap(answer, _single(mla_pair.prefill, prompt)) <= LOGPROB_TOL
    assert _gap(_single(mla_prefill_tp2, prompt), _single(mla_pair.prefill, prompt)) <= LOGPROB_TOL


def test_engines_are_idle_afterwards(mla_pair: MlaPair, mla_prefill_tp2: VllmServer) -> None:
    """Every hold released and every pulled block freed: no engine keeps KV blocks once its requests are done."""
    for server in (mla_pair.prefill, mla_prefill_tp2, mla_pair.decode):
        deadline = time.monotonic() + 30
        while server.metric("vllm:kv_cache_usage_perc") > 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert server.metric("vllm:kv_cache_usage_perc") == 0.0, server.log_path
