"""KV arena: the whole KV cache in ONE contiguous, 2 MiB aligned CPU region, registered with Mooncake once.

Mooncake registers memory region by region and a transfer never crosses two registrations; registration cost grows
with the region count (and on Ascend HCCL allows only a few hundred regions per process, 2 MiB aligned). vLLM
allocates the KV cache inside the context manager that the connector's ``get_mem_pool_context()`` returns, so::

    arena = KvArena(arena_size_for(kv_cache_config))
    with arena.scope():
        ...  # every CPU tensor allocated by THIS thread here comes from the arena, back to back

``KvArena`` reserves the region with ``mmap`` (anonymous, private), asks for transparent huge pages
(``huge_pages`` says whether the OS accepted), and hands out 256-byte aligned pieces that are never reused.
Allocations made outside a scope, or by other threads during one, go to torch's CPU allocator as before: the
C++ extension ``vllm_kvp2p._arena`` wraps that allocator once per process (``c10::SetCPUAllocator``) and only
diverts the calling thread's allocations while one of its scopes is active.

Importing this module imports neither torch nor the extension; creating the first arena (or reading
``AVAILABLE``) does.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

#: Alignment of each allocation inside an arena (bytes).
PIECE_ALIGN = 256
#: Alignment of an arena's base address and size (bytes): one huge page.
REGION_ALIGN = 2 << 20
#: vLLM rounds a backing allocation to this on some platforms (ROCm); arena_size_for allows for it everywhere.
_PAGE = 4096

_load_lock = threading.Lock()
_loaded = False
_ext: Any = None
_error: str | None = None
_tls = threading.local()  # .stack: list[KvArena], the calling thread's active scopes, innermost last


def _load() -> Any:
    """The extension module (torch imported first, so libc10 is loaded), or None; the reason is kept."""
    global _loaded, _ext, _error
    if _loaded:
        return _ext
    with _load_lock:
        if not _loaded:
            try:
                import torch

                from vllm_kvp2p import _arena
            except ImportError as exc:
                _error = f"vllm_kvp2p._arena is not importable ({exc}); it is built when torch is importable at build"
            else:
                built, running = _major_minor(_arena.TORCH_VERSION), _major_minor(torch.__version__)
                if built != running:
                    _error = (
                        f"vllm_kvp2p._arena was built against torch {_arena.TORCH_VERSION} but torch "
                        f"{torch.__version__} is running: rebuild (pip install -e . --no-build-isolation)"
                    )
                else:
                    _ext = _arena
            _loaded = True
    return _ext


def _major_minor(version: str) -> tuple[str, ...]:
    return tuple(version.split("+", 1)[0].split(".")[:2])


def available() -> bool:
    """Whether arenas can be created here (imports torch and the extension on first call)."""
    return _load() is not None


def unavailable_reason() -> str | None:
    """Why ``available()`` is False, or None when it is True."""
    return None if _load() is not None else _error


#: Whether arenas can be created here. Computed on first access (module __getattr__), so that importing this module
#: stays light; same as available().
AVAILABLE: bool


def __getattr__(name: str) -> Any:
    if name == "AVAILABLE":
        return available()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _stack() -> list[KvArena]:
    stack = getattr(_tls, "stack", None)
    if stack is None:
        stack = _tls.stack = []
    return stack


class KvArena:
    """One mmap region from which the calling thread's CPU tensors are allocated while ``scope()`` is active."""

    def __init__(self, size_bytes: int, *, huge_pages: bool = True) -> None:
        """Reserve ``size_bytes`` rounded up to a multiple of 2 MiB (``size``), at a 2 MiB aligned ``base``.

        ``huge_pages``: ask for transparent huge pages (``madvise(MADV_HUGEPAGE)``). They make later accesses
        cheaper, but the first touch of a huge page can cost more than ordinary pages when the kernel has to compact
        memory to find free 2 MiB pages (see the ``huge_pages`` property for what was granted).

        ValueError for a size <= 0; RuntimeError when the extension is unavailable, mmap fails, or the arena
        allocator cannot be installed.
        """
        size = int(size_bytes)
        if size <= 0:
            raise ValueError(f"KvArena size must be > 0 bytes, got {size_bytes!r}")
        ext = _load()
        if ext is None:
            raise RuntimeError(f"KvArena unavailable: {_error}")
        if not ext.install():
            raise RuntimeError(
                "KvArena: the arena-aware CPU allocator could not become torch's CPU allocator (another one was "
                "installed with a higher priority)"
            )
        self._ext = ext
        self._arena = ext.Arena(size, bool(huge_pages))

    # ------------------------------------------------------------------ activation

    @contextmanager
    def scope(self) -> Iterator[KvArena]:
        """Within this context, CPU tensors allocated by the calling thread come from this arena.

        Thread-local: other threads are unaffected, and threads started inside do not inherit it. Nesting is safe
        (the same arena or another one; the innermost scope wins and the outer one is restored on exit).
        RuntimeError on entry when the arena is closed or torch's CPU allocator was replaced since.
        """
        if self._arena.closed:
            raise RuntimeError(f"{self!r} is closed")
        if not self._ext.installed():
            raise RuntimeError(
                "KvArena: torch's CPU allocator was replaced after the arena allocator was installed; "
                "allocations would not reach the arena"
            )
        stack = _stack()
        stack.append(self)
        self._ext.set_active(self._arena)
        try:
            yield self
        finally:
            # Remove this scope's entry (normally the last) and re-activate whatever is innermost now.
            for i in range(len(stack) - 1, -1, -1):
                if stack[i] is self:
                    del stack[i]
                    break
            self._ext.set_active(stack[-1]._arena if stack else None)

    # ------------------------------------------------------------------ state

    @property
    def base(self) -> int:
        """Address of the region's first byte (2 MiB aligned); kept after close() for reporting."""
        return self._arena.base

    @property
    def size(self) -> int:
        """Bytes reserved: the requested size rounded up to 2 MiB."""
        return self._arena.size

    @property
    def used(self) -> int:
        """Bytes handed out so far, alignment padding included (pieces are never reused)."""
        return self._arena.used

    @property
    def huge_pages(self) -> bool:
        """Whether transparent huge pages were asked for and granted: madvise(MADV_HUGEPAGE) accepted and THP not
        disabled system-wide (the kernel then backs the region with 2 MiB pages where it can, 4 KiB ones elsewhere)."""
        return self._arena.huge_pages

    @property
    def live_allocations(self) -> int:
        """Allocations from this arena whose tensors (storages) are still alive."""
        return self._arena.live

    @property
    def closed(self) -> bool:
        return self._arena.closed

    def contains(self, ptr: int, nbytes: int = 1) -> bool:
        """Whether ``[ptr, ptr + nbytes)`` lies inside this (open) arena's region."""
        if ptr < 0 or nbytes < 0:
            return False
        return self._arena.contains(int(ptr), int(nbytes))

    def close(self) -> None:
        """Unmap the region. RuntimeError while tensors allocated from it are alive or it is active in a scope.

        Closing twice is a no-op. Without close(), the region is unmapped when this object and every tensor
        allocated from it are gone.
        """
        self._arena.release()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"used={self.used} live={self.live_allocations}"
        return f"KvArena(base={self.base:#x}, size={self.size}, {state}, huge_pages={self.huge_pages})"


