"""Head-slice and block-size-changing descriptors: checked byte by byte against a numpy model of both sides."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_kvp2p.transfer.descriptors import PlaneGeometry, build_descriptors
from vllm_kvp2p.transfer.interior import ROWS, PartLayout, classify
from vllm_kvp2p.transfer.slicing import BlockShape, build_sliced_descriptors, token_chunks

INNER = 4  # bytes per (head, token) cell


def make_side(num_blocks: int, heads: int, tokens: int, head_major: bool, n_planes: int, base: int):
    shape = BlockShape(head_major, heads, tokens, INNER)
    block = shape.block_bytes
    planes = [PlaneGeometry(base + i * (num_blocks * block + 64), block, block, num_blocks) for i in range(n_planes)]
    return planes, [shape] * n_planes


def cell_addr(plane: PlaneGeometry, shape: BlockShape, block: int, head: int, token: int) -> int:
    return plane.base_addr + block * plane.block_stride + shape.cell_offset(head, token)


def apply(desc, memory: dict[int, int], remote_memory: dict[int, int]) -> None:
    for la, ra, n in zip(desc.local_addrs, desc.remote_addrs, desc.lengths):
        for k in range(n):
            memory[la + k] = remote_memory[ra + k]


@settings(max_examples=60, deadline=None)
@given(
    p_bs_exp=st.integers(0, 2), d_bs_exp=st.integers(0, 2), p_heads=st.sampled_from([1, 2, 4]),
    d_heads=st.sampled_from([1, 2, 4]), p_major=st.booleans(), d_major=st.booleans(),
    n_tokens=st.integers(1, 40), first_token_blocks=st.integers(0, 2), data=st.data(),
)
def test_every_pulled_cell_lands_where_it_belongs(p_bs_exp, d_bs_exp, p_heads, d_heads, p_major, d_major, n_tokens,
                                                   first_token_blocks, data) -> None:
    p_bs, d_bs = 4 << p_bs_exp, 4 << d_bs_exp
    n_heads = min(p_heads, d_heads)
    remote_head = data.draw(st.integers(0, p_heads - n_heads))
    local_head = data.draw(st.integers(0, d_heads - n_heads))
    first_token = first_token_blocks * d_bs  # D's local hit ends on a D block boundary
    p_planes, p_shapes = make_side(32, p_heads, p_bs, p_major, 2, base=1 << 20)
    d_planes, d_shapes = make_side(32, d_heads, d_bs, d_major, 2, base=1 << 30)
    total = first_token + n_tokens
    p_ids = data.draw(st.permutations(range(32)))[: -(-total // p_bs)]
    d_ids = data.draw(st.permutations(range(32)))[: -(-n_tokens // d_bs)]
    first, offset = divmod(first_token, p_bs)
    chunks = token_chunks(d_ids, d_bs, p_ids[first:], p_bs, offset)
    desc = build_sliced_descriptors(d_planes, d_shapes, p_planes, p_shapes, chunks, local_head, remote_head, n_heads)

    remote_mem = {}
    for pi, (pl, sh) in enumerate(zip(p_planes, p_shapes)):
        for b in range(32):
            for h in range(p_heads):
                for t in range(p_bs):
                    for k in range(INNER):
                        remote_mem[cell_addr(pl, sh, b, h, t) + k] = hash((pi, b, h, t, k)) & 0xFF
    local_mem: dict[int, int] = {}
    apply(desc, local_mem, remote_mem)
    for dl, ds, pl, ps in zip(d_planes, d_shapes, p_planes, p_shapes):
        for tok in range(n_tokens):
            pos = first_token + tok
            for h in range(n_heads):
                for k in range(INNER):
                    want = remote_mem[cell_addr(pl, ps, p_ids[pos // p_bs], remote_head + h, pos % p_bs) + k]
                    got = local_mem[cell_addr(dl, ds, d_ids[tok // d_bs], local_head + h, tok % d_bs) + k]
                    assert got == want
    # nothing outside the requested heads of D's blocks was written
    allowed = {cell_addr(dl, ds, b, local_head + h, t) + k
               for dl, ds in zip(d_planes, d_shapes) for b in d_ids
               for h in range(n_heads) for t in range(d_bs) for k in range(INNER)}
    assert set(local_mem) <= allowed


def test_same_shape_all_heads_matches_the_merged_fast_path() -> None:
    p_planes, p_shapes = make_side(20, 2, 8, True, 3, base=1 << 20)
    d_planes, d_shapes = make_side(20, 2, 8, True, 3, base=1 << 30)
    d_ids, p_ids = [0, 1, 2, 9, 4], [5, 6, 7, 8, 10]
    fast = build_descriptors(d_planes, p_planes, d_ids, p_ids)
    sliced = build_sliced_descriptors(d_planes, d_shapes, p_planes, p_shapes, token_chunks(d_ids, 8, p_ids, 8, 0),
                                      0, 0, 2)
    assert (sliced.local_addrs, sliced.remote_addrs, sliced.lengths) == (fast.local_addrs, fast.remote_addrs,
                                                                         fast.lengths)


def test_head_major_slice_is_one_descriptor_per_block() -> None:
    # P TP 2 -> D TP 1 on CPU layout: each P rank's whole block is a contiguous half of D's block.
    p_planes, p_shapes = make_side(10, 1, 8, True, 1, base=1 << 20)
    d_planes, d_shapes = make_side(10, 2, 8, True, 1, base=1 << 30)
    desc = build_sliced_descriptors(d_planes, d_shapes, p_planes, p_shapes, token_chunks([3], 8, [4], 8, 0), 1, 0, 1)
    assert desc.lengths == [8 * INNER]
    assert desc.local_addrs == [d_planes[0].base_addr + 3 * d_planes[0].block_stride + 8 * INNER]


def test_errors() -> None:
    p_planes, p_shapes = make_side(10, 1, 8, True, 1, base=1 << 20)
    d_planes, d_shapes = make_side(10, 2, 8, True, 1, base=1 << 30)
    with pytest.raises(ValueError, match="exceed"):
        build_sliced_descriptors(d_planes, d_shapes, p_planes, p_shapes, token_chunks([3], 8, [4], 8, 0), 0, 0, 2)
    with pytest.raises(ValueError, match="out of range"):
        build_sliced_descriptors(d_planes, d_shapes, p_planes, p_shapes, token_chunks([30], 8, [4], 8, 0), 0, 0, 1)
    with pytest.raises(ValueError, match="remote_offset"):
        token_chunks([1], 8, [2], 8, 8)


# ---------------------------------------------------------------- blocks of several parts per head (vLLM's CPU layout)

ELEMENTS, ELEMENT_BYTES = 4, 2  # per part row: 4 elements of 2 bytes


def part_offset(layout_spec: tuple[int, int, list[list[int]]], block: int, token: int, element: int) -> int:
    group, tile, inside = layout_spec
    return (element // group) * block * group + (token // tile) * tile * group + inside[token % tile][element % group]


def layout_of(spec: tuple[int, int, list[list[int]]], block: int) -> PartLayout:
    return classify([[part_offset(spec, block, t, e) for e in range(ELEMENTS)] for t in range(block)], ELEMENT_BYTES)


@st.composite
def part_specs(draw: st.DrawFn) -> tuple[int, int, list[list[int]]]:
    group = draw(st.sampled_from([1, 2, ELEMENTS]))
    tile = draw(st.sampled_from([1, 2]))
    order = draw(st.permutations(range(group * tile)))
    return group, tile, [list(order[t * group:(t + 1) * group]) for t in range(tile)]


@settings(max_examples=60, deadline=None)
@given(k_spec=part_specs(), v_spec=part_specs(), p_bs_exp=st.integers(0, 2), d_bs_exp=st.integers(0, 2),
       p_heads=st.sampled_from([1, 2, 4]), d_heads=st.sampled_from([1, 2, 4]), n_tokens=st.integers(1, 30),
       first_token_blocks=st.integers(0, 2), data=st.data())
def test_head_major_blocks_of_k_and_v_parts_land_element_by_element(k_spec, v_spec, p_bs_exp, d_bs_exp, p_heads,
                                                                    d_heads, n_tokens, first_token_blocks,
                                                                    data) -> None:
    """[heads][K, V][tokens x elements] with any part layouts, P and D block sizes and heads differing: every
    element of every pulled token and head lands where D's kernel would read it, and nothing else is written."""
    specs = (k_spec, v_spec)
    p_bs, d_bs = 4 << p_bs_exp, 4 << d_bs_exp
    n_heads = min(p_heads, d_heads)
    remote_head = data.draw(st.integers(0, p_heads - n_heads))
    local_head = data.draw(st.integers(0, d_heads - n_heads))
    row = ELEMENTS * ELEMENT_BYTES

    def side(heads: int, bs: int, base: int) -> tuple[PlaneGeometry, BlockShape]:
        shape = BlockShape(True, heads, bs, row, parts=2, layouts=tuple(layout_of(s, bs) for s in specs))
        return PlaneGeometry(base, shape.block_bytes, shape.block_bytes, 32), shape

    def addr(plane: PlaneGeometry, bs: int, block: int, head: int, part: int, token: int, element: int) -> int:
        return (plane.base_addr + block * plane.block_stride + (head * 2 + part) * bs * row
                + part_offset(specs[part], bs, token, element) * ELEMENT_BYTES)

    (p_plane, p_shape), (d_plane, d_shape) = side(p_heads, p_bs, 1 << 20), side(d_heads, d_bs, 1 << 30)
    first_token = first_token_blocks * d_bs
    total = first_token + n_tokens
    p_ids = data.draw(st.permutations(range(32)))[: -(-total // p_bs)]
    d_ids = data.draw(st.permutations(range(32)))[: -(-n_tokens // d_bs)]
    first, offset = divmod(first_token, p_bs)
    chunks = token_chunks(d_ids, d_bs, p_ids[first:], p_bs, offset)
    desc = build_sliced_descriptors([d_plane], [d_shape], [p_plane], [p_shape], chunks, local_head, remote_head,
                                    n_heads)
    remote_mem = {addr(p_plane, p_bs, b, h, part, t, e) + k: (b, h, part, t, e, k) for b in range(32)
                  for h in range(p_heads) for part in (0, 1) for t in range(p_bs) for e in range(ELEMENTS)
                  for k in range(ELEMENT_BYTES)}
    local_mem: dict[int, tuple[int, ...]] = {}
    apply(desc, local_mem, remote_mem)
    for tok in range(n_tokens):
        pos = first_token + tok
        for h in range(n_heads):
            for part in (0, 1):
                for e in range(ELEMENTS):
                    got = addr(d_plane, d_bs, d_ids[tok // d_bs], local_head + h, part, tok % d_bs, e)
                    want = (p_ids[pos // p_bs], remote_head + h, part, pos % p_bs, e)
                    assert local_mem[got][:5] == want and local_mem[got + 1][:5] == want
    allowed = {addr(d_plane, d_bs, b, local_head + h, part, t, e) + k for b in d_ids for h in range(n_heads)
               for part in (0, 1) for t in range(d_bs) for e in range(ELEMENTS) for k in range(ELEMENT_BYTES)}
    assert set(local_mem) <= allowed


def test_parts_laid_out_differently_on_each_side_are_refused() -> None:
    columns = PartLayout(group=1, tile=1, element_bytes=2)
    d = BlockShape(True, 1, 8, 8, parts=2, layouts=(columns, ROWS))
    p = BlockShape(True, 1, 8, 8, parts=2, layouts=(ROWS, ROWS))
    plane = PlaneGeometry(1 << 20, d.block_bytes, d.block_bytes, 4)
    with pytest.raises(ValueError, match="local blocks are"):
        build_sliced_descriptors([plane], [d], [plane], [p], token_chunks([1], 8, [2], 8, 0), 0, 0, 1)
