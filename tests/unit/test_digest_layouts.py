"""The integrity digest over every layout the connector moves, with the connector's own descriptor builders: P
and D in head-major blocks (vLLM CPU) or token-major rows with K and V in separate planes (NPU), any block sizes,
any TP head slice, a start inside P's first block. D's sums over where its reads landed equal P's sums over the
ranges D names, and one changed byte in what D holds makes them differ."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_kvp2p.lifecycle.integrity import IntegrityMode, verification_for
from vllm_kvp2p.transfer.descriptors import PlaneGeometry
from vllm_kvp2p.transfer.digest import Runs, digest_runs
from vllm_kvp2p.transfer.slicing import BlockShape, build_sliced_descriptors, token_chunks

INNER = 8  # bytes per (head, token) cell
P_BASE, D_BASE = 1 << 16, 1 << 24


def side(num_blocks: int, heads: int, tokens: int, head_major: bool, n_planes: int, base: int):
    shape = BlockShape(head_major, heads, tokens, INNER)
    block = shape.block_bytes
    planes = [PlaneGeometry(base + i * (num_blocks * block + 64), block, block, num_blocks) for i in range(n_planes)]
    return planes, [shape] * n_planes, planes[-1].base_addr + num_blocks * block - base


def sums(memory: torch.Tensor, base: int, runs: list[tuple[int, int, int, int]], units: int):
    table = Runs([a - base for a, _, _, _ in runs], [o for _, o, _, _ in runs], [n for _, _, n, _ in runs],
                 [u for _, _, _, u in runs])
    total, weighted = digest_runs(memory, table, units)
    return list(zip(total.tolist(), weighted.tolist()))


@settings(max_examples=40, deadline=None)
@given(p_bs_exp=st.integers(0, 2), d_bs_exp=st.integers(0, 2), p_heads=st.sampled_from([1, 2, 4]),
       d_heads=st.sampled_from([1, 2, 4]), p_major=st.booleans(), d_major=st.booleans(),
       split_kv=st.booleans(), n_tokens=st.integers(1, 40), data=st.data())
def test_d_sums_equal_p_sums_on_every_layout_and_one_byte_breaks_them(p_bs_exp, d_bs_exp, p_heads, d_heads,
                                                                       p_major, d_major, split_kv, n_tokens,
                                                                       data) -> None:
    p_bs, d_bs = 4 << p_bs_exp, 4 << d_bs_exp
    n_heads = min(p_heads, d_heads)
    remote_head = data.draw(st.integers(0, p_heads - n_heads))
    local_head = data.draw(st.integers(0, d_heads - n_heads))
    planes = 2 if split_kv else 1  # NPU: K and V are separate planes
    p_planes, p_shapes, p_size = side(16, p_heads, p_bs, p_major, planes, P_BASE)
    d_planes, d_shapes, d_size = side(16, d_heads, d_bs, d_major, planes, D_BASE)
    offset = data.draw(st.integers(0, p_bs - 1))  # D's prompt starts inside P's first block (D's own hit before)
    p_ids = data.draw(st.permutations(range(16)))[: -(-(offset + n_tokens) // p_bs)]
    d_ids = data.draw(st.permutations(range(16)))[: -(-n_tokens // d_bs)]
    chunks = token_chunks(d_ids, d_bs, p_ids, p_bs, offset)
    desc = build_sliced_descriptors(d_planes, d_shapes, p_planes, p_shapes, chunks, local_head, remote_head, n_heads)
    p_mem = torch.randint(0, 256, (p_size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n_tokens))
    d_mem = torch.zeros(d_size, dtype=torch.uint8)
    for la, ra, n in zip(desc.local_addrs, desc.remote_addrs, desc.lengths):  # the reads, as Mooncake does them
        d_mem[la - D_BASE : la - D_BASE + n] = p_mem[ra - P_BASE : ra - P_BASE + n]

    v = verification_for(desc, p_planes, IntegrityMode.FULL, seed=0)
    assert v is not None
    p_runs = [(p_planes[u.plane].base_addr + u.block * p_planes[u.plane].block_stride + off, off, n, i)
              for i, u in enumerate(v.query.units) for off, n in zip(u.ranges[::2], u.ranges[1::2])]
    d_runs = [(r.addr, r.offset, r.length, r.unit) for r in v.local_runs]
    theirs, mine = sums(p_mem, P_BASE, p_runs, len(v.query.units)), sums(d_mem, D_BASE, d_runs, len(v.query.units))
    assert mine == theirs
    assert sum(n for _, _, n, _ in d_runs) == sum(desc.lengths)  # every byte read is covered, once

    where = data.draw(st.sampled_from(d_runs))
    byte = where[0] - D_BASE + data.draw(st.integers(0, where[2] - 1))
    d_mem[byte] ^= 1 << data.draw(st.integers(0, 7))
    assert sums(d_mem, D_BASE, d_runs, len(v.query.units)) != theirs
