"""The KV integrity digest (issue 23): what P and D each compute over the bytes a pull moves, defined once.

A *unit* is one block of one plane on P (plane ``i``, P block ``b``). A pull moves a set ``R`` of byte offsets of
each unit it touches: the whole block when P and D agree on block size and TP, parts of it otherwise (a head slice,
a token range, in whatever runs the kernels' layouts make). The digest of a unit is the pair of exact integers::

    total    = sum(x[o]           for o in R)
    weighted = sum((o + 1) * x[o] for o in R)

over the unsigned bytes ``x`` of the unit, ``o`` the byte's offset from the unit's start *on P*. Both sums are
additive over any partition of ``R``, so P (walking its blocks) and D (walking its read descriptors, which split
and scatter the same bytes differently) arrive at the same pair whenever D holds exactly P's bytes, however either
side cuts them up. What it catches, always: one changed byte (``total`` moves by the change, never 0: the sums are
exact, not modular), two bytes swapped (``weighted`` moves by the offset difference times the value difference),
a run written to the wrong place on D (its bytes land in another unit's sums, or at other offsets). Both fit in
int64 for units up to 2^26 bytes (255 * (2^26)^2 / 2 < 2^63).

Computed with plain tensor operations on the device where the KV lives, with no copy to the host and no kernel
of our own: bytes are gathered by index, widened and summed (:func:`digest_runs`); whole blocks take a
matrix product on 256-byte rows instead (:func:`digest_blocks`), exact in float32 because one row's sums stay
below 2^24. :func:`digest_reference` is the definition in plain Python, for tests.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import torch

from vllm_kvp2p.protocol import DigestQuery
from vllm_kvp2p.transfer.descriptors import PlaneGeometry

#: Largest unit the int64 sums are exact for.
MAX_UNIT_BYTES = 1 << 26
#: Bytes gathered per step by :func:`digest_runs` (bounds its temporary tensors to a few times this).
CHUNK_BYTES = 1 << 22
ROW = 256  # digest_blocks' row: sum(x) <= 65,280 and sum(j * x[j]) <= 8,323,200, both exact in float32 (< 2^24)


class UnitDigest(msgspec.Struct, frozen=True, array_like=True):
    """The digest of one unit (plane ``plane``, P block ``block``) over the bytes a pull moves of it."""

    plane: int
    block: int
    total: int
    weighted: int


@dataclass(frozen=True)
class Runs:
    """Byte runs to digest, as parallel lists: run ``k`` is ``lengths[k]`` bytes at ``starts[k]`` of the memory
    being read (P's or D's), which are bytes ``offsets[k]`` .. of unit ``units[k]`` (an index into the caller's
    list of units). Runs of one unit may come in any order and split anywhere."""

    starts: Sequence[int]
    offsets: Sequence[int]
    lengths: Sequence[int]
    units: Sequence[int]


def region_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of the whole storage behind ``tensor`` (on its device), whatever its shape, dtype or
    strides: the registered region a plane's ``base_addr`` points into."""
    storage = tensor.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage, 0, (storage.nbytes(),))


def plane_blocks(memory: torch.Tensor, base: int, block_stride: int, block_bytes: int, num_blocks: int) -> torch.Tensor:
    """``[num_blocks, block_bytes]`` view of a plane's blocks in ``memory`` (uint8), ``base`` bytes in: block ``b``
    is bytes ``base + b * block_stride`` .. ``+ block_bytes``. Not contiguous when the stride exceeds the block."""
    return memory.as_strided((num_blocks, block_bytes), (block_stride, 1), memory.storage_offset() + base)


