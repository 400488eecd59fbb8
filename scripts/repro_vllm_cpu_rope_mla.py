#!/usr/bin/env python
"""Standalone reproduction, fit for a vLLM bug report: on CPU, vLLM's rotary-embedding custom op
(``vllm._custom_ops.rotary_embedding`` -> ``torch.ops._C.rotary_embedding``) rotates the wrong values when given
the 3-D strided views that vLLM's own MLA layer passes it.

    python scripts/repro_vllm_cpu_rope_mla.py        # needs only vllm (CPU build) and torch

``MultiHeadLatentAttentionWrapper.forward`` (vllm/model_executor/layers/mla.py) calls
``self.rotary_emb(positions, q[..., qk_nope_head_dim:], k_pe)`` with ``q`` of shape ``[tokens, heads, nope + rope]``
(so the rope part is a non-contiguous ``[tokens, heads, rope]`` view) and ``k_pe = kv[..., kv_lora_rank:]
.unsqueeze(1)`` (a ``[tokens, 1, rope]`` view with the row stride of ``kv``). ``RotaryEmbedding.forward_cpu`` hands
both to the custom op, which assumes a dense ``[tokens, heads * rope]`` layout. Any MLA model with plain RoPE
(``rope_type: default``) served on CPU with custom ops on (e.g. ``--enforce-eager``) is affected: its prefill is
not position-consistent. DeepSeek-V3's YaRN RoPE has no CPU custom op and is not affected; nor is
``--compilation-config '{"custom_ops":["-rotary_embedding"]}'``.

Prints the largest error of the op against vLLM's own PyTorch implementation (``RotaryEmbedding.forward_static``)
for the MLA views, and for the same values laid out densely (the control: 0). Exit status 1 while the bug is there.
"""

from __future__ import annotations

import sys

import torch


def rotary_errors(tokens: int = 7, heads: int = 4, nope: int = 64, rope: int = 64, kv_lora_rank: int = 512,
                  neox: bool = False) -> dict[str, float]:
    """Largest absolute error of the CPU op against the reference: for MLA's strided q and k views, and for the
    same values contiguous."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    generator = torch.Generator().manual_seed(0)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rope, 2, dtype=torch.float32) / rope))
    freqs = torch.outer(torch.arange(256, dtype=torch.float32), inv_freq)
    cos_sin_cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    positions = torch.arange(tokens)
    q = torch.randn(tokens, heads, nope + rope, generator=generator)
    kv = torch.randn(tokens, kv_lora_rank + rope, generator=generator)

    def reference(query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out_q, out_k = RotaryEmbedding.forward_static(positions, query.contiguous().clone(), key.contiguous().clone(),
                                                      rope, rope, cos_sin_cache, neox)
        assert out_k is not None
        return out_q.reshape(query.shape), out_k.reshape(key.shape)

    q_view, k_view = q[..., nope:], kv[:, kv_lora_rank:].unsqueeze(1)  # exactly what MLA passes
    want_q, want_k = reference(q_view, k_view)
    ops.rotary_embedding(positions, q_view, k_view, rope, cos_sin_cache, neox)  # in place
    dense_q = torch.randn(tokens, heads * rope, generator=generator)
    dense_k = torch.randn(tokens, rope, generator=generator)
    ref_q, ref_k = reference(dense_q, dense_k)
    ops.rotary_embedding(positions, dense_q, dense_k, rope, cos_sin_cache, neox)
    return {
        "mla_q_view": (q_view - want_q).abs().max().item(),
        "mla_k_view": (k_view - want_k).abs().max().item(),
        "dense_control": max((dense_q - ref_q).abs().max().item(), (dense_k - ref_k).abs().max().item()),
    }


def main() -> int:
    import vllm

    errors = rotary_errors()
    print(f"vLLM {vllm.__version__}, torch {torch.__version__}: largest error of torch.ops._C.rotary_embedding")
    for name, value in errors.items():
        print(f"  {name:14} {value:.6g}")
    broken = errors["mla_q_view"] > 1e-4 or errors["mla_k_view"] > 1e-4
    print("BUG: the op rotates MLA's strided views wrongly" if broken else "the op is correct on MLA's views")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
