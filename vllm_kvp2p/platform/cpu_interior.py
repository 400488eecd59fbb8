"""CPU: how vLLM's CPU attention kernel lays out K and V inside a block, read off the kernel itself.

vLLM's CPU backend writes the KV cache with ``cpu_attn_reshape_and_cache`` into ``[heads][K, V][tokens x
head_size]`` per block, and the order inside K and inside V depends on the ISA the backend picks for the dtype,
block size and head size on this CPU (``vec``: K element-major, V token-major; ``amx``: 16-token tiles and
token pairs). Nothing outside the compiled kernel says which; so at start-up this module writes known values
through the same op, with the ISA the backend would pick (vLLM's own ``_get_attn_isa``), into a scratch block,
and reads back where each element landed (:func:`vllm_kvp2p.transfer.interior.classify` names the layout).

P and D each find their own; the registration carries it, so a pull between layouts that differ is refused
(e.g. P on a host with AMX and D without, in bfloat16) and a pull between block sizes copies the right runs.
The same function of vLLM runs on 0.23 and 0.32.
"""

from __future__ import annotations

import functools
from typing import Any

from vllm_kvp2p.log import get_logger
from vllm_kvp2p.transfer.interior import PartLayout, classify

logger = get_logger(__name__)

_BASE = 128  # digits 1..128 are exact in bfloat16 and float16: an element's id is written in three passes
_PASSES = 3


@functools.lru_cache(maxsize=16)
def attention_part_layouts(dtype: Any, block_size: int, head_size: int, kv_cache_dtype: str) -> tuple[PartLayout, ...]:
    """(K layout, V layout) of one head's block as vLLM's CPU kernel writes it. Without a usable probe (an fp8
    cache stores scaled bytes, or vLLM's op is missing) each part is one tile of the whole block: only pulls
    between equal block sizes of the same kernel work then (the registration says which)."""
    import torch

    if kv_cache_dtype not in ("auto", "", None) and "fp8" in str(kv_cache_dtype):
        return _whole_block(block_size, f"{kv_cache_dtype} cache")
    try:
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(dtype, block_size, head_size, kv_cache_dtype)
        where = _written_positions(ops, isa, dtype, block_size, head_size)
    except Exception as exc:  # a vLLM without this op or ISA helper: say so, never guess
        logger.warning("could not read vLLM's CPU KV layout (%s: %s): P and D must then use the same block size",
                       type(exc).__name__, exc)
        return _whole_block(block_size, "unprobed")
    element = torch.empty((), dtype=dtype).element_size()
    part = block_size * head_size
    layouts = []
    for p in range(2):  # K, then V
        ids = where[p * part : (p + 1) * part]  # id -> position in the head's block
        offsets = [[ids[t * head_size + e] - p * part for e in range(head_size)] for t in range(block_size)]
        layouts.append(classify(offsets, element))
    logger.info("vLLM CPU attention (isa %s, %s, block %d, head %d): K %s; V %s", isa, dtype, block_size, head_size,
                layouts[0].describe(), layouts[1].describe())
    return tuple(layouts)


def _written_positions(ops: Any, isa: str, dtype: Any, block_size: int, head_size: int) -> list[int]:
    """For each element id ``(part, token, element)`` of two heads' blocks, where the op put it within its head's
    block. Checks that head 1 is laid out exactly as head 0, one head's block after it."""
    import torch

    heads = 2
    per_head = 2 * block_size * head_size
    ids = torch.arange(heads * per_head).view(heads, 2, block_size, head_size)
    found = torch.zeros(heads * per_head, dtype=torch.long)
    for digit in range(_PASSES):
        cache = torch.zeros(1, heads, block_size, 2 * head_size, dtype=dtype)
        key_cache, value_cache = cache.view(1, heads, 2 * block_size, head_size).chunk(2, dim=2)  # as cpu_attn.py
        value = (ids // _BASE**digit) % _BASE + 1
        key = value[:, 0].permute(1, 0, 2).to(dtype).contiguous()  # [tokens, heads, head_size]
        val = value[:, 1].permute(1, 0, 2).to(dtype).contiguous()
        ops.cpu_attn_reshape_and_cache(key, val, key_cache, value_cache, torch.arange(block_size), isa)
        found += (cache.view(-1).float().round().long() - 1) * _BASE**digit
    position = torch.empty_like(found)
    position[found] = torch.arange(found.numel())  # id -> memory position
    if not torch.equal(found.sort().values, torch.arange(found.numel())):
        raise RuntimeError("the op did not write every element exactly once")
    by_head = position.view(heads, per_head)
    if not torch.equal(by_head[1] - per_head, by_head[0]):
        raise RuntimeError("the second head is not laid out as the first, one block of a head after it")
    return by_head[0].tolist()


def _whole_block(block_size: int, why: str) -> tuple[PartLayout, ...]:
    layout = PartLayout(group=0, tile=block_size, digest=f"{why}:block {block_size}")
    return (layout, layout)
