"""Prompts and the params P issues for them, for tests of D's admission (vllm_kvp2p/lifecycle/admission.py):
params carry the digest of the tokens they offer, so a test's prompt and params must be made together."""

from __future__ import annotations

from typing import Any

from vllm_kvp2p.contract.protocol import RemotePrefill, prompt_digest
from vllm_kvp2p.lifecycle.admission import Prompt


def tokens(n: int, seed: int = 0) -> list[int]:
    """``n`` token ids of a deterministic sequence; different seeds differ from the first token on."""
    return [10 + (seed * 97 + i * 31) % 900 for i in range(n)]


def prompt(n: int, seed: int = 0) -> Prompt:
    ids = tokens(n, seed)
    return Prompt(n, lambda k: prompt_digest(ids[:k]))


def remote(block_ids: list[list[int]], num_tokens: int, block_size: int, *, seed: int = 0, host: str = "127.0.0.1",
           port: int = 9000, **fields: Any) -> RemotePrefill:
    """What P issues for the first ``num_tokens`` of ``tokens(..., seed)`` held in ``block_ids``."""
    fields.setdefault("remote_prompt_digest", prompt_digest(tokens(num_tokens, seed)))
    return RemotePrefill("P", "p-req", host, port, block_ids, "hold", num_tokens, block_size, **fields)
