"""Worker level, every parallel layout: several P ranks and several D ranks in one process, each with its own real
Mooncake engine (TCP on 127.0.0.1), hold service and pull loop; ranks hold different ``num_blocks``.

The KV tensors have the shape the installed vLLM allocates on CPU and hold what vLLM's CPU attention kernel writes
(tests/support/vllm_cpu_kv.py: its own write op, ISA choice and view); each engine's block layout is what the CPU
platform reads off that kernel at start-up, as a real worker does. The expectation is the kernel's too: after a
pull, every pulled block on every D rank must equal, byte for byte, a block written by the kernel on D's side
with the same tokens at the same positions (heads this rank holds), and blocks not asked for stay untouched;
every P rank frees the request once all the D ranks told to expect have released it. MLA keeps its own layout
(one latent row per token, vLLM's CPU MLA backend writes ``cache.view(-1, latent)[slot]``).

Which KV heads each P and D rank holds (what P's kernel writes there, what D must end up with) is vLLM's own
sharding of the attention weights (tests/worker/vllm_kv_heads.py: ``QKVParallelLinear``'s weight loader), never
``Layout.heads_of``, the code under test; the last tests hold ``Layout`` and tests/unit/test_tp_mapping.py's
hand-written table to it."""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from tests.support.ports import free_port_run
from tests.support.vllm_cpu_kv import kv_shape, write_tokens
from tests.worker.vllm_kv_heads import vllm_kv_heads, vllm_kv_heads_by_rank
from vllm_kvp2p.contract.protocol import RankRegistration, RemotePrefill
from vllm_kvp2p.decode.pull_loop import PullLoop
from vllm_kvp2p.lifecycle.consumer import PullPlan
from vllm_kvp2p.lifecycle.integrity import IntegrityMode
from vllm_kvp2p.lifecycle.pull import LocalKV, Outcome
from vllm_kvp2p.lifecycle.rank_table import table_of
from vllm_kvp2p.platform.cpu import CpuPlatform
from vllm_kvp2p.prefill.hold_service import HoldService
from vllm_kvp2p.transfer.digest import KVMemory, sums_of_units
from vllm_kvp2p.transfer.engine import MooncakeEngine
from vllm_kvp2p.transfer.layout import TensorView, kv_geometry
from vllm_kvp2p.transfer.tp_mapping import Layout

LAYERS, HEAD_DIM, MLA_LATENT = 2, 32, 48
ARENA_BYTES = 8 << 20
PLATFORM = CpuPlatform()


