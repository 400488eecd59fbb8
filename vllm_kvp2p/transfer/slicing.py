"""Descriptors for pulls that are not block-for-block copies: a subset of KV heads (unequal TP) and/or blocks of a
different size on each side (P and D ``block_size`` differ, one dividing the other).

A block of one plane is seen as a grid of *rows* (a KV head, or one part of a head's data) by tokens, each cell
``inner_bytes`` long and contiguous. :class:`BlockShape` says how the cells lie, as the attention backend that
owns the memory reads them (never as the tensor's shape alone suggests):

* head-major, ``[heads][parts][tokens][inner]``: vLLM's CPU backend. Its tensor is ``[heads, tokens, 2 x head]``
  but it reads each head's block as all its K rows, then all its V rows (``parts`` = 2): a token's K and V are
  not side by side, so a piece of a block in tokens is two runs per head, not one;
* token-major, ``[tokens][heads][parts][inner]``: vllm-ascend's separate K and V tensors ``[tokens, heads, head]``
  and MLA latent rows (one head, ``parts`` = 1).

Cells are enumerated in the local memory order and merged into one descriptor whenever they are adjacent on
*both* sides. With the same shape on both sides and all heads, this gives the same runs as
:func:`~vllm_kvp2p.transfer.descriptors.build_descriptors`, which stays the fast path for that case. Pulled
heads always land in their final place, so no reordering pass is needed after the reads, whatever the layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated

import msgspec

from vllm_kvp2p.transfer.descriptors import Descriptors, PlaneGeometry
from vllm_kvp2p.transfer.interior import ROWS, PartLayout, part_runs

#: Rows per head: K and V (vLLM's CPU backend); peers send ``layouts`` (registrations), one per part.
MAX_PARTS = 2


class BlockShape(msgspec.Struct, frozen=True, array_like=True):
    """The inside of one block of one plane."""

    head_major: bool  # cells ordered [head][part][token] (True) or [token][head][part] (False)
    # Peers send block shapes (registrations): every value in a range no real layout leaves.
    num_heads: Annotated[int, msgspec.Meta(ge=1, le=1 << 16)]  # KV heads this rank holds here (1: an MLA latent)
    num_tokens: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]  # tokens per block (the block size)
    inner_bytes: Annotated[int, msgspec.Meta(ge=1, le=1 << 40)]  # bytes of one (head, part, token) cell
    # rows per head: 2 where a head's K and V are separate runs of tokens (vLLM's CPU backend)
    parts: Annotated[int, msgspec.Meta(ge=1, le=MAX_PARTS)] = 1
    # How each part lays out its tokens x bytes (vllm_kvp2p/transfer/interior.py), one per part; empty: all rows.
    layouts: Annotated[tuple[PartLayout, ...], msgspec.Meta(max_length=MAX_PARTS)] = ()

    def part_layout(self, part: int) -> PartLayout:
        return self.layouts[part] if self.layouts else ROWS

    @property
    def all_rows(self) -> bool:
        return all(layout == ROWS for layout in self.layouts)

    @property
    def num_rows(self) -> int:
        return self.num_heads * self.parts

    @property
    def block_bytes(self) -> int:
        return self.num_rows * self.num_tokens * self.inner_bytes

    def cell_offset(self, row: int, token: int) -> int:
        """Where the cell of ``row`` (``head * parts + part``) and ``token`` starts within the block."""
        if self.head_major:
            return (row * self.num_tokens + token) * self.inner_bytes
        return (token * self.num_rows + row) * self.inner_bytes

    def describe(self) -> str:
        order = "[heads][parts][tokens]" if self.head_major else "[tokens][heads][parts]"
        layouts = "" if self.all_rows else " (" + "; ".join(layout.describe() for layout in self.layouts) + ")"
        return (f"{order} with {self.num_heads} heads x {self.parts} parts x {self.num_tokens} tokens of "
                f"{self.inner_bytes} B{layouts}")


@dataclass(frozen=True)
class TokenChunk:
    """Tokens ``[local_token, local_token + num_tokens)`` of local block ``local_block`` hold the same positions
    as ``[remote_token, ...)`` of remote block ``remote_block``."""

    local_block: int
    local_token: int
    remote_block: int
    remote_token: int
    num_tokens: int


def token_chunks(
    local_ids: Sequence[int],
    local_block_size: int,
    remote_ids: Sequence[int],
    remote_block_size: int,
    remote_offset: int,
) -> list[TokenChunk]:
    """Pair the tokens of ``local_ids`` (starting at token 0 of ``local_ids[0]``) with those of ``remote_ids``
    (starting at token ``remote_offset`` of ``remote_ids[0]``), in runs that stay inside one block on each side.
    Stops where either list runs out: trailing positions past the prompt are copied harmlessly (D writes them)."""
    if not 0 <= remote_offset < remote_block_size:
        raise ValueError(f"remote_offset {remote_offset} outside a block of {remote_block_size} tokens")
    end = min(len(local_ids) * local_block_size, len(remote_ids) * remote_block_size - remote_offset)
    chunks: list[TokenChunk] = []
    t = 0
    while t < end:
        li, lo = divmod(t, local_block_size)
        ri, ro = divmod(t + remote_offset, remote_block_size)
        n = min(local_block_size - lo, remote_block_size - ro, end - t)
        chunks.append(TokenChunk(local_ids[li], lo, remote_ids[ri], ro, n))
        t += n
    return chunks


def build_sliced_descriptors(
    local_planes: Sequence[PlaneGeometry],
    local_shapes: Sequence[BlockShape],
    remote_planes: Sequence[PlaneGeometry],
    remote_shapes: Sequence[BlockShape],
    chunks: Sequence[TokenChunk],
    local_head: int,
    remote_head: int,
    num_heads: int,
) -> Descriptors:
    """Copy heads ``[remote_head, +num_heads)`` of the remote planes into ``[local_head, +num_heads)`` locally
    (every part of each head), for every token chunk, plane by plane."""
    if not (len(local_planes) == len(local_shapes) == len(remote_planes) == len(remote_shapes)):
        raise ValueError(f"{len(local_planes)} local planes but {len(remote_planes)} remote planes")
    out = Descriptors([], [], [])
    for i, (lp, ls, rp, rs) in enumerate(zip(local_planes, local_shapes, remote_planes, remote_shapes)):
        if ls.inner_bytes != rs.inner_bytes:
            raise ValueError(f"plane {i}: local head row is {ls.inner_bytes} B, remote {rs.inner_bytes} B")
        if ls.parts != rs.parts:
            raise ValueError(f"plane {i}: local blocks hold {ls.parts} parts per head, remote {rs.parts}")
        if local_head + num_heads > ls.num_heads or remote_head + num_heads > rs.num_heads:
            raise ValueError(
                f"plane {i}: heads [{remote_head}, +{num_heads}) -> [{local_head}, +{num_heads}) exceed "
                f"{rs.num_heads} remote / {ls.num_heads} local heads"
            )
        if ls.layouts != rs.layouts and not (ls.all_rows and rs.all_rows):
            raise ValueError(f"plane {i}: local blocks are {ls.describe()}, remote {rs.describe()}")
        for c in chunks:
            _check_block(lp, c.local_block, "local", i)
            _check_block(rp, c.remote_block, "remote", i)
        if ls.head_major and rs.head_major:
            _head_major_runs(out, lp, ls, rp, rs, chunks, local_head, remote_head, num_heads)
        elif ls.all_rows and rs.all_rows:
            _cells(out, lp, ls, rp, rs, chunks, local_head, remote_head, num_heads)
        else:
            raise ValueError(f"plane {i}: cannot pair {ls.describe()} with {rs.describe()}")
    return out


def _head_major_runs(out: Descriptors, lp: PlaneGeometry, ls: BlockShape, rp: PlaneGeometry, rs: BlockShape,
                     chunks: Sequence[TokenChunk], local_head: int, remote_head: int, num_heads: int) -> None:
    """Both sides ``[heads][parts][tokens]``: each part of each head is a region of its own, copied with the runs
    its layout gives for the chunk's tokens (one for rows, one per column group otherwise)."""
    row_bytes = ls.inner_bytes
    local_part, remote_part = ls.num_tokens * row_bytes, rs.num_tokens * row_bytes
    runs_of: dict[tuple[int, int, int, int], list[tuple[int, int, int]]] = {}  # chunks repeat a few shapes
    for c in chunks:
        lbase = lp.base_addr + c.local_block * lp.block_stride
        rbase = rp.base_addr + c.remote_block * rp.block_stride
        for r in range(num_heads * ls.parts):  # a head's parts are consecutive rows on both sides
            part = r % ls.parts
            key = (part, c.local_token, c.remote_token, c.num_tokens)
            runs = runs_of.get(key)
            if runs is None:
                runs = runs_of[key] = part_runs(ls.part_layout(part), row_bytes, ls.num_tokens, c.local_token,
                                                rs.num_tokens, c.remote_token, c.num_tokens)
            l_row = lbase + (local_head * ls.parts + r) * local_part
            r_row = rbase + (remote_head * rs.parts + r) * remote_part
            for l_off, r_off, n in runs:
                _append(out, lp, l_row + l_off, r_row + r_off, n)


