"""Layouts inside a KV block part (vllm_kvp2p/transfer/interior.py): found from where a kernel put each element,
and the runs that copy a token range between parts of different block sizes, checked byte by byte against a model
of both memories. The layouts generated are every one the formula allows (any column group, any tile, any order
inside a tile), which includes what vLLM's CPU kernels write (tests/worker/test_cpu_kernel_layouts.py reads those
off the kernels themselves)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_kvp2p.transfer.interior import ROWS, PartLayout, classify, part_runs


def offsets_for(block: int, elements: int, group: int, tile: int, inside: list[list[int]]) -> list[list[int]]:
    """Element offsets of a part laid out with column groups of ``group`` elements and ``tile``-token tiles."""
    return [[(e // group) * block * group + (t // tile) * tile * group + inside[t % tile][e % group]
             for e in range(elements)] for t in range(block)]


@st.composite
def layouts(draw: st.DrawFn) -> tuple[int, int, int, list[list[int]]]:
    elements = draw(st.sampled_from([1, 2, 4, 6, 8]))
    group = draw(st.sampled_from([g for g in (1, 2, 4, 8) if elements % g == 0] + [elements]))
    tile = draw(st.sampled_from([1, 2, 4]))
    order = draw(st.permutations(range(tile * group)))
    inside = [list(order[t * group:(t + 1) * group]) for t in range(tile)]
    return elements, group, tile, inside


def test_plain_rows_and_element_major_are_named() -> None:
    assert classify(offsets_for(8, 4, 4, 1, [[0, 1, 2, 3]]), 2) == ROWS
    columns = classify([[e * 8 + t for e in range(4)] for t in range(8)], 2)  # K on vLLM's vec ISA
    assert columns == PartLayout(group=1, tile=1, element_bytes=2)
    assert "column groups of 1" in columns.describe()


def test_a_layout_without_smaller_structure_is_one_tile_of_the_block() -> None:
    rng = random.Random(5)
    order = list(range(8 * 4))
    rng.shuffle(order)
    layout = classify([order[t * 4:(t + 1) * 4] for t in range(8)], 2)
    assert layout.tile == 8 and layout.digest.startswith("8x4:")  # the block size is in it: another block size
    with pytest.raises(ValueError, match="split a part"):             # of the same kernel names another layout
        part_runs(layout, 8, 16, 4, 8, 0, 4)  # half a tile: cannot be cut apart
    assert part_runs(layout, 8, 8, 0, 8, 0, 8) == [(0, 0, 64)]  # whole block to whole block: one run


def test_offsets_that_are_not_a_permutation_are_refused() -> None:
    with pytest.raises(ValueError, match="not a permutation"):
        classify([[0, 1], [1, 2]], 2)


@settings(max_examples=150, deadline=None)
@given(layout=layouts(), tiles_p=st.integers(2, 5), tiles_d=st.integers(2, 5), element_bytes=st.sampled_from([1, 2]),
       data=st.data())
def test_runs_copy_every_element_of_a_token_range_between_block_sizes(layout, tiles_p, tiles_d, element_bytes,
                                                                       data) -> None:
    elements, group, tile, inside = layout
    p_block, d_block = tile * tiles_p, tile * tiles_d
    p_offsets = offsets_for(p_block, elements, group, tile, inside)
    d_offsets = offsets_for(d_block, elements, group, tile, inside)
    found_p, found_d = classify(p_offsets, element_bytes), classify(d_offsets, element_bytes)
    assert found_p == found_d  # the layout is a property of the kernel, not of the block size
    n = tile * data.draw(st.integers(1, min(tiles_p, tiles_d)))
    p_start = tile * data.draw(st.integers(0, tiles_p - n // tile))
    d_start = tile * data.draw(st.integers(0, tiles_d - n // tile))
    row = elements * element_bytes
    remote = {}  # byte offset in P's part -> (token, element, byte)
    for t in range(p_block):
        for e in range(elements):
            for b in range(element_bytes):
                remote[p_offsets[t][e] * element_bytes + b] = (t, e, b)
    local: dict[int, tuple[int, int, int]] = {}
    for l_off, r_off, length in part_runs(found_d, row, d_block, d_start, p_block, p_start, n):
        for k in range(length):
            assert l_off + k not in local, "a byte written twice"
            local[l_off + k] = remote[r_off + k]
    want = {d_offsets[d_start + i][e] * element_bytes + b: (p_start + i, e, b)
            for i in range(n) for e in range(elements) for b in range(element_bytes)}
    assert local == want


def test_a_token_range_off_the_tiles_is_refused() -> None:
    layout = PartLayout(group=0, tile=16, element_bytes=2, digest="16x4:x")
    with pytest.raises(ValueError, match="split a part"):
        part_runs(layout, 8, 64, 8, 32, 0, 16)