def arena_size_for(kv_cache_config: Any) -> int:
    """Bytes an arena needs so that vLLM's KV cache allocation for ``kv_cache_config`` fits in it.

    vLLM 0.32 (``vllm.v1.worker.utils.allocate_kv_cache``) allocates ONE int8 backing buffer of
    ``kv_cache_tensors[i].size`` bytes -- every KVCacheTensor carries the same ``size`` and places its layers in
    that buffer at ``offset``/``layer_stride``/``block_stride`` -- and only makes views of it. Older vLLM
    (KVCacheTensor without ``layer_stride``) allocates one buffer per KVCacheTensor. Each buffer is allowed
    rounding to 4 KiB plus this arena's 256-byte alignment, and one 2 MiB of slack is added for anything small
    allocated in the same scope; the result is a multiple of 2 MiB.
    """
    tensors = list(getattr(kv_cache_config, "kv_cache_tensors", None) or [])
    if tensors and all(hasattr(t, "layer_stride") for t in tensors):
        buffers = [max(int(t.size) for t in tensors)]  # one shared backing allocation
    else:
        buffers = [int(t.size) for t in tensors]  # one allocation per KVCacheTensor
    total = sum(_round_up(_round_up(n, _PAGE), PIECE_ALIGN) + PIECE_ALIGN for n in buffers) + REGION_ALIGN
    return _round_up(total, REGION_ALIGN)


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


__all__ = [
    "PIECE_ALIGN",
    "REGION_ALIGN",
    "AVAILABLE",
    "KvArena",
    "arena_size_for",
    "available",
    "unavailable_reason",
]
