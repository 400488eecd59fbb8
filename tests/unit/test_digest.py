"""The integrity digest's definition (vllm_kvp2p/transfer/digest.py): P walking its blocks and D walking its
scattered read runs arrive at the same sums exactly when D holds P's bytes, and one changed byte, two swapped
bytes or a misplaced run always changes them."""

from __future__ import annotations

import random

import pytest
import torch

from vllm_kvp2p.transfer.digest import ROW, KVMemory, Runs, digest_reference, digest_runs, region_bytes

BLOCKS = 6


def random_bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def scatter_like_d(p_memory: torch.Tensor, unit_runs: list[tuple[int, int, int, int]], seed: int,
                   pieces: int = 5) -> tuple[torch.Tensor, Runs]:
    """D's side of a pull: every P run (start on P, offset in unit, length, unit) cut into up to ``pieces`` parts,
    each copied to a random free place of D's memory, the parts listed in a shuffled order."""
    rng = random.Random(seed)
    parts = []
    for start, offset, length, unit in unit_runs:
        cuts = sorted(rng.sample(range(1, length), min(pieces - 1, length - 1))) if length > 1 else []
        bounds = [0, *cuts, length]
        parts += [(start + a, offset + a, b - a, unit) for a, b in zip(bounds, bounds[1:])]
    rng.shuffle(parts)
    d_memory = torch.zeros(sum(p[2] for p in parts) * 2, dtype=torch.uint8)
    cursor, runs = 0, Runs([], [], [], [])
    for p_start, offset, length, unit in parts:
        cursor += rng.randrange(0, 3)  # gaps: D's runs are not packed either
        d_memory[cursor : cursor + length] = p_memory[p_start : p_start + length]
        runs.starts.append(cursor), runs.offsets.append(offset), runs.lengths.append(length), runs.units.append(unit)
        cursor += length
    return d_memory, runs


@pytest.mark.parametrize("block_bytes", [256, 1000, 4096, 65536])
@pytest.mark.parametrize("stride_extra", [0, 512])
@pytest.mark.parametrize("base", [64, ROW], ids=["unaligned", "row-aligned"])
def test_whole_blocks_equal_the_definition_dense_or_strided(block_bytes: int, stride_extra: int, base: int) -> None:
    """Whole blocks of a plane, dense or strided, at a row-aligned base (the matrix-product path where the block is
    whole rows) or not (the byte path): the definition's sums either way."""
    stride = block_bytes + stride_extra
    memory = random_bytes(base + stride * BLOCKS, seed=block_bytes + stride_extra)
    ids = [4, 0, 5, 2]
    runs = Runs([base + b * stride for b in ids], [0] * len(ids), [block_bytes] * len(ids), list(range(len(ids))))
    total, weighted = digest_runs(memory, runs, len(ids))
    for k, b in enumerate(ids):
        start = base + b * stride
        expected = digest_reference(bytes(memory[start : start + block_bytes].tolist()))
        assert (int(total[k]), int(weighted[k])) == expected


def test_d_scattered_runs_give_p_sums_for_whole_and_partial_units() -> None:
    """P's units are walked whole or in a head slice / token range (offsets a few sub-ranges); D has the same
    bytes cut into other pieces at other places, listed in another order: equal sums, and equal to the definition
    over exactly those offsets."""
    block_bytes, stride = 3000, 3000
    p_memory = random_bytes(stride * BLOCKS, seed=7)
    # unit 0: block 1 whole; unit 1: block 3, two sub-ranges (a head slice of K and of V); unit 2: block 4's tail
    p_runs = [(1 * stride, 0, block_bytes, 0),
              (3 * stride + 100, 100, 400, 1), (3 * stride + 1600, 1600, 400, 1),
              (4 * stride + 2500, 2500, 500, 2)]
    p_sums = digest_runs(p_memory, Runs(*zip(*p_runs)), 3)
    for seed in range(5):
        d_memory, d_runs = scatter_like_d(p_memory, p_runs, seed)
        assert all(torch.equal(a, b) for a, b in zip(digest_runs(d_memory, d_runs, 3), p_sums))
    unit1 = bytes(p_memory[3 * stride : 4 * stride].tolist())
    assert (int(p_sums[0][1]), int(p_sums[1][1])) == digest_reference(unit1, [*range(100, 500), *range(1600, 2000)])


