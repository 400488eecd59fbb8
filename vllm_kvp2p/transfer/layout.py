"""KV-cache tensors -> block planes, from each tensor's real shape and strides (never an assumed layout).

vLLM hands ``register_kv_caches`` one entry per layer: a tensor, or a tuple/list of tensors (NPU keeps K and V
apart). A tensor's *block dimension* is the one whose size is the engine's ``num_blocks``; every index of the
dimensions before it (e.g. a leading K/V axis of 2) is a separate plane, and the dimensions after it must be
dense, because one block of one plane is moved as one run of bytes.

Examples (shapes): CPU ``(num_blocks, kv_heads, block_size, head_k + head_v)`` -> 1 plane per layer;
CUDA flash-attn ``(2, num_blocks, block_size, kv_heads, head)`` -> 2 planes; NPU ``(k, v)`` tuples of
``(num_blocks, block_size, kv_heads, head)`` -> 2 planes.

What lies *inside* a block is not in the shape: vLLM's CPU backend reads its ``[heads, tokens, 2 x head]`` block
as ``[heads][K, V][tokens][head]``. The platform says which :class:`AttentionInterior` its backend uses
(vllm_kvp2p/platform), and :func:`block_shape_of` refuses a tensor that does not fit it, at start-up.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import product
from math import prod

from vllm_kvp2p.transfer.descriptors import PlaneGeometry
from vllm_kvp2p.transfer.interior import PartLayout
from vllm_kvp2p.transfer.slicing import BlockShape


@dataclass(frozen=True)
class TensorView:
    """The facts about one tensor the layout needs (kept free of torch so it can be tested directly)."""

    data_ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements, as torch reports them
    element_size: int

    @property
    def nbytes_span(self) -> int:
        """Bytes from the first to one past the last element (what must be registered)."""
        if any(s == 0 for s in self.shape):
            return 0
        return (sum((n - 1) * st for n, st in zip(self.shape, self.strides)) + 1) * self.element_size


class LayoutError(ValueError):
    """A KV tensor's layout cannot be addressed block by block."""


def planes_of(view: TensorView, num_blocks: int, name: str = "") -> list[PlaneGeometry]:
    """The planes of one KV tensor; raises :class:`LayoutError` if the block dimension is ambiguous or the
    per-block bytes are not contiguous."""
    candidates = [d for d, n in enumerate(view.shape) if n == num_blocks]
    if not candidates:
        raise LayoutError(f"{name}: no dimension of shape {view.shape} has num_blocks={num_blocks}")
    block_dim = candidates[0]
    inner_shape = view.shape[block_dim + 1 :]
    inner_strides = view.strides[block_dim + 1 :]
    expected = 1
    for n, st in reversed(list(zip(inner_shape, inner_strides))):
        if n != 1 and st != expected:
            raise LayoutError(
                f"{name}: per-block data of shape {view.shape} strides {view.strides} is not contiguous "
                f"(dimension of size {n} has stride {st}, expected {expected})"
            )
        expected *= n
    block_bytes = prod(inner_shape) * view.element_size
    block_stride = view.strides[block_dim] * view.element_size
    planes = []
    outer = [range(n) for n in view.shape[:block_dim]]
    for index in product(*outer):
        offset = sum(i * st for i, st in zip(index, view.strides)) * view.element_size
        planes.append(PlaneGeometry(view.data_ptr + offset, block_stride, block_bytes, num_blocks))
    return planes


def planes_of_layers(
    layers: Sequence[tuple[str, Sequence[TensorView]]], num_blocks: int
) -> list[PlaneGeometry]:
    """All planes of all layers, in the given layer order, then tensor order, then outer-index order."""
    out: list[PlaneGeometry] = []
    for name, views in layers:
        for i, view in enumerate(views):
            out.extend(planes_of(view, num_blocks, f"{name}[{i}]"))
    return out


def coalesce_regions(views: Sequence[TensorView]) -> list[tuple[int, int]]:
    """(address, length) memory regions to register: each tensor's span, with touching or overlapping spans
    merged, so a model of many layers allocated back to back is registered as few regions as possible."""
    spans = sorted((v.data_ptr, v.data_ptr + v.nbytes_span) for v in views if v.nbytes_span)
    merged: list[list[int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e - s) for s, e in merged]


