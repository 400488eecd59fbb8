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
a transfer that wrote somewhere other than the plan's destination (D sums the plan's destinations, so bytes
that did not arrive there show). Both fit in int64 for units up to 2^26 bytes (255 * (2^26)^2 / 2 < 2^63).

What it cannot see: a wrong plan. P's question and D's sums are both made from D's read descriptors, so a
descriptor built wrong (a wrong D block, head or token offset, a misread kernel layout) is summed where it was
written and matches. The plan is proven against vLLM's own kernel writes by tests (docs/reliability.md, "What the
digest proves").

Computed with plain tensor operations on the device where the KV lives, with no copy to the host and no kernel
of our own: :func:`digest_runs` gathers runs of whole 256-byte rows (whole blocks, usually) by row and
sums them per row with element-wise float32 products and sums (exact: every value stays an integer below 2^24,
whatever the order of summation), and every other run byte by byte. No matrix product: it would be exact too, but
only as long as nobody lets matrix products round (TF32 on CUDA, HF32 on Ascend,
``torch.set_float32_matmul_precision``), a process-wide setting this module cannot own.
:func:`digest_reference` is the definition in plain Python, for tests.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from vllm_kvp2p.contract.protocol import DigestQuery
from vllm_kvp2p.transfer.descriptors import PlaneGeometry

#: Largest unit the int64 sums are exact for.
MAX_UNIT_BYTES = 1 << 26
#: Bytes gathered per step by :func:`digest_runs`: its float32 temporaries (4x this) stay in cache (on this CPU
#: 256 KiB ran 2.1 ms/MiB, 4 MiB 4.5 ms/MiB: fresh 16 MiB temporaries fault their pages in on every call).
CHUNK_BYTES = 1 << 18
ROW = 256  # bytes summed per row: every product j * x[j] and partial sum is an integer below 2^24, exact in float32


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