def _cells(out: Descriptors, lp: PlaneGeometry, ls: BlockShape, rp: PlaneGeometry, rs: BlockShape,
           chunks: Sequence[TokenChunk], local_head: int, remote_head: int, num_heads: int) -> None:
    """Plain rows on both sides, in any order of heads and tokens: cell by cell, in the local memory order."""
    cell = ls.inner_bytes
    rows = num_heads * ls.parts
    for c in chunks:
        lbase = lp.base_addr + c.local_block * lp.block_stride
        rbase = rp.base_addr + c.remote_block * rp.block_stride
        if ls.head_major:
            cells = ((r, t) for r in range(rows) for t in range(c.num_tokens))
        else:
            cells = ((r, t) for t in range(c.num_tokens) for r in range(rows))
        for r, t in cells:
            l_addr = lbase + ls.cell_offset(local_head * ls.parts + r, c.local_token + t)
            r_addr = rbase + rs.cell_offset(remote_head * rs.parts + r, c.remote_token + t)
            _append(out, lp, l_addr, r_addr, cell)


def _append(out: Descriptors, lp: PlaneGeometry, l_addr: int, r_addr: int, n: int) -> None:
    """One more run, merged into the last one when it continues it on both sides (within the local plane)."""
    la, ra, ln = out.local_addrs, out.remote_addrs, out.lengths
    if ln and la[-1] + ln[-1] == l_addr and ra[-1] + ln[-1] == r_addr and _same_plane(lp, la[-1], l_addr):
        ln[-1] += n
    else:
        la.append(l_addr)
        ra.append(r_addr)
        ln.append(n)


def _check_block(plane: PlaneGeometry, block: int, side: str, index: int) -> None:
    if not 0 <= block < plane.num_blocks:
        raise ValueError(f"{side} block id {block} out of range for plane {index} with {plane.num_blocks} blocks")


def _same_plane(plane: PlaneGeometry, start: int, addr: int) -> bool:
    # Runs are merged within the plane just written to only (planes are appended one after another).
    return plane.base_addr <= start and addr < plane.base_addr + plane.num_blocks * plane.block_stride
