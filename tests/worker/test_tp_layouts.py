"""Worker level, every parallel layout: several P ranks and several D ranks in one process, each with its own real
Mooncake engine (TCP on 127.0.0.1), hold service and pull loop; ranks hold different ``num_blocks``. After a pull,
every byte of every pulled block on every D rank must equal what P holds for those tokens and heads, and every P
rank must have freed the request once all the D ranks told to expect have released it."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from tests.support.ports import free_port_run
from vllm_kvp2p.hold_service import HoldService
from vllm_kvp2p.lifecycle.consumer import PullPlan
from vllm_kvp2p.lifecycle.pull import LocalKV, Outcome
from vllm_kvp2p.protocol import RankRegistration, RemotePrefill
from vllm_kvp2p.pull_loop import PullLoop
from vllm_kvp2p.tp_mapping import Layout
from vllm_kvp2p.transfer.engine import MooncakeEngine
from vllm_kvp2p.transfer.layout import TensorView, kv_geometry

LAYERS, HEAD_DIM = 2, 8
ARENA_BYTES = 8 << 20


@dataclass
class Rank:
    engine: MooncakeEngine
    arena: torch.Tensor  # registered once; each layout carves its KV tensors out of it

    def carve(self, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
        out, offset = [], 0
        for shape in shapes:
            n = 1
            for s in shape:
                n *= s
            out.append(self.arena[offset : offset + n].view(shape))
            offset += n + 64  # a gap: tensors are separate planes
        assert offset * 4 <= ARENA_BYTES
        return out


@pytest.fixture(scope="module")
def ranks() -> Iterator[tuple[list[Rank], list[Rank]]]:
    made: list[Rank] = []
    try:
        for _ in range(8):
            engine = MooncakeEngine("127.0.0.1", "tcp", transfer_timeout=5)
            arena = torch.zeros(ARENA_BYTES // 4, dtype=torch.float32)
            engine.register([(arena.data_ptr(), ARENA_BYTES)])
            made.append(Rank(engine, arena))
        yield made[:4], made[4:]
    finally:
        for r in made:
            r.engine.close()


def _views(tensors: list[torch.Tensor]) -> list[tuple[str, list[TensorView]]]:
    return [(f"layer.{i}", [TensorView(t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.element_size())])
            for i, t in enumerate(tensors)]


def run_layout(ranks, p_tp: int, d_tp: int, *, heads: int, mla: bool, p_bs: int, d_bs: int, n_tokens: int,
               first_token: int = 0) -> None:
    p_ranks, d_ranks = ranks
    p_layout, d_layout = Layout(p_tp, heads, mla), Layout(d_tp, heads, mla)
    engine_id, req = "P-" + uuid.uuid4().hex[:6], "req-" + uuid.uuid4().hex[:6]
    g = torch.Generator().manual_seed(p_tp * 100 + d_tp)
    inner = HEAD_DIM * (1 if mla else 2)  # MLA: one latent vector; else K and V packed (vLLM's CPU layout)
    max_blocks = 64
    # One "global" cache per layer: (blocks, heads, tokens, inner); every rank holds its heads of it, so replicas of a
    # head are identical, as on a real TP engine.
    truth = [torch.randn(max_blocks, heads, p_bs, inner, generator=g) for _ in range(LAYERS)]

    def shape(layout: Layout, nb: int, bs: int) -> tuple[int, ...]:
        return (nb, bs, inner) if mla else (nb, layout.heads_per_rank, bs, inner)

    p_num_blocks = [40 + 3 * r for r in range(p_tp)]  # ranks of one engine differ in block count
    holds, p_tensors = [], []
    base_port = free_port_run(p_tp)  # P rank r listens on base_port + r
    for r in range(p_tp):
        tensors = p_ranks[r].carve([shape(p_layout, p_num_blocks[r], p_bs)] * LAYERS)
        for t, full in zip(tensors, truth):
            hs = p_layout.heads_of(r)
            src = full[: p_num_blocks[r], hs.start : hs.stop]
            t.copy_(src[:, 0] if mla else src)
        planes, shapes = kv_geometry(_views(tensors), p_num_blocks[r], p_bs, p_layout.heads_per_rank)
        reg = RankRegistration(engine_id, r, p_tp, p_ranks[r].engine.segment, planes, shapes,
                               [f"layer.{i}" for i in range(LAYERS)], p_bs, p_num_blocks[r], "float32",
                               p_layout.heads_per_rank, heads, HEAD_DIM, use_mla=mla)
        # D addresses P rank r at base_port + r, as P's worker r listens in a real engine.
        holds.append(HoldService(reg, "127.0.0.1", base_port + r, hold_timeout=30, lease_timeout=30))
        p_tensors.append(tensors)
    try:
        total = first_token + n_tokens
        p_ids = list(range(37, 37 - -(-total // p_bs), -1))  # descending: no run merging on P's side
        for hs in holds:
            hs.hold(req, "hold-1")
        first, offset = divmod(first_token, p_bs)
        remote = RemotePrefill(engine_id, req, "127.0.0.1", base_port, [list(p_ids)], "hold-1", total, p_bs,
                               tp_size=p_tp)
        loops, d_tensors, d_ids_of = [], [], []
        for d in range(d_tp):
            nb = 30 + d
            tensors = d_ranks[d].carve([shape(d_layout, nb, d_bs)] * LAYERS)
            for t in tensors:
                t.fill_(-7.0)
            planes, shapes = kv_geometry(_views(tensors), nb, d_bs, d_layout.heads_per_rank)
            local = LocalKV(tuple(planes), tuple(shapes), d_bs, tuple(f"layer.{i}" for i in range(LAYERS)),
                            "float32", heads, mla)
            loop = PullLoop(d_ranks[d].engine, reader=f"D:{d}", tp_size=d_tp, tp_rank=d, local=local,
                            side_channel_timeout=3, claim_wait=2, max_batch_entries=64)
            d_ids = list(range(2, 2 + -(-n_tokens // d_bs)))
            remote_ids = tuple(p_ids[first:]) if p_bs != d_bs else tuple(p_ids[first : first + len(d_ids)])
            loop.submit(PullPlan(f"d{d}-{req}", remote, (tuple(d_ids),), (tuple(remote_ids),), True,
                                 remote_token_offset=offset))
            loops.append(loop)
            d_tensors.append(tensors)
            d_ids_of.append(d_ids)
        for d, loop in enumerate(loops):
            deadline, results = time.monotonic() + 30, []
            while not results and time.monotonic() < deadline:
                results = loop.take_results()
                time.sleep(0.01)
            assert results, f"D rank {d} got no result"
            result = results[0].result
            assert result.outcome is Outcome.PULLED, result.reason
            loop.close()
        # every byte: D rank d, layer l, token pos, its local head j == P's data for that global head at pos
        for d in range(d_tp):
            d_heads = d_layout.heads_of(d)
            for layer, t in enumerate(d_tensors[d]):
                for tok in range(n_tokens):
                    pos = first_token + tok
                    blk, off = d_ids_of[d][tok // d_bs], tok % d_bs
                    for j, gh in enumerate(d_heads):
                        want = truth[layer][p_ids[pos // p_bs], gh, pos % p_bs]
                        got = t[blk, off] if mla else t[blk, j, off]
                        assert torch.equal(got, want), (d, layer, tok, j)
                # blocks D did not ask for are untouched
                untouched = [b for b in range(30 + d) if b not in d_ids_of[d]]
                assert bool((t[untouched] == -7.0).all())
        deadline = time.monotonic() + 10
        freed = [set() for _ in holds]
        while time.monotonic() < deadline and not all(req in f for f in freed):
            for i, hs in enumerate(holds):
                freed[i] |= hs.take_freed()
            time.sleep(0.02)
        assert all(req in f for f in freed), f"P ranks not all released: {freed}"
    finally:
        for hs in holds:
            hs.close()


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (2, 1), (1, 2), (4, 2), (2, 4)])
def test_gqa_tp_pairs(ranks, p_tp: int, d_tp: int) -> None:
    run_layout(ranks, p_tp, d_tp, heads=4, mla=False, p_bs=16, d_bs=16, n_tokens=70)


def test_replicated_kv_heads(ranks) -> None:
    run_layout(ranks, 4, 2, heads=2, mla=False, p_bs=16, d_bs=16, n_tokens=40)  # P ranks hold 1 head, 2 replicas


def test_mla_each_d_rank_reads_one_p_rank(ranks) -> None:
    run_layout(ranks, 4, 2, heads=1, mla=True, p_bs=16, d_bs=16, n_tokens=50)


@pytest.mark.parametrize(("p_bs", "d_bs", "first_token"), [(16, 32, 32), (32, 16, 16), (8, 32, 0)])
def test_block_size_mismatch(ranks, p_bs: int, d_bs: int, first_token: int) -> None:
    run_layout(ranks, 2, 1, heads=4, mla=False, p_bs=p_bs, d_bs=d_bs, n_tokens=45, first_token=first_token)