def digest_runs(memory: torch.Tensor, runs: Runs, num_units: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(total, weighted)``, int64 tensors of ``num_units``, of the byte runs ``runs`` of ``memory`` (a flat
    uint8 tensor, :func:`region_bytes`), each byte weighted by its offset in its unit. Any runs, in any order:
    runs of whole 256-byte rows per gathered row, the others byte by byte; ``CHUNK_BYTES``
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
    # One check, one wait for the device (a sampled pull's few units cost in tensor calls, not in bytes).
    bad = (lengths <= 0) | (offsets < 0) | (offsets + lengths > MAX_UNIT_BYTES) | (starts < 0) \
        | (starts + lengths > memory.numel())
    if bool(bad.any()):
        raise ValueError(f"runs must have positive lengths, lie within a unit of at most 2^26 bytes and not "
                         f"outside the {memory.numel()}-byte memory")
    # Runs of whole 256-byte rows (whole blocks, usually): gathered and summed by row.
    rowwise = ((starts + memory.storage_offset()) % ROW == 0) & (lengths % ROW == 0) & (memory.numel() >= ROW)
    if bool(rowwise.any()):
        picked = (starts, offsets, lengths, units) if bool(rowwise.all()) else \
            (starts[rowwise], offsets[rowwise], lengths[rowwise], units[rowwise])
        columns = torch.stack([picked[0] // ROW, picked[2] // ROW, picked[1], picked[3]], dim=1).tolist()
        _rows_into([_rows_of(memory)], [(0, *c) for c in columns], total, weighted)
    rest = ~rowwise
    if bool(rest.any()):
        _bytes_into(memory, starts[rest], offsets[rest], lengths[rest], units[rest], total, weighted)
    return total, weighted


def _rows_of(memory: torch.Tensor) -> torch.Tensor:
    """``memory`` (flat uint8) as rows of ``ROW`` bytes (a view; a tail shorter than a row is left out)."""
    return memory[: memory.numel() // ROW * ROW].view(-1, ROW)


def _rows_into(views: Sequence[torch.Tensor], runs: Sequence[tuple[int, int, int, int, int]], total: torch.Tensor,
               weighted: torch.Tensor) -> None:
    """Add the sums of runs of whole rows: ``(view, first row, rows, offset in unit, unit)`` each, ``views``
    being :func:`_rows_of` memories (several storages: every KV layer may be one). Runs of one view must be
    adjacent in ``runs``. One set of tensor operations per ``CHUNK_BYTES`` of rows, whatever the number of
    storages they come from (each storage adds one gather): a pull touches one storage per layer."""
    device = total.device
    j = _row_offsets(device)
    step = max(1, CHUNK_BYTES // ROW)
    i = 0
    while i < len(runs):
        chunk, rows = [], 0
        while i < len(runs) and (not chunk or rows + runs[i][2] <= step):  # a longer run goes alone
            chunk.append(runs[i])
            rows += runs[i][2]
            i += 1
        table = torch.tensor([c[1:] for c in chunk], dtype=torch.int64, device=device)  # first, rows, offset, unit
        counts = table[:, 1]
        run = torch.repeat_interleave(torch.arange(len(chunk), device=device), counts)
        within = torch.arange(rows, device=device) - (torch.cumsum(counts, 0) - counts)[run]  # row index in run
        index = table[:, 0][run] + within
        pieces, at = [], 0
        for view, group in itertools.groupby(chunk, key=lambda c: c[0]):
            n = sum(c[2] for c in group)
            pieces.append(views[view].index_select(0, index[at: at + n]))
            at += n
        x = (pieces[0] if len(pieces) == 1 else torch.cat(pieces)).to(torch.float32)
        row_total = x.sum(dim=1).to(torch.int64)  # exact: see ROW
        row_inner = (x * j).sum(dim=1).to(torch.int64)
        units = table[:, 3][run]
        total.index_add_(0, units, row_total)
        weighted.index_add_(0, units, (table[:, 2][run] + within * ROW + 1) * row_total + row_inner)


_OFFSETS: dict[torch.device, torch.Tensor] = {}


def _row_offsets(device: torch.device) -> torch.Tensor:
    """``0 .. 255`` as float32 on ``device`` (made once per device)."""
    j = _OFFSETS.get(device)
    if j is None:
        j = _OFFSETS[device] = torch.arange(ROW, dtype=torch.float32, device=device)
    return j


def _bytes_into(memory: torch.Tensor, starts: torch.Tensor, offsets: torch.Tensor, lengths: torch.Tensor,
                units: torch.Tensor, total: torch.Tensor, weighted: torch.Tensor) -> None:
    """Add the sums of any runs, byte by byte."""
    for run, within in _expanded(lengths, CHUNK_BYTES):  # within: the byte's offset in its run
        x = memory[starts[run] + within].to(torch.int64)
        total.index_add_(0, units[run], x)
        weighted.index_add_(0, units[run], x * (offsets[run] + within + 1))


def _expanded(counts: torch.Tensor, per_step: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Runs of ``counts[k]`` elements each, expanded to one entry per element, about ``per_step`` elements at a
    time (a longer run alone): for each entry its run's index and its index inside that run."""
    device = counts.device
    ends = torch.cumsum(counts, 0)
    k, n = 0, len(counts)
    while k < n:
        base = int(ends[k - 1]) if k else 0
        stop = min(n, max(k + 1, int(torch.searchsorted(ends, base + max(1, per_step), right=True))))
        count = counts[k:stop]
        local_run = torch.repeat_interleave(torch.arange(stop - k, device=device), count)
        within = torch.arange(int(count.sum()), device=device) - (torch.cumsum(count, 0) - count)[local_run]
        yield local_run + k, within
        k = stop


def digest_reference(unit_bytes: bytes, offsets: Sequence[int] | None = None) -> tuple[int, int]:
    """The definition: ``(total, weighted)`` of the bytes of one unit at ``offsets`` (default: all of them)."""
    chosen = range(len(unit_bytes)) if offsets is None else offsets
    return sum(unit_bytes[o] for o in chosen), sum((o + 1) * unit_bytes[o] for o in chosen)


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
        self._rows = [_rows_of(m) for m in self._memory]

    def sums(self, runs: Sequence[tuple[int, int, int, int]], num_units: int) -> list[tuple[int, int]]:
        """``(total, weighted)`` per unit of ``runs``: ``(address, offset in unit, length, unit)`` each. Raises
        ValueError for a run outside every storage or any unit. Runs of whole rows (whole blocks, usually) of all
        storages are summed together (:func:`_rows_into`); any others per storage by :func:`digest_runs`."""
        rows: list[tuple[int, int, int, int, int]] = []
        others: dict[int, Runs] = {}
        for addr, offset, length, unit in runs:
            at, start = self._locate(addr, length)
            if not (0 <= unit < num_units and length > 0 and 0 <= offset and offset + length <= MAX_UNIT_BYTES):
                raise ValueError(f"run ({addr:#x}, {offset}, {length}, unit {unit}) lies outside its unit")
            if start % ROW == 0 and length % ROW == 0:  # storages start row-aligned: the storage offset is 0
                rows.append((at, start // ROW, length // ROW, offset, unit))
                continue
            part = others.setdefault(at, Runs([], [], [], []))
            part.starts.append(start)  # type: ignore[attr-defined]
            part.offsets.append(offset)  # type: ignore[attr-defined]
            part.lengths.append(length)  # type: ignore[attr-defined]
            part.units.append(unit)  # type: ignore[attr-defined]
        device = self._memory[0].device if self._memory else torch.device("cpu")
        total = torch.zeros(num_units, dtype=torch.int64, device=device)
        weighted = torch.zeros_like(total)
        if rows:
            rows.sort(key=lambda r: r[0])  # runs of one storage adjacent (stable: their order kept)
            _rows_into(self._rows, rows, total, weighted)
        for at, part in others.items():
            t, w = digest_runs(self._memory[at], part, num_units)
            total += t
            weighted += w
        return list(zip(total.tolist(), weighted.tolist()))

    def flip_byte(self, addr: int, mask: int) -> None:
        """XOR the byte at ``addr`` with ``mask``, on its device (the test hook that corrupts a read in flight)."""
        at, start = self._locate(addr, 1)
        self._memory[at][start] ^= mask

    def _locate(self, addr: int, length: int) -> tuple[int, int]:
        """(storage index, offset in it) of ``length`` bytes at ``addr``; ValueError outside every storage."""
        at = bisect.bisect_right(self._bases, addr) - 1
        if at < 0 or addr + length > self._bases[at] + self._memory[at].numel():
            raise ValueError(f"{length} bytes at {addr:#x} lie outside the KV memory")
        return at, addr - self._bases[at]


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
