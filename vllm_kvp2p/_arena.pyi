"""Type stub for the C++ extension module vllm_kvp2p._arena (csrc/arena*.cpp).

Use vllm_kvp2p.platform.arena instead of importing it: torch must be imported first (the module links libc10), and the
Python module keeps the per-thread scope stack that set_active() is driven from.
"""

PIECE_ALIGN: int  # 256: alignment of each allocation inside an arena
REGION_ALIGN: int  # 2 MiB: alignment of an arena's base and size
MAX_ARENAS: int  # arenas one process may hold at once
TORCH_VERSION: str  # torch version the module was built against

class Arena:
    def __init__(self, size_bytes: int, huge_pages: bool = True) -> None:
        """Reserve one anonymous private mmap region of size_bytes rounded up to 2 MiB, 2 MiB aligned;
        madvise(MADV_HUGEPAGE) on it when huge_pages.

        ValueError for size 0, RuntimeError when mmap fails or MAX_ARENAS are alive.
        """
    @property
    def base(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def used(self) -> int: ...
    @property
    def live(self) -> int:
        """Allocations from the arena not yet freed."""
    @property
    def active(self) -> int:
        """Threads in which the arena is the active one."""
    @property
    def huge_pages(self) -> bool: ...
    @property
    def closed(self) -> bool: ...
    def contains(self, ptr: int, nbytes: int) -> bool: ...
    def release(self) -> None:
        """Unmap the region; RuntimeError while allocations from it are alive or it is active in a thread."""

def install() -> bool:
    """Install the arena-aware CPU allocator (once per process); whether it is torch's current CPU allocator."""

def installed() -> bool:
    """Whether the arena-aware CPU allocator is torch's current CPU allocator."""

def set_active(arena: Arena | None) -> None:
    """Make `arena` (None: none) the one the calling thread's CPU allocations come from."""

def active_base() -> int:
    """Base address of the calling thread's active arena, 0 when none."""
