"""KV arena on Ascend: one ``aclrtMalloc`` reservation per device, served to torch-npu through a pluggable allocator.

The C side is ``csrc/npu/npu_arena.cpp`` (compiled into ``vllm_kvp2p._C`` only when the CANN headers were found at
build time; ``_C.HAS_NPU`` says so). torch-npu reaches it through ``NPUPluggableAllocator`` + ``torch.npu.MemPool``:
allocations the calling thread makes inside ``torch.npu.use_mem_pool(pool)`` come from the reservation, back to
back, so the whole KV cache is one 2 MiB aligned region and Mooncake/HCCL register it once.

Cannot run on these CI machines (no NPU, no CANN); only :func:`unavailable_reason` is exercised there.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_MALLOC = "kvp2p_npu_malloc"
_FREE = "kvp2p_npu_free"


def unavailable_reason() -> str | None:
    """Why no NPU arena can be made in this process, or None when one can."""
    try:
        from vllm_kvp2p import _C
    except ImportError as exc:
        return f"vllm_kvp2p._C is not importable ({exc})"
    if not getattr(_C, "HAS_NPU", False):
        return "vllm_kvp2p._C was built without the NPU arena (CANN headers not found at build time)"
    try:
        import torch_npu  # noqa: F401
    except ImportError as exc:
        return f"torch_npu is not importable ({exc})"
    return None


class NpuKvArena:
    """One device reservation of ``size_bytes`` (rounded up to 2 MiB) on the current NPU."""

    def __init__(self, size_bytes: int) -> None:
        import torch
        import torch_npu

        from vllm_kvp2p import _C

        self.device = int(torch.npu.current_device())
        self._lib = ctypes.CDLL(_C.__file__)
        self._lib.kvp2p_npu_arena_reserve.argtypes = [ctypes.c_size_t, ctypes.c_int]
        self._lib.kvp2p_npu_arena_info.argtypes = [ctypes.c_int] + [ctypes.POINTER(ctypes.c_uint64)] * 4
        self._lib.kvp2p_npu_arena_release.argtypes = [ctypes.c_int]
        rc = self._lib.kvp2p_npu_arena_reserve(size_bytes, self.device)
        if rc != 0:
            raise RuntimeError(
                f"could not reserve a {size_bytes} B KV arena on npu:{self.device} (aclrtMalloc / arena error {rc}; "
                "-1 means an arena already exists on this device or the size is invalid)"
            )
        self.base, self.size = self._info()[:2]
        allocator = torch_npu.npu.memory.NPUPluggableAllocator(_C.__file__, _MALLOC, _FREE)
        # torch-npu's documented form is MemPool(alloc._allocator); newer releases also expose alloc.allocator().
        raw = allocator.allocator() if hasattr(allocator, "allocator") else allocator._allocator
        self._pool: Any = torch.npu.MemPool(raw)
        self._allocator = allocator  # keep the .so handle alive as long as the pool

    def _info(self) -> tuple[int, int, int, int]:
        vals = [ctypes.c_uint64() for _ in range(4)]
        if self._lib.kvp2p_npu_arena_info(self.device, *(ctypes.byref(v) for v in vals)) != 0:
            raise RuntimeError(f"no KV arena on npu:{self.device}")
        base, size, used, live = (int(v.value) for v in vals)
        return base, size, used, live

    @property
    def used(self) -> int:
        return self._info()[2]

    def contains(self, ptr: int, nbytes: int = 1) -> bool:
        return self.base <= ptr and ptr + max(nbytes, 1) <= self.base + self.size

    @contextmanager
    def scope(self) -> Iterator[NpuKvArena]:
        """Allocations by this thread inside come from the arena (torch-npu's thread-local ``use_mem_pool``). A full
        arena makes torch-npu raise its out-of-memory error; the message below names the arena."""
        import torch

        try:
            with torch.npu.use_mem_pool(self._pool):
                yield self
        except torch.OutOfMemoryError as exc:
            raise RuntimeError(
                f"the KV cache did not fit the connector's NPU arena ({self.size} B, {self.used} B used): {exc}"
            ) from exc

    def release(self) -> bool:
        """Give the reservation back once no tensor from it is alive; False while some are."""
        return self._lib.kvp2p_npu_arena_release(self.device) == 0
