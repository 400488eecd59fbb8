"""vLLM's real CPU KV cache for worker-level tests: the shape vLLM allocates for a full-attention layer, and K / V
written into it by the same op, ISA choice and view vLLM's CPU attention backend uses (cpu_attn.py), so a test's
expectations come from vLLM's kernel, never from a layout written down by hand.

Shapes: vLLM 0.23 asks the backend (``CPUAttentionBackend.get_kv_cache_shape``); vLLM 0.32 derives it from the
layer's spec (``compute_layer_kv_cache_shape_bytes``: ``[blocks, heads, tokens, bytes]``). Both give
``[blocks, heads, tokens, 2 x head_size]``; the kernel's order inside a block is what this module leaves to vLLM.
"""

from __future__ import annotations

import torch


def kv_shape(num_blocks: int, block_size: int, num_heads: int, head_size: int, dtype: torch.dtype) -> tuple[int, ...]:
    """The shape of one layer's KV tensor as the installed vLLM allocates it on CPU."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    shape_of = getattr(CPUAttentionBackend, "get_kv_cache_shape", None)
    if shape_of is not None:  # vLLM 0.23
        return tuple(shape_of(num_blocks, block_size, num_heads, head_size))
    from vllm.v1.kv_cache_interface import FullAttentionSpec, compute_layer_kv_cache_shape_bytes

    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=num_heads, head_size=head_size, dtype=dtype)
    blocks, heads, tokens, content = compute_layer_kv_cache_shape_bytes(spec, num_blocks)
    return blocks, heads, tokens, content // torch.empty((), dtype=dtype).element_size()


def write_tokens(cache: torch.Tensor, slots: list[int], key: torch.Tensor, value: torch.Tensor) -> None:
    """Write ``key`` / ``value`` (``[tokens, heads, head_size]``) at ``slots`` (block * block_size + offset) the
    way vLLM's CPU backend does in a forward pass."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    num_blocks, num_heads, block_size, _ = cache.shape
    head_size = key.shape[-1]
    key_cache, value_cache = cache.view(num_blocks, num_heads, 2 * block_size, head_size).chunk(2, dim=2)
    isa = _get_attn_isa(cache.dtype, block_size, head_size, "auto")
    ops.cpu_attn_reshape_and_cache(key.to(cache.dtype).contiguous(), value.to(cache.dtype).contiguous(), key_cache,
                                   value_cache, torch.tensor(slots, dtype=torch.long), isa)
