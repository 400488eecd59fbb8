"""Which global KV heads a TP rank holds, as vLLM itself shards the attention weights: the reference the TP tests
hold ``vllm_kvp2p.transfer.tp_mapping`` to (never ``Layout.heads_of``, the code under test).

``QKVParallelLinear`` (vllm/model_executor/layers/linear.py) is built for the given TP size and rank, and its own
weight loader loads the K and V rows of a checkpoint whose every row holds the index of its head; the rows that land
in the rank's weight say which heads the rank computes, hence which heads its KV cache holds. vLLM's rule (both 0.23
and 0.32): ``tp >= K``: one head per rank, replicas ``tp / K``, rank r loads head ``r // replicas``; otherwise
``K / tp`` heads per rank, rank r loads heads ``[r * K/tp, (r + 1) * K/tp)``. Nothing of that rule is written here:
the loader decides.

No distributed init: like vLLM's own layer tests, the TP rank and world size are patched where linear.py and
parameter.py read them.
"""

from __future__ import annotations

from functools import lru_cache
from unittest import mock

import torch

HIDDEN, HEAD_SIZE = 4, 2


@lru_cache(maxsize=256)
def vllm_kv_heads(total_kv_heads: int, tp_size: int, rank: int) -> tuple[int, ...]:
    """The global KV heads TP rank ``rank`` of ``tp_size`` holds, read off vLLM's own weight loading (K and V
    agree, asserted)."""
    import vllm.model_executor.layers.linear as linear
    import vllm.model_executor.parameter as parameter

    num_q_heads = 2 * max(total_kv_heads, tp_size)  # GQA with 2 query heads per KV head; divisible by tp
    patches = [mock.patch.object(module, name, return_value=value)
               for module in (linear, parameter)
               for name, value in (("get_tensor_model_parallel_world_size", tp_size),
                                   ("get_tensor_model_parallel_rank", rank))]
    for p in patches:
        p.start()
    try:
        layer = linear.QKVParallelLinear(HIDDEN, HEAD_SIZE, num_q_heads, total_kv_heads, bias=False,
                                         params_dtype=torch.float32)
        weight = layer.weight
        weight.data.fill_(-1)
        # The checkpoint's k_proj / v_proj: [total_kv_heads * head_size, hidden], each row the index of its head
        # (V offset by 1000 so a V row loaded into K's place would show).
        k_rows = torch.arange(total_kv_heads, dtype=torch.float32).repeat_interleave(HEAD_SIZE)
        k_proj = k_rows[:, None].expand(-1, HIDDEN).contiguous()
        weight.weight_loader(weight, k_proj, "k")
        weight.weight_loader(weight, k_proj + 1000, "v")
    finally:
        for p in reversed(patches):
            p.stop()
    # This rank's fused weight: [q | k | v], its q and kv head counts as the layer computed them.
    local = weight.data[:, 0]
    q_rows, kv_rows = layer.num_heads * HEAD_SIZE, layer.num_kv_heads * HEAD_SIZE
    assert local.numel() == q_rows + 2 * kv_rows, (local.numel(), q_rows, kv_rows)
    k = local[q_rows : q_rows + kv_rows].view(-1, HEAD_SIZE)
    v = local[q_rows + kv_rows :].view(-1, HEAD_SIZE) - 1000
    assert bool((k == k[:, :1]).all()) and torch.equal(k, v), (k, v)  # whole heads, K and V the same ones
    heads = tuple(int(h) for h in k[:, 0])
    assert all(0 <= h < total_kv_heads for h in heads), heads
    return heads


def vllm_kv_heads_by_rank(total_kv_heads: int, tp_size: int) -> tuple[tuple[int, ...], ...]:
    return tuple(vllm_kv_heads(total_kv_heads, tp_size, r) for r in range(tp_size))