@dataclass
class Rank:
    engine: MooncakeEngine
    arena: torch.Tensor  # bytes, registered once; each layout carves its KV tensors out of it

    def carve(self, shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
        out, offset = [], 0
        size = torch.empty((), dtype=dtype).element_size()
        for shape in shapes:
            n = size
            for s in shape:
                n *= s
            out.append(self.arena[offset : offset + n].view(dtype).view(shape))
            offset += n + 256  # a gap: tensors are separate planes
        assert offset <= ARENA_BYTES
        return out


def _ranks_on(p_hosts: tuple[str, ...], d_hosts: tuple[str, ...]) -> Iterator[tuple[list[Rank], list[Rank]]]:
    """P ranks and D ranks, each with its own Mooncake engine on the given host and one registered arena."""
    made: list[Rank] = []
    try:
        for host in (*p_hosts, *d_hosts):
            engine = MooncakeEngine(host, "tcp", transfer_timeout=5)
            arena = torch.zeros(ARENA_BYTES, dtype=torch.uint8)
            engine.register([(arena.data_ptr(), ARENA_BYTES)])
            made.append(Rank(engine, arena))
        yield made[:len(p_hosts)], made[len(p_hosts):]
    finally:
        for r in made:
            r.engine.close()


@pytest.fixture(scope="module")
def ranks() -> Iterator[tuple[list[Rank], list[Rank]]]:
    yield from _ranks_on(("127.0.0.1",) * 4, ("127.0.0.1",) * 4)


def _views(tensors: list[torch.Tensor]) -> list[tuple[str, list[TensorView]]]:
    return [(f"layer.{i}", [TensorView(t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.element_size())])
            for i, t in enumerate(tensors)]


def _geometry(tensors: list[torch.Tensor], num_blocks: int, block_size: int, heads: int, mla: bool, dtype):
    layouts = () if mla else PLATFORM.attention_part_layouts(dtype, block_size, HEAD_DIM, "auto")
    return kv_geometry(_views(tensors), num_blocks, block_size, heads, head_size=HEAD_DIM,
                       interior=PLATFORM.attention_interior, part_layouts=layouts)


class Truth:
    """The K, V (or MLA latent) of every prompt position and global head, written through vLLM's kernel."""

    def __init__(self, positions: int, heads: int, mla: bool, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.mla = mla
        self.key = torch.randn(positions, heads, HEAD_DIM, generator=g)
        self.value = torch.randn(positions, heads, HEAD_DIM, generator=g)
        self.latent = torch.randn(positions, MLA_LATENT, generator=g)

    def write(self, cache: torch.Tensor, block_ids: list[int], block_size: int, positions: range,
              first_position: int, heads: tuple[int, ...]) -> None:
        """Positions ``positions`` into ``cache``, whose block ``block_ids[i]`` holds positions from
        ``first_position + i * block_size``; ``heads``: the global heads of the cache's heads, in order."""
        slots = [block_ids[(pos - first_position) // block_size] * block_size + (pos - first_position) % block_size
                 for pos in positions]
        rows = list(positions)
        if self.mla:
            cache.view(-1, MLA_LATENT)[slots] = self.latent[rows].to(cache.dtype)
        else:
            write_tokens(cache, slots, self.key[rows][:, list(heads)], self.value[rows][:, list(heads)])


def run_layout(ranks, p_tp: int, d_tp: int, *, heads: int, mla: bool, p_bs: int, d_bs: int, n_tokens: int,
               first_token: int = 0, dtype: torch.dtype = torch.float32, single_host_table: bool = False,
               swap_planned_d_blocks: bool = False) -> None:
    """P rank r listens on its own engine's host (``ranks`` may put P's ranks on several loopback addresses, as an
    engine spanning nodes). ``single_host_table``: P's entry point serves the former single-host assumption (every
    rank on rank 0's host): then no pull succeeds when the ranks are on several hosts. ``swap_planned_d_blocks``:
    the plan names D's first two blocks the wrong way round (a plan bug), the kernel comparison still expects
    them in order."""
    p_ranks, d_ranks = ranks
    engine_id, req = "P-" + uuid.uuid4().hex[:6], "req-" + uuid.uuid4().hex[:6]
    total = first_token + n_tokens
    p_ids = list(range(37, 37 - -(-total // p_bs), -1))  # descending: no run merging on P's side
    truth = Truth(len(p_ids) * p_bs, heads, mla, seed=p_tp * 100 + d_tp)

    def held(tp: int, rank: int) -> tuple[int, ...]:
        """The global KV heads vLLM gives this rank (MLA: the one latent "head", on every rank)."""
        return (0,) if mla else vllm_kv_heads(heads, tp, rank)

    def shape(n_heads: int, nb: int, bs: int) -> tuple[int, ...]:
        return (nb, bs, MLA_LATENT) if mla else kv_shape(nb, bs, n_heads, HEAD_DIM, dtype)

    p_num_blocks = [40 + 3 * r for r in range(p_tp)]  # ranks of one engine differ in block count
    holds = []
    base_port = free_port_run(p_tp)  # P rank r listens on base_port + r
    for r in range(p_tp):
        n_heads = len(held(p_tp, r))
        tensors = p_ranks[r].carve([shape(n_heads, p_num_blocks[r], p_bs)] * LAYERS, dtype)
        for t in tensors:  # every position of every block P offers, as P's forward pass wrote them
            t.zero_()
            truth.write(t, p_ids, p_bs, range(len(p_ids) * p_bs), 0, held(p_tp, r))
        planes, shapes = _geometry(tensors, p_num_blocks[r], p_bs, n_heads, mla, dtype)
        reg = RankRegistration(engine_id, r, p_tp, p_ranks[r].engine.segment, planes, shapes,
                               [f"layer.{i}" for i in range(LAYERS)], p_bs, p_num_blocks[r], str(dtype)[6:],
                               n_heads, heads, HEAD_DIM, use_mla=mla)
        # P rank r listens on its own host at base_port + r, as P's worker r does in a real engine.
        holds.append(HoldService(reg, p_ranks[r].engine.host, base_port + r, hold_timeout=30, lease_timeout=30,
                                 digester=functools.partial(sums_of_units, KVMemory(tensors), planes)))
    entry_host = p_ranks[0].engine.host
    advertised = {r: (entry_host if single_host_table else p_ranks[r].engine.host, base_port + r)
                  for r in range(p_tp)}
    for hs in holds:  # what the ranks gather over vLLM's TP group in a real engine (vllm_kvp2p/connector/worker.py)
        hs.rank_table = table_of(engine_id, "", advertised)
    try:
        for hs in holds:
            hs.hold(req, "hold-1", len(p_ids), [list(p_ids)])
        first, offset = divmod(first_token, p_bs)
        remote = RemotePrefill(engine_id, req, entry_host, base_port, [list(p_ids)], "hold-1", total, p_bs,
                               tp_size=p_tp)
        loops, d_tensors, d_ids_of, ends = [], [], [], []
        for d in range(d_tp):
            nb = 30 + d
            tensors = d_ranks[d].carve([shape(len(held(d_tp, d)), nb, d_bs)] * LAYERS, dtype)
            for t in tensors:
                t.view(torch.uint8).fill_(0x5A)
            planes, shapes = _geometry(tensors, nb, d_bs, len(held(d_tp, d)), mla, dtype)
            local = LocalKV(tuple(planes), tuple(shapes), d_bs, tuple(f"layer.{i}" for i in range(LAYERS)),
                            str(dtype)[6:], heads, mla)
            loop = PullLoop(d_ranks[d].engine, reader=f"D:{d}", tp_size=d_tp, tp_rank=d, local=local,
                            side_channel_timeout=3, claim_wait=2, max_batch_entries=64,
                            integrity=IntegrityMode.FULL, memory=KVMemory(tensors))
            d_ids = list(range(2, 2 + -(-n_tokens // d_bs)))
            remote_ids = tuple(p_ids[first:]) if p_bs != d_bs else tuple(p_ids[first : first + len(d_ids)])
            # What the pull copies: D's blocks from token 0, P's from the offset, until either list ends.
            ends.append(min(len(d_ids) * d_bs, len(remote_ids) * p_bs - offset))
            planned = list(d_ids)
            if swap_planned_d_blocks:
                planned[0], planned[1] = planned[1], planned[0]
            loop.submit(PullPlan(f"d{d}-{req}", remote, (tuple(planned),), (tuple(remote_ids),), True,
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
            if single_host_table:
                assert result.outcome is Outcome.FAILED, result
                loop.close()
                continue
            assert result.outcome is Outcome.PULLED, result.reason
            # every unit D read was summed on both sides and matched, whatever the TP and block sizes cut
            assert result.verified_units > 0 and not result.unverified, result
            loop.close()
        if single_host_table:
            return
        # every byte of every pulled block == the kernel's own write of those positions on D's side (both start
        # from the same filler: the pull writes the pulled positions' bytes and nothing else)
        for d in range(d_tp):
            for layer, t in enumerate(d_tensors[d]):
                want = torch.empty_like(t)
                want.view(torch.uint8).fill_(0x5A)
                truth.write(want, d_ids_of[d], d_bs, range(first_token, first_token + ends[d]), first_token,
                            held(d_tp, d))
                assert first_token + ends[d] >= total
                assert torch.equal(t.view(torch.uint8), want.view(torch.uint8)), (d, layer)
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


@pytest.mark.parametrize(("p_tp", "d_tp", "heads"), [(4, 2, 2), (2, 4, 2), (4, 4, 2), (4, 1, 1), (1, 4, 1)])
def test_replicated_kv_heads(ranks, p_tp: int, d_tp: int, heads: int) -> None:
    """TP above the KV heads on P, on D or both: vLLM gives each rank one head, replicated tp / heads times."""
    run_layout(ranks, p_tp, d_tp, heads=heads, mla=False, p_bs=16, d_bs=16, n_tokens=40)


def test_mla_each_d_rank_reads_one_p_rank(ranks) -> None:
    run_layout(ranks, 4, 2, heads=1, mla=True, p_bs=16, d_bs=16, n_tokens=50)


@pytest.mark.parametrize(("p_bs", "d_bs", "first_token", "dtype"), [
    (16, 32, 32, torch.float32), (32, 16, 16, torch.float32), (32, 64, 0, torch.float32), (64, 32, 64, torch.float32),
    (32, 64, 64, torch.bfloat16), (64, 32, 32, torch.bfloat16),
], ids=["16-32-fp32", "32-16-fp32", "32-64-fp32", "64-32-fp32", "32-64-bf16", "64-32-bf16"])
def test_block_size_mismatch(ranks, p_bs: int, d_bs: int, first_token: int, dtype: torch.dtype) -> None:
    """P TP 2 -> D TP 1 between block sizes, in the layouts vLLM's CPU kernel writes for each dtype on this CPU
    (float32: K element-major; bfloat16 with AMX: 16-token K tiles, V in groups of 16 elements)."""
    run_layout(ranks, 2, 1, heads=4, mla=False, p_bs=p_bs, d_bs=d_bs, n_tokens=45, first_token=first_token,
               dtype=dtype)


def test_block_size_mismatch_at_tp_1(ranks) -> None:
    run_layout(ranks, 1, 1, heads=2, mla=False, p_bs=64, d_bs=32, n_tokens=100, first_token=32)


def test_a_wrong_plan_matches_the_digest_and_fails_the_kernel_comparison(ranks) -> None:
    """What the digest does not prove (docs/reliability.md): with D's destinations of two P blocks swapped, every
    unit is summed where the plan wrote it and matches, so the pull counts as verified; the comparison with the
    kernel's own writes on D is what catches the wrong plan."""
    with pytest.raises(AssertionError, match=r"^\(0, 0\)"):  # D rank 0, layer 0: the kernel comparison
        run_layout(ranks, 1, 1, heads=2, mla=False, p_bs=16, d_bs=16, n_tokens=40, swap_planned_d_blocks=True)


@pytest.fixture(scope="module")
def spread_ranks() -> Iterator[tuple[list[Rank], list[Rank]]]:
    """P's ranks on two "nodes" (127.0.0.2 and 127.0.0.3: each rank's engine, segment and side channel there), as
    an engine spanning hosts; D's on 127.0.0.1."""
    yield from _ranks_on(("127.0.0.2", "127.0.0.3", "127.0.0.2", "127.0.0.3"), ("127.0.0.1", "127.0.0.1"))


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (4, 2), (2, 2)])
def test_p_ranks_on_two_hosts(spread_ranks, p_tp: int, d_tp: int) -> None:
    """Every D rank finds each P rank where the rank table (gathered by P's ranks) says, and reads its segment on
    that rank's host."""
    run_layout(spread_ranks, p_tp, d_tp, heads=4, mla=False, p_bs=16, d_bs=16, n_tokens=70)


def test_single_host_assumption_gets_no_pull_when_ranks_span_hosts(spread_ranks) -> None:
    """The negative control: rank r assumed on the entry point's host (the former rule) reaches nothing there."""
    run_layout(spread_ranks, 2, 1, heads=4, mla=False, p_bs=16, d_bs=16, n_tokens=70, single_host_table=True)


def test_a_far_rank_that_stops_answering_is_probed_itself(spread_ranks) -> None:
    """An engine over two nodes whose far rank stops answering (a ROUTER that accepts and never answers: its node
    cut off from D, or frozen) while the entry point still answers. The first pull pays one side-channel timeout;
    the next one probes that rank (0.5 s) and fails at once, naming it. (Probing the entry point instead, which
    answers, would trust the engine again and pay the timeout on every request.)"""
    import zmq

    from vllm_kvp2p.lifecycle.consumer import Failure

    p_ranks, d_ranks = spread_ranks
    engine_id, heads, bs, timeout = "P-" + uuid.uuid4().hex[:6], 4, 16, 3.0
    per_rank = len(vllm_kv_heads(heads, 2, 0))
    base_port = free_port_run(2)
    tensors = p_ranks[0].carve([kv_shape(40, bs, per_rank, HEAD_DIM, torch.float32)] * LAYERS, torch.float32)
    planes, shapes = _geometry(tensors, 40, bs, per_rank, False, torch.float32)
    reg = RankRegistration(engine_id, 0, 2, p_ranks[0].engine.segment, planes, shapes,
                           [f"layer.{i}" for i in range(LAYERS)], bs, 40, "float32", per_rank, heads, HEAD_DIM)
    entry = HoldService(reg, p_ranks[0].engine.host, base_port, hold_timeout=30, lease_timeout=30)
    entry.rank_table = table_of(engine_id, "", {0: (p_ranks[0].engine.host, base_port),
                                                1: (p_ranks[1].engine.host, base_port + 1)})
    ctx = zmq.Context()
    frozen = ctx.socket(zmq.ROUTER)
    frozen.setsockopt(zmq.LINGER, 0)
    frozen.bind(f"tcp://{p_ranks[1].engine.host}:{base_port + 1}")
    d_tensors = d_ranks[0].carve([kv_shape(30, bs, heads, HEAD_DIM, torch.float32)] * LAYERS, torch.float32)
    d_planes, d_shapes = _geometry(d_tensors, 30, bs, heads, False, torch.float32)
    local = LocalKV(tuple(d_planes), tuple(d_shapes), bs, tuple(f"layer.{i}" for i in range(LAYERS)), "float32",
                    heads, False)
    loop = PullLoop(d_ranks[0].engine, reader="D:0", tp_size=1, tp_rank=0, local=local,
                    side_channel_timeout=timeout, claim_wait=2, max_batch_entries=64, suspect_time=30)

    def pull(req: str) -> tuple[float, object]:
        entry.hold(req, "hold-1", 2)
        remote = RemotePrefill(engine_id, req, p_ranks[0].engine.host, base_port, [[7, 6]], "hold-1", 2 * bs, bs,
                               tp_size=2)
        t0 = time.monotonic()
        loop.submit(PullPlan("d-" + req, remote, ((2, 3),), ((7, 6),), True))
        deadline, results = time.monotonic() + 30, []
        while not results and time.monotonic() < deadline:
            results = loop.take_results()
            time.sleep(0.01)
        assert results, "no result"
        return time.monotonic() - t0, results[0].result

    try:
        took, first = pull("req-1")
        assert first.failure is Failure.UNREACHABLE and "P rank 1" in first.reason, first
        assert first.unreachable_rank == 1 and took < timeout + 1.5, (took, first)
        took, second = pull("req-2")
        assert second.failure is Failure.UNREACHABLE, second
        assert f"{p_ranks[1].engine.host}:{base_port + 1} (P rank 1) did not answer lately" in second.reason, second
        assert took < 1.5, took  # the probe of rank 1, not another side-channel timeout
    finally:
        loop.close()
        entry.close()
        frozen.close(0)
        ctx.term()


# ---------------------------------------------------------------------------------------------------------------
# The head references themselves: vLLM's real sharding against the code under test and against the hand-written
# table of tests/unit/test_tp_mapping.py (a pure module: it cannot ask vLLM, so it is checked here).
# ---------------------------------------------------------------------------------------------------------------

HEAD_CASES = [(k, tp) for k in (1, 2, 4, 8, 16) for tp in (1, 2, 4, 8, 16, 32) if k % tp == 0 or tp % k == 0]


@pytest.mark.parametrize(("total_kv_heads", "tp"), HEAD_CASES)
def test_layout_gives_each_rank_the_heads_vllm_loads_into_it(total_kv_heads: int, tp: int) -> None:
    vllm = vllm_kv_heads_by_rank(total_kv_heads, tp)
    layout = Layout(tp, total_kv_heads)
    assert tuple(tuple(layout.heads_of(r)) for r in range(tp)) == vllm
    assert all(layout.heads_per_rank == len(h) for h in vllm)
    for head in range(total_kv_heads):
        assert layout.holders_of(head) == [r for r in range(tp) if head in vllm[r]], head


def test_the_unit_tests_head_table_is_vllms_sharding() -> None:
    from tests.unit.test_tp_mapping import VLLM_KV_HEADS

    assert any(tp > k for k, tp in VLLM_KV_HEADS)  # the replicated case is in the table
    for (total_kv_heads, tp), table in VLLM_KV_HEADS.items():
        assert table == vllm_kv_heads_by_rank(total_kv_heads, tp), (total_kv_heads, tp)
