"""What the speculative-decoding tests compare: answers, and how many drafts D's drafter made and vLLM accepted."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tests.e2e.helpers import post
from vllm_kvp2p.testing.cluster import PDCluster
from vllm_kvp2p.testing.server import VllmServer


@dataclass(frozen=True)
class Drafts:
    proposed: float  # verification steps that carried drafts (vllm:spec_decode_num_drafts_total)
    accepted: float  # draft tokens the target model confirmed (vllm:spec_decode_num_accepted_tokens_total)

    @classmethod
    def of(cls, server: VllmServer) -> Drafts:
        return cls(server.metric("vllm:spec_decode_num_drafts_total"),
                   server.metric("vllm:spec_decode_num_accepted_tokens_total"))

    def __sub__(self, other: Drafts) -> Drafts:
        return Drafts(self.proposed - other.proposed, self.accepted - other.accepted)


def body(prompt: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1, **extra}


def single(cluster: PDCluster, prompt: list[int], max_tokens: int) -> tuple[dict[str, Any], Drafts]:
    """A plain request on P, which runs the same speculative config: one instance computes it all (the salt
    keeps it off any cached prefix)."""
    before = Drafts.of(cluster.prefill)
    out = post(cluster.prefill.url + "/v1/completions", body(prompt, max_tokens, cache_salt="single-instance"))
    return out, Drafts.of(cluster.prefill) - before


def through_proxy(cluster: PDCluster, prompt: list[int], max_tokens: int) -> tuple[dict[str, Any], Drafts]:
    before = Drafts.of(cluster.decode)
    out = post(cluster.proxy_url + "/v1/completions", body(prompt, max_tokens))
    return out, Drafts.of(cluster.decode) - before


def direct(cluster: PDCluster, prompt: list[int], max_tokens: int, **params: Any) -> tuple[dict[str, Any], Drafts]:
    """P then D without the proxy, with extra ``kv_transfer_params`` for D (test hooks)."""
    first = post(cluster.prefill.url + "/v1/completions",
                 body(prompt, 1, kv_transfer_params={"do_remote_decode": True}))
    before = Drafts.of(cluster.decode)
    out = post(cluster.decode.url + "/v1/completions",
               body(prompt, max_tokens, kv_transfer_params={**first["kv_transfer_params"], "do_remote_prefill": True,
                                                           **params}))
    return out, Drafts.of(cluster.decode) - before
