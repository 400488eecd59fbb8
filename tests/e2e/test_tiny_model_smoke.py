"""Smoke test: the locally made tiny Llama loads in a real ``vllm`` OpenAI server and generates.

Uses the session's prefill instance (tests/e2e/conftest.py) instead of starting a server of its own.
"""

from __future__ import annotations

import hashlib
import importlib.util
import math

import pytest

from tests.support.ci_mode import ci_mode
from vllm_kvp2p.testing.tiny_model import MARKER_NAME, make_tiny_llama, tiny_corpus

# In CI mode (tests/support/ci_mode.py) a missing vLLM fails these instead: every CI environment has one.
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None and not ci_mode(),
                                reason="vllm is not installed")


@pytest.fixture(scope="module")
def server(cluster):
    """The session's prefill instance: a plain request to it runs like a single, non-disaggregated vLLM."""
    return cluster.prefill


def _digest(path):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def test_make_tiny_llama_is_deterministic_and_idempotent(tiny_model_dir, tmp_path):
    again = make_tiny_llama(tmp_path / "again")
    assert _digest(again) == _digest(tiny_model_dir)
    before = {p.name: p.stat().st_mtime_ns for p in again.iterdir()}
    assert make_tiny_llama(tmp_path / "again") == again  # reused, not rewritten
    assert {p.name: p.stat().st_mtime_ns for p in again.iterdir()} == before
    assert (again / MARKER_NAME).is_file()


@pytest.mark.e2e
@needs_vllm
def test_greedy_completion_with_logprobs(server):
    prompt = " ".join(tiny_corpus()[:3])
    out = server.completion(prompt, max_tokens=16, logprobs=2)
    choice = out["choices"][0]
    assert choice["finish_reason"] == "length"  # EOS is suppressed by the weights: always max_tokens
    assert out["usage"]["completion_tokens"] == 16
    assert choice["text"].strip()
    assert all(ch.isprintable() or ch == "\n" for ch in choice["text"])  # only printable tokens are generated
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == 16
    assert all(math.isfinite(x) and x <= 0.0 for x in lp["token_logprobs"])
    assert all(len(top) >= 1 for top in lp["top_logprobs"])

    # Greedy decoding is deterministic (the second run also hits the prefix cache).
    hits_before = server.metric("vllm:prefix_cache_hits_total")
    again = server.completion(prompt, max_tokens=16, logprobs=2)
    assert again["choices"][0]["text"] == choice["text"]
    assert again["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(lp["token_logprobs"], abs=1e-4)
    assert server.metric("vllm:prefix_cache_hits_total") > hits_before

    # A different cache_salt does not share the prefix cache, and gives the same greedy output.
    hits_before = server.metric("vllm:prefix_cache_hits_total")
    salted = server.completion(prompt, max_tokens=16, cache_salt="smoke-test-salt")
    assert salted["choices"][0]["text"] == choice["text"]
    assert server.metric("vllm:prefix_cache_hits_total") == hits_before


@pytest.mark.e2e
@needs_vllm
def test_chat_completion_uses_template(server):
    out = server.post_json(
        "/v1/chat/completions",
        {
            "model": server.model_name,
            "messages": [{"role": "user", "content": "Hello! How are you?"}],
            "max_tokens": 8,
            "temperature": 0,
        },
    )
    assert out["usage"]["completion_tokens"] == 8
    assert out["choices"][0]["message"]["content"]