def test_one_changed_byte_anywhere_is_caught() -> None:
    block_bytes = 1024
    p_memory = random_bytes(block_bytes * 2, seed=11)
    p_runs = [(0, 0, block_bytes, 0), (block_bytes, 0, block_bytes, 1)]
    p_total, p_weighted = digest_runs(p_memory, Runs(*zip(*p_runs)), 2)
    d_memory, d_runs = scatter_like_d(p_memory, p_runs, seed=3)
    for position in [0, 1, 255, 256, 777, d_memory.numel() // 2, *random.Random(5).sample(range(d_memory.numel()), 40)]:
        if not any(s <= position < s + n for s, n in zip(d_runs.starts, d_runs.lengths)):
            continue  # a gap between D's runs: not part of the pull
        for delta in (1, 128, 255):
            flipped = d_memory.clone()
            flipped[position] = (int(flipped[position]) + delta) % 256
            total, weighted = digest_runs(flipped, d_runs, 2)
            assert not torch.equal(total, p_total), (position, delta)


def test_swapped_bytes_and_a_misplaced_run_are_caught() -> None:
    block_bytes = 512
    p_memory = random_bytes(block_bytes * 2, seed=13)
    p_runs = [(0, 0, block_bytes, 0), (block_bytes, 0, block_bytes, 1)]
    p_sums = digest_runs(p_memory, Runs(*zip(*p_runs)), 2)
    swapped = p_memory.clone()
    a, b = 10, 400
    assert swapped[a] != swapped[b]
    swapped[a], swapped[b] = p_memory[b].clone(), p_memory[a].clone()
    total, weighted = digest_runs(swapped, Runs(*zip(*p_runs)), 2)
    assert torch.equal(total, p_sums[0]) and not torch.equal(weighted, p_sums[1])  # same bytes, other places
    # D wrote P block 1's bytes where block 0's belong and the reverse: each unit sees the other's bytes
    crossed = torch.cat([p_memory[block_bytes:], p_memory[:block_bytes]])
    total, weighted = digest_runs(crossed, Runs(*zip(*p_runs)), 2)
    assert not torch.equal(total, p_sums[0]) or not torch.equal(weighted, p_sums[1])


def test_region_bytes_reads_the_storage_behind_non_contiguous_kv_views() -> None:
    """vLLM's CPU cache is one tensor per layer with K and V halves; NPU planes are views; bfloat16 or float32:
    the digest reads the registered bytes, whatever view the plane is handed as."""
    for dtype in (torch.float32, torch.bfloat16):
        cache = torch.randn(2, BLOCKS, 4, 16, 8).to(dtype)  # [K|V, blocks, heads, tokens, elements]
        v_half = cache[1]
        transposed = cache.transpose(3, 4)
        for view in (v_half, transposed, cache[:, 2:4]):
            memory = region_bytes(view)
            assert memory.numel() == cache.numel() * cache.element_size()
            assert torch.equal(memory, cache.reshape(-1).view(torch.uint8))
        block_bytes = 4 * 16 * 8 * cache.element_size()
        v_block_3 = Runs([BLOCKS * block_bytes + 3 * block_bytes], [0], [block_bytes], [0])  # V half, block 3
        expected = digest_reference(bytes(cache[1, 3].contiguous().view(torch.uint8).reshape(-1).tolist()))
        total, weighted = digest_runs(region_bytes(v_half), v_block_3, 1)
        assert (int(total[0]), int(weighted[0])) == expected


def test_rows_of_255_stay_exact() -> None:
    """The row sums are exact: the worst row (every byte 255) and a 4 MiB unit of them."""
    n = 1 << 22
    unit = torch.full((n,), 255, dtype=torch.uint8)
    total, weighted = digest_runs(unit, Runs([0], [0], [n], [0]), 1)  # whole rows: the row path
    assert int(total[0]) == 255 * n and int(weighted[0]) == 255 * n * (n + 1) // 2


@pytest.mark.parametrize("precision", ["medium", "high"])
def test_sums_stay_exact_when_the_process_lets_float_matrix_products_round(precision: str) -> None:
    """Anything in the engine may lower float32 matrix-product precision process-wide (TF32 on CUDA, HF32 on
    Ascend, bfloat16 passes on CPUs with AMX); the digest uses no float products, so P's and D's sums stay exact.
    The control: the same rows through a float product whose inputs are rounded to bfloat16, as such a pass
    rounds them, give other sums (this CPU itself keeps float32 products exact at every setting)."""
    rows = torch.full((64, ROW), 255, dtype=torch.uint8)
    rows[:, ::3] = 251
    expected = [digest_reference(bytes(rows[i].tolist())) for i in range(64)]
    runs = Runs([i * ROW for i in range(64)], [0] * 64, [ROW] * 64, list(range(64)))
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        total, weighted = digest_runs(rows.view(-1), runs, 64)
    finally:
        torch.set_float32_matmul_precision(before)
    assert list(zip(total.tolist(), weighted.tolist())) == expected
    j = torch.arange(ROW, dtype=torch.float32)
    rounded = (rows.to(torch.bfloat16) @ torch.stack([torch.ones_like(j), j], dim=1).to(torch.bfloat16)).double()
    assert rounded[:, 1].to(torch.int64).tolist() != [w - t for t, w in expected]


def test_bad_runs_are_refused() -> None:
    memory = random_bytes(100, seed=1)
    with pytest.raises(ValueError, match="outside"):
        digest_runs(memory, Runs([90], [0], [20], [0]), 1)
    with pytest.raises(ValueError, match="positive"):
        digest_runs(memory, Runs([0], [0], [0], [0]), 1)
    with pytest.raises(ValueError, match="2\\^26"):
        digest_runs(memory, Runs([0], [1 << 26], [1], [0]), 1)


def test_row_runs_and_byte_runs_agree_with_the_definition() -> None:
    """Runs of whole 256-byte rows at row-aligned places take the matrix-product path, the rest the byte path;
    mixed in one call, at any unit offsets (a row need not start a unit), both give the definition's sums."""
    memory = random_bytes(1 << 16, seed=17)
    rng = random.Random(23)
    runs = Runs([], [], [], [])
    expected: dict[int, list[int]] = {u: [0, 0] for u in range(4)}
    for _ in range(40):
        unit = rng.randrange(4)
        if rng.random() < 0.5:
            start, length = rng.randrange(0, 200) * 256, 256 * rng.randrange(1, 8)  # a row run
        else:
            start, length = rng.randrange(0, 60000), rng.randrange(1, 900)  # anything
        offset = rng.randrange(0, 5000)
        runs.starts.append(start), runs.offsets.append(offset), runs.lengths.append(length), runs.units.append(unit)
        chunk = bytes(memory[start : start + length].tolist())
        expected[unit][0] += sum(chunk)
        expected[unit][1] += sum((offset + i + 1) * b for i, b in enumerate(chunk))
    total, weighted = digest_runs(memory, runs, 4)
    assert [[int(total[u]), int(weighted[u])] for u in range(4)] == [expected[u] for u in range(4)]
    assert any(s % 256 == 0 and n % 256 == 0 for s, n in zip(runs.starts, runs.lengths))


def test_kv_memory_sums_runs_across_many_storages_as_the_definition() -> None:
    """A worker's KV is one storage per layer: runs of whole rows from all of them are summed together, odd runs
    per storage, units spread over storages; every unit equals the definition over the same bytes."""
    layers = [random_bytes(8 * 1024, seed=40 + i).view(8, 1024) for i in range(5)]
    memory = KVMemory(layers)
    rng = random.Random(7)
    runs, expected = [], []
    for unit in range(12):
        layer = layers[rng.randrange(5)]
        block = rng.randrange(8)
        base = layer.data_ptr() + block * 1024
        data = bytes(layer[block].tolist())
        if unit % 3 == 0:  # whole block: the row path
            runs.append((base, 0, 1024, unit))
            expected.append(digest_reference(data))
        else:  # a row and an odd piece: both paths for one unit
            odd = rng.randrange(1, 200)
            runs += [(base + 256, 256, 256, unit), (base + 600, 600, odd, unit)]
            expected.append(digest_reference(data, list(range(256, 512)) + list(range(600, 600 + odd))))
    rng.shuffle(runs)
    assert memory.sums(runs, 12) == expected
    with pytest.raises(ValueError, match="outside"):
        memory.sums([(layers[0].data_ptr(), 0, 256, 12)], 12)  # no such unit
