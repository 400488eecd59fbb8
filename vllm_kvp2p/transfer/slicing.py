"""Descriptors for pulls that are not block-for-block copies: a subset of KV heads (unequal TP) and/or blocks of a
different size on each side (P and D ``block_size`` differ, one dividing the other).

A block of one plane is seen as a grid of cells, one per (KV head, token), each ``inner_bytes`` long and
contiguous. :class:`BlockShape` says in which order the cells lie (head-major ``[heads][tokens]`` as on vLLM's
CPU backend, or token-major ``[tokens][heads]`` as on NPU); cells are enumerated in the local memory order and
merged into one descriptor whenever they are adjacent on *both* sides. With the same shape on both sides and all
heads, this gives the same runs as :func:`~vllm_kvp2p.transfer.descriptors.build_descriptors`, which stays the
fast path for that case. Pulled heads always land in their final place, so no reordering pass is needed after the
reads, whatever the layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from vllm_kvp2p.transfer.descriptors import Descriptors, PlaneGeometry


class BlockShape(msgspec.Struct, frozen=True, array_like=True):
    """The inside of one block of one plane."""

    head_major: bool  # cells ordered [head][token] (True) or [token][head] (False)
    num_heads: int  # KV heads this rank holds in this plane (1 for an MLA latent cache)
    num_tokens: int  # tokens per block (the block size)
    inner_bytes: int  # bytes of one (head, token) cell

    @property
    def block_bytes(self) -> int:
        return self.num_heads * self.num_tokens * self.inner_bytes

    def cell_offset(self, head: int, token: int) -> int:
        if self.head_major:
            return (head * self.num_tokens + token) * self.inner_bytes
        return (token * self.num_heads + head) * self.inner_bytes


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
    """Copy heads ``[remote_head, +num_heads)`` of the remote planes into ``[local_head, +num_heads)`` locally,
    for every token chunk, plane by plane."""
    if not (len(local_planes) == len(local_shapes) == len(remote_planes) == len(remote_shapes)):
        raise ValueError(f"{len(local_planes)} local planes but {len(remote_planes)} remote planes")
    out = Descriptors([], [], [])
    for i, (lp, ls, rp, rs) in enumerate(zip(local_planes, local_shapes, remote_planes, remote_shapes)):
        if ls.inner_bytes != rs.inner_bytes:
            raise ValueError(f"plane {i}: local head row is {ls.inner_bytes} B, remote {rs.inner_bytes} B")
        if local_head + num_heads > ls.num_heads or remote_head + num_heads > rs.num_heads:
            raise ValueError(
                f"plane {i}: heads [{remote_head}, +{num_heads}) -> [{local_head}, +{num_heads}) exceed "
                f"{rs.num_heads} remote / {ls.num_heads} local heads"
            )
        cell = ls.inner_bytes
        la, ra, ln = out.local_addrs, out.remote_addrs, out.lengths
        for c in chunks:
            _check_block(lp, c.local_block, "local", i)
            _check_block(rp, c.remote_block, "remote", i)
            lbase = lp.base_addr + c.local_block * lp.block_stride
            rbase = rp.base_addr + c.remote_block * rp.block_stride
            if ls.head_major:
                cells = ((h, t) for h in range(num_heads) for t in range(c.num_tokens))
            else:
                cells = ((h, t) for t in range(c.num_tokens) for h in range(num_heads))
            for h, t in cells:
                l_addr = lbase + ls.cell_offset(local_head + h, c.local_token + t)
                r_addr = rbase + rs.cell_offset(remote_head + h, c.remote_token + t)
                if ln and la[-1] + ln[-1] == l_addr and ra[-1] + ln[-1] == r_addr and _same_plane(lp, la[-1], l_addr):
                    ln[-1] += cell
                else:
                    la.append(l_addr)
                    ra.append(r_addr)
                    ln.append(cell)
    return out


def _check_block(plane: PlaneGeometry, block: int, side: str, index: int) -> None:
    if not 0 <= block < plane.num_blocks:
        raise ValueError(f"{side} block id {block} out of range for plane {index} with {plane.num_blocks} blocks")


def _same_plane(plane: PlaneGeometry, start: int, addr: int) -> bool:
    # Runs are merged within the plane just written to only (planes are appended one after another).
    return plane.base_addr <= start and addr < plane.base_addr + plane.num_blocks * plane.block_stride
