"""D side: which bytes one pull reads from one P rank. Pure: the transfer descriptors (local address, remote
address, length) for a :class:`~vllm_kvp2p.lifecycle.consumer.PullPlan`, given P rank's registration.

Block for block when both sides lay a block out alike (same block size, whole heads, no token offset): the
merged-runs fast path. Otherwise token by token and head slice by head slice (block sizes that differ, TP that
differs, a prefix D already holds part of), from :mod:`vllm_kvp2p.transfer.slicing`. State groups (linear
attention) are whole pages, rank to rank.
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm_kvp2p.contract.protocol import RankRegistration
from vllm_kvp2p.lifecycle.consumer import PullPlan
from vllm_kvp2p.lifecycle.pull_actions import LocalKV, Source
from vllm_kvp2p.transfer.descriptors import Descriptors, PlaneGeometry, build_descriptors
from vllm_kvp2p.transfer.kv_groups import STATE
from vllm_kvp2p.transfer.slicing import BlockShape, build_sliced_descriptors, token_chunks
from vllm_kvp2p.transfer.tp_mapping import HeadSlice


def read_descriptors(
    plan: PullPlan, local: LocalKV, source: Source, reg: RankRegistration, pairs: Sequence[tuple[int, int]]
) -> Descriptors:
    """Each KV-cache group's planes with that group's block ids (one group: all planes); ``pairs`` are the
    (D plane, P plane) pairs of the layers both hold (raises ``ValueError`` for blocks that cannot be addressed)."""
    local_of = local.group_of_planes()
    groups = local.kv_groups()
    out = Descriptors([], [], [])
    for g, (local_ids, remote_ids) in enumerate(zip(plan.local_block_ids, plan.remote_block_ids)):
        if not local_ids:
            continue
        # The planes of the layers both hold (every plane without pipeline stages); groups match per pair.
        mine = [d for d, _ in pairs if local_of[d] == g]
        theirs = [q for d, q in pairs if local_of[d] == g]
        if groups[g].kind == STATE:  # whole state pages, rank to rank (same TP on both sides, checked)
            d = build_descriptors([local.planes[i] for i in mine], [reg.planes[i] for i in theirs],
                                  local_ids, remote_ids)
        else:
            d = _group_descriptors(
                plan, local, source, reg, [local.planes[i] for i in mine], tuple(local.shapes[i] for i in mine),
                [reg.planes[i] for i in theirs], tuple(reg.block_shapes[i] for i in theirs), local_ids, remote_ids,
            )
        _extend(out, d)
    return out


def _group_descriptors(
    plan: PullPlan, local: LocalKV, source: Source, reg: RankRegistration, local_planes: list[PlaneGeometry],
    local_shapes: tuple[BlockShape, ...], remote_planes: list[PlaneGeometry],
    remote_shapes: tuple[BlockShape, ...], local_ids: Sequence[int], remote_ids: Sequence[int],
) -> Descriptors:
    whole_blocks = (
        len(source.slices) == 1
        and reg.block_size == local.block_size
        and plan.remote_token_offset == 0
        and remote_shapes == local_shapes
        and all(source.slices[0] == HeadSlice(source.p_rank, 0, 0, sh.num_heads) for sh in local_shapes)
    )
    if whole_blocks:  # block for block: the merged-runs fast path (C++ when built)
        return build_descriptors(local_planes, remote_planes, local_ids, remote_ids)
    chunks = token_chunks(local_ids, local.block_size, remote_ids, reg.block_size, plan.remote_token_offset)
    out = Descriptors([], [], [])
    for s in source.slices:
        _extend(out, build_sliced_descriptors(local_planes, local_shapes, remote_planes, remote_shapes, chunks,
                                              s.local_head, s.remote_head, s.num_heads))
    return out


def _extend(out: Descriptors, d: Descriptors) -> None:
    out.local_addrs.extend(d.local_addrs)
    out.remote_addrs.extend(d.remote_addrs)
    out.lengths.extend(d.lengths)