class AttentionInterior(enum.Enum):
    """How an attention backend lays out one block of one KV tensor (the platform declares it)."""

    #: ``[heads, tokens, 2 x head_size]`` read as ``[heads][K, V][tokens][head_size]``: vLLM's CPU backend
    #: (cpu_attn.py, 0.23 and 0.32: ``kv_cache.view(blocks, heads, 2 * tokens, head).chunk(2, dim=2)``).
    HEAD_MAJOR_KV_HALVES = "[heads][K, V][tokens][head_size] (vLLM CPU attention)"
    #: ``[tokens, heads, head_size]``, K and V in separate tensors: vllm-ascend (and CUDA flash layouts).
    TOKEN_MAJOR = "[tokens][heads][head_size], K and V in separate tensors (vllm-ascend)"
    #: One latent row per token (MLA, every platform): ``[tokens, latent]`` or ``[1, tokens, latent]`` (vLLM 0.32's
    #: CPU MLA backend writes ``cache.view(-1, latent)[slot]``) or ``[tokens, 1, latent]`` (vllm-ascend's nope / rope).
    LATENT_ROWS = "[tokens][latent] (MLA)"


def block_shape_of(
    view: TensorView, num_blocks: int, block_size: int, num_heads: int, name: str = "", *, head_size: int,
    interior: AttentionInterior, part_layouts: tuple[PartLayout, ...] = (),
) -> BlockShape:
    """The inside of one block of ``view`` as the platform's attention backend reads it.

    ``[..., num_blocks, tokens, latent]`` (2-D: an MLA latent cache, one row per token) is the same on every
    platform; a 3-D block must fit ``interior`` exactly (MLA: :attr:`AttentionInterior.LATENT_ROWS`), or
    :class:`LayoutError` names what was found.
    ``part_layouts``: how the kernel lays out each part (K, V) of a head's block, as the platform found it
    (empty: rows)."""
    block_dim = view.shape.index(num_blocks)
    inner = view.shape[block_dim + 1 :]
    parts = 2 if interior is AttentionInterior.HEAD_MAJOR_KV_HALVES else 1
    if part_layouts and len(part_layouts) != parts:
        raise LayoutError(f"{name}: {len(part_layouts)} part layouts for blocks of {parts} parts per head")
    if len(inner) == 2 and inner[0] == block_size:
        return BlockShape(False, 1, block_size, view.element_size * inner[1])
    if interior is AttentionInterior.LATENT_ROWS and len(inner) == 3 and block_size in inner[:2] and 1 in inner[:2]:
        return BlockShape(False, 1, block_size, view.element_size * inner[2])
    if interior is AttentionInterior.HEAD_MAJOR_KV_HALVES and inner == (num_heads, block_size, 2 * head_size):
        return BlockShape(True, num_heads, block_size, view.element_size * head_size, parts=2,
                          layouts=part_layouts)
    if interior is AttentionInterior.TOKEN_MAJOR and len(inner) == 3 and inner[:2] == (block_size, num_heads):
        return BlockShape(False, num_heads, block_size, view.element_size * inner[2], layouts=part_layouts)
    raise LayoutError(
        f"{name}: a block of shape {inner} (after num_blocks={num_blocks}) is not {interior.value} for "
        f"{num_heads} KV heads of {head_size} values and {block_size} tokens per block"
    )


def kv_geometry(
    layers: Sequence[tuple[str, Sequence[TensorView]]], num_blocks: int, block_size: int, num_heads: int, *,
    head_size: int, interior: AttentionInterior, part_layouts: tuple[PartLayout, ...] = (),
) -> tuple[list[PlaneGeometry], list[BlockShape]]:
    """Planes of all layers (as :func:`planes_of_layers`) and the block shape of each plane."""
    planes: list[PlaneGeometry] = []
    shapes: list[BlockShape] = []
    for name, views in layers:
        for i, view in enumerate(views):
            got = planes_of(view, num_blocks, f"{name}[{i}]")
            planes.extend(got)
            shape = block_shape_of(view, num_blocks, block_size, num_heads, f"{name}[{i}]", head_size=head_size,
                                   interior=interior, part_layouts=part_layouts)
            shapes.extend([shape] * len(got))
    return planes, shapes