def digest_blocks(blocks: torch.Tensor, ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(total, weighted)``, int64 tensors of ``len(ids)``, of whole blocks ``ids`` of ``blocks`` (a
    ``[num_blocks, block_bytes]`` uint8 view, :func:`plane_blocks`): every byte of each block, offsets from its
    start."""
    block_bytes = blocks.shape[1]
    _check_unit(block_bytes)
    index = torch.as_tensor(list(ids), dtype=torch.long, device=blocks.device)
    total = torch.zeros(len(ids), dtype=torch.int64, device=blocks.device)
    weighted = torch.zeros_like(total)
    per_step = max(1, CHUNK_BYTES // block_bytes)
    pad = -block_bytes % ROW  # zero bytes add nothing to either sum
    for lo in range(0, len(ids), per_step):
        part = blocks.index_select(0, index[lo : lo + per_step])  # copies the blocks: a strided view is fine
        if pad:
            part = torch.nn.functional.pad(part, (0, pad))
        t, w = _digest_rows(part)
        total[lo : lo + per_step], weighted[lo : lo + per_step] = t, w
    return total, weighted


def _digest_rows(part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact (total, weighted) of each row of a ``[n, block_bytes]`` uint8 tensor, ``block_bytes % 256 == 0``."""
    n, block_bytes = part.shape
    rows = part.reshape(n, block_bytes // ROW, ROW).to(torch.float32)
    j = torch.arange(ROW, dtype=torch.float32, device=part.device)
    weights = torch.stack([torch.ones_like(j), j], dim=1)  # [256, 2]: sum(x), sum(j * x) per row
    sums = torch.matmul(rows, weights).to(torch.int64)  # [n, rows, 2], exact
    row_total, row_inner = sums[..., 0], sums[..., 1]
    row_start = torch.arange(block_bytes // ROW, dtype=torch.int64, device=part.device) * ROW
    total = row_total.sum(dim=1)
    weighted = ((row_start + 1) * row_total + row_inner).sum(dim=1)
    return total, weighted


def digest_runs(memory: torch.Tensor, runs: Runs, num_units: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(total, weighted)``, int64 tensors of ``num_units``, of the byte runs ``runs`` of ``memory`` (a flat
    uint8 tensor, :func:`region_bytes`), each byte weighted by its offset in its unit. Any runs, in any order:
    runs of whole 256-byte rows by a matrix product on the gathered rows, the others byte by byte; ``CHUNK_BYTES``
    at a time."""
    device = memory.device
    total = torch.zeros(num_units, dtype=torch.int64, device=device)
    weighted = torch.zeros_like(total)
    if not runs.lengths:
        return total, weighted
    starts = torch.as_tensor(list(runs.starts), dtype=torch.int64, device=device)
    offsets = torch.as_tensor(list(runs.offsets), dtype=torch.int64, device=device)
    lengths = torch.as_tensor(list(runs.lengths), dtype=torch.int64, device=device)
    units = torch.as_tensor(list(runs.units), dtype=torch.int64, device=device)
    if bool((lengths <= 0).any()) or bool((offsets < 0).any()) or bool((offsets + lengths > MAX_UNIT_BYTES).any()):
        raise ValueError("runs must have positive lengths and lie within a unit of at most 2^26 bytes")
    if bool((starts < 0).any()) or bool((starts + lengths > memory.numel()).any()):
        raise ValueError(f"a run lies outside the {memory.numel()}-byte memory")
    # Runs of whole 256-byte rows (whole blocks, usually): gathered by row and summed by a matrix product.
    rowwise = ((starts + memory.storage_offset()) % ROW == 0) & (lengths % ROW == 0) & (memory.numel() >= ROW)
    if bool(rowwise.any()):
        _rows_into(memory, starts[rowwise], offsets[rowwise], lengths[rowwise], units[rowwise], total, weighted)
    rest = ~rowwise
    if bool(rest.any()):
        _bytes_into(memory, starts[rest], offsets[rest], lengths[rest], units[rest], total, weighted)
    return total, weighted


def _rows_into(memory: torch.Tensor, starts: torch.Tensor, offsets: torch.Tensor, lengths: torch.Tensor,
               units: torch.Tensor, total: torch.Tensor, weighted: torch.Tensor) -> None:
    """Add the sums of runs made of whole 256-byte rows of ``memory`` (row-aligned starts)."""
    device = memory.device
    rows = memory[: memory.numel() // ROW * ROW].view(-1, ROW)
    nrows = lengths // ROW
    ends = torch.cumsum(nrows, 0)
    per_step = max(1, CHUNK_BYTES // ROW)
    j = torch.arange(ROW, dtype=torch.float32, device=device)
    weights = torch.stack([torch.ones_like(j), j], dim=1)
    k, n = 0, len(nrows)
    while k < n:
        base = int(ends[k - 1]) if k else 0
        stop = min(n, max(k + 1, int(torch.searchsorted(ends, base + per_step, right=True))))
        count = nrows[k:stop]
        run_of_row = torch.repeat_interleave(torch.arange(stop - k, device=device), count)
        first = torch.cumsum(count, 0) - count
        within = torch.arange(int(count.sum()), device=device) - first[run_of_row]  # row index inside its run
        index = starts[k:stop][run_of_row] // ROW + within
        sums = torch.matmul(rows.index_select(0, index).to(torch.float32), weights).to(torch.int64)  # exact
        row_total, row_inner = sums[:, 0], sums[:, 1]
        row_offset = offsets[k:stop][run_of_row] + within * ROW  # of the row's first byte in its unit
        unit = units[k:stop][run_of_row]
        total.index_add_(0, unit, row_total)
        weighted.index_add_(0, unit, (row_offset + 1) * row_total + row_inner)
        k = stop


def _bytes_into(memory: torch.Tensor, starts: torch.Tensor, offsets: torch.Tensor, lengths: torch.Tensor,
                units: torch.Tensor, total: torch.Tensor, weighted: torch.Tensor) -> None:
    """Add the sums of any runs, byte by byte, ``CHUNK_BYTES`` at a time (a longer run alone)."""
    device = memory.device
    ends = torch.cumsum(lengths, 0)
    k, n = 0, len(lengths)
    while k < n:
        base = int(ends[k - 1]) if k else 0
        stop = min(n, max(k + 1, int(torch.searchsorted(ends, base + CHUNK_BYTES, right=True))))
        length = lengths[k:stop]
        run_of_byte = torch.repeat_interleave(torch.arange(stop - k, device=device), length)
        first_byte = torch.cumsum(length, 0) - length
        within = torch.arange(int(length.sum()), device=device) - first_byte[run_of_byte]
        x = memory[starts[k:stop][run_of_byte] + within].to(torch.int64)
        unit = units[k:stop][run_of_byte]
        total.index_add_(0, unit, x)
        weighted.index_add_(0, unit, x * (offsets[k:stop][run_of_byte] + within + 1))
        k = stop


def digest_reference(unit_bytes: bytes, offsets: Sequence[int] | None = None) -> tuple[int, int]:
    """The definition: ``(total, weighted)`` of the bytes of one unit at ``offsets`` (default: all of them)."""
    chosen = range(len(unit_bytes)) if offsets is None else offsets
    return sum(unit_bytes[o] for o in chosen), sum((o + 1) * unit_bytes[o] for o in chosen)


def _check_unit(unit_bytes: int) -> None:
    if not 0 < unit_bytes <= MAX_UNIT_BYTES:
        raise ValueError(f"a unit of {unit_bytes} bytes: the digest's sums are exact for 1 .. 2^26 bytes")


class KVMemory:
    """A worker's KV memory addressed as Mooncake addresses it: the storages behind its KV tensors, looked up by
    address, so that byte runs named by address (P's blocks, D's read destinations) are summed where they live."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        spans: dict[int, torch.Tensor] = {}
        for tensor in tensors:
            memory = region_bytes(tensor)
            spans.setdefault(tensor.untyped_storage().data_ptr(), memory)
        self._bases = sorted(spans)
        self._memory = [spans[b] for b in self._bases]

    def sums(self, runs: Sequence[tuple[int, int, int, int]], num_units: int) -> list[tuple[int, int]]:
        """``(total, weighted)`` per unit of ``runs``: ``(address, offset in unit, length, unit)`` each. Raises
        ValueError for a run outside every storage."""
        by_storage: dict[int, Runs] = {}
        for addr, offset, length, unit in runs:
            at = bisect.bisect_right(self._bases, addr) - 1
            if at < 0 or addr + length > self._bases[at] + self._memory[at].numel():
                raise ValueError(f"{length} bytes at {addr:#x} lie outside the KV memory")
            part = by_storage.setdefault(at, Runs([], [], [], []))
            part.starts.append(addr - self._bases[at])  # type: ignore[attr-defined]
            part.offsets.append(offset)  # type: ignore[attr-defined]
            part.lengths.append(length)  # type: ignore[attr-defined]
            part.units.append(unit)  # type: ignore[attr-defined]
        total = [0] * num_units
        weighted = [0] * num_units
        for at, part in by_storage.items():
            t, w = digest_runs(self._memory[at], part, num_units)
            for u, (a, b) in enumerate(zip(t.tolist(), w.tolist())):
                total[u] += a
                weighted[u] += b
        return list(zip(total, weighted))


def sums_of_units(memory: KVMemory, planes: Sequence[PlaneGeometry], query: DigestQuery) -> list[tuple[int, int]]:
    """P's answer to an integrity question: the sums of each unit's ranges where its plane's block lies (the
    question was checked against ``planes`` first: vllm_kvp2p/lifecycle/integrity.query_problem)."""
    runs = []
    for index, unit in enumerate(query.units):
        plane = planes[unit.plane]
        start = plane.base_addr + unit.block * plane.block_stride
        for offset, length in zip(unit.ranges[::2], unit.ranges[1::2]):
            runs.append((start + offset, offset, length, index))
    return memory.sums(runs, len(query.units))
