"""Block ids -> Mooncake transfer descriptors (local address, remote address, length).

A *plane* is one registered-memory tensor seen as an array of blocks: ``base_addr + block * block_stride``
is where block ``block`` starts, and ``block_bytes`` is how many bytes of it are moved. A layer has one plane on
CPU (K and V packed in the last dimension) and two on NPU (K and V separate).

Runs of blocks that are consecutive on *both* sides and whose planes are dense (``block_stride == block_bytes``)
are merged into one descriptor. A merged run never leaves its plane, and a plane never spans two registrations,
so no descriptor crosses a registered region (Mooncake fails such reads, even across adjacent regions).

The C++ extension (``vllm_kvp2p._C``) provides the same function for long prompts; this module is the reference
and the fallback, and both must give identical output.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from vllm_kvp2p.transfer import native as _ext


class PlaneGeometry(msgspec.Struct, frozen=True, array_like=True):
    """Where a plane's blocks live in (registered) memory."""

    base_addr: int
    block_stride: int
    block_bytes: int
    num_blocks: int

    @property
    def dense(self) -> bool:
        return self.block_stride == self.block_bytes


@dataclass(frozen=True)
class Descriptors:
    """Parallel arrays in the order Mooncake's batch calls take them."""

    local_addrs: list[int]
    remote_addrs: list[int]
    lengths: list[int]

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def total_bytes(self) -> int:
        return sum(self.lengths)

    def batches(self, max_entries: int) -> list[Descriptors]:
        """Split into consecutive batches of at most ``max_entries`` entries (the per-peer in-flight cap)."""
        if max_entries <= 0:
            raise ValueError(f"max_entries must be positive, got {max_entries}")
        return [
            Descriptors(
                self.local_addrs[i : i + max_entries],
                self.remote_addrs[i : i + max_entries],
                self.lengths[i : i + max_entries],
            )
            for i in range(0, len(self.lengths), max_entries)
        ]


def block_runs(local_ids: Sequence[int], remote_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(local start, remote start, length) for maximal runs consecutive on both sides."""
    if len(local_ids) != len(remote_ids):
        raise ValueError(f"{len(local_ids)} local blocks but {len(remote_ids)} remote blocks")
    runs: list[tuple[int, int, int]] = []
    for lb, rb in zip(local_ids, remote_ids):
        if runs:
            l0, r0, n = runs[-1]
            if lb == l0 + n and rb == r0 + n:
                runs[-1] = (l0, r0, n + 1)
                continue
        runs.append((lb, rb, 1))
    return runs


def _check_ids(plane: PlaneGeometry, ids: Sequence[int], side: str, index: int) -> None:
    for b in ids:
        if not 0 <= b < plane.num_blocks:
            raise ValueError(f"{side} block id {b} out of range for plane {index} with {plane.num_blocks} blocks")


def build_descriptors_py(
    local_planes: Sequence[PlaneGeometry],
    remote_planes: Sequence[PlaneGeometry],
    local_ids: Sequence[int],
    remote_ids: Sequence[int],
) -> Descriptors:
    """Pure-Python descriptor builder (reference implementation)."""
    if len(local_planes) != len(remote_planes):
        raise ValueError(f"{len(local_planes)} local planes but {len(remote_planes)} remote planes")
    runs = block_runs(local_ids, remote_ids)
    out = Descriptors([], [], [])
    for i, (lp, rp) in enumerate(zip(local_planes, remote_planes)):
        if lp.block_bytes != rp.block_bytes:
            raise ValueError(f"plane {i}: local block is {lp.block_bytes} B but remote block is {rp.block_bytes} B")
        _check_ids(lp, local_ids, "local", i)
        _check_ids(rp, remote_ids, "remote", i)
        mergeable = lp.dense and rp.dense
        for l0, r0, n in runs:
            if mergeable:
                out.local_addrs.append(lp.base_addr + l0 * lp.block_stride)
                out.remote_addrs.append(rp.base_addr + r0 * rp.block_stride)
                out.lengths.append(n * lp.block_bytes)
            else:
                for k in range(n):
                    out.local_addrs.append(lp.base_addr + (l0 + k) * lp.block_stride)
                    out.remote_addrs.append(rp.base_addr + (r0 + k) * rp.block_stride)
                    out.lengths.append(lp.block_bytes)
    return out


def build_descriptors(
    local_planes: Sequence[PlaneGeometry],
    remote_planes: Sequence[PlaneGeometry],
    local_ids: Sequence[int],
    remote_ids: Sequence[int],
) -> Descriptors:
    """Descriptor builder: the C++ fast path when the extension is built, else the Python reference. The C++ code
    works on 64-bit integers: outside that domain (TypeError/OverflowError) the reference defines the answer (a
    result or its own exception), so the result is the reference's for every input."""
    fast = _ext.build_descriptors
    if fast is None:
        return build_descriptors_py(local_planes, remote_planes, local_ids, remote_ids)
    local_ids, remote_ids = list(local_ids), list(remote_ids)
    try:
        return Descriptors(*fast(local_planes, remote_planes, local_ids, remote_ids))
    except (TypeError, OverflowError):
        return build_descriptors_py(local_planes, remote_planes, local_ids, remote_ids)
