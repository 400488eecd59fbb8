// KV arena (CPU): one anonymous mmap region, 2 MiB aligned, from which the whole KV cache is allocated so that
// Mooncake registers it once (a transfer can never cross two registrations, and registration cost grows with the
// region count).
//
// How tensors get there: install_cpu_allocator() puts a c10::Allocator in front of the CPU allocator that was
// current at that moment (c10::SetCPUAllocator, once per process). It serves an allocation from an arena only while
// that arena is active in the calling thread (set_active_arena); everything else, and every other thread, goes to
// the previous allocator exactly as before. vllm_kvp2p/arena.py is the Python API on top (module vllm_kvp2p._arena,
// csrc/arena_bindings.cpp).
//
// Ownership: the Python handle owns a KvArena. A piece handed to torch only decrements the live count when torch
// frees it; pieces are never reused. release() unmaps the region and refuses while a piece is alive or the arena is
// active in some thread. When the Python handle goes away while pieces are still alive, the region stays mapped
// until the last of them is freed (drop_owner), so a tensor never points into unmapped memory.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>

#include "arena_bump.h"

namespace kvp2p {

struct ArenaStats {
  std::uintptr_t base;  // region start (2 MiB aligned); kept after release() for reporting
  std::size_t size;     // region bytes (the requested size rounded up to 2 MiB)
  std::size_t used;     // bytes handed out, alignment padding included
  std::size_t live;     // pieces handed out and not yet freed
  std::size_t active;   // threads in which this arena is the active one
  bool huge_pages;      // asked for, madvise(MADV_HUGEPAGE) accepted, and THP not disabled system-wide
  bool closed;          // released: no longer mapped
};

class KvArena {
 public:
  // Reserves `size` bytes rounded up to 2 MiB, asking for transparent huge pages when `huge_pages`. Throws
  // std::invalid_argument (size 0 or absurd), std::runtime_error (mmap failed, too many arenas in this process).
  explicit KvArena(std::size_t size, bool huge_pages = true);
  KvArena(const KvArena&) = delete;
  KvArena& operator=(const KvArena&) = delete;

  // A 256-byte aligned piece of n > 0 bytes. Throws c10::OutOfMemoryError when it does not fit (message: arena
  // size, bytes used, the request) and c10::Error when the arena is closed.
  void* allocate(std::size_t n);
  // The deleter's half: one piece went away. Frees the arena itself when it was the last piece of an orphan.
  void free_piece(void* p) noexcept;

  // Unmaps the region. Throws std::runtime_error while pieces are alive or the arena is active in a thread.
  // A no-op when already closed.
  void release();
  // The Python handle is gone: unmap and delete now, or when the last live piece is freed.
  static void drop_owner(KvArena* arena) noexcept;

  ArenaStats stats() const;
  bool contains(std::uintptr_t addr, std::size_t nbytes) const;

  // Activation bookkeeping (set_active_arena).
  void add_activation(int delta) noexcept;

 private:
  ~KvArena();  // only through drop_owner / free_piece
  void unmap_locked() noexcept;  // g_registry and mu_ held

  mutable std::mutex mu_;
  BumpRange range_;
  std::uintptr_t mapped_base_ = 0;  // kept for stats after release
  std::size_t mapped_size_ = 0;
  std::size_t active_ = 0;
  bool huge_pages_ = false;
  bool closed_ = false;
  bool orphaned_ = false;
  int slot_ = -1;
};

// Installs the arena-aware CPU allocator once per process (later calls do nothing). Returns whether it is the
// current CPU allocator (false: something installed another one with a higher priority since).
bool install_cpu_allocator();
bool cpu_allocator_installed();

// Makes `arena` (nullptr: none) the one the calling thread allocates from. The previous one may be deleted by this
// call (an orphan with nothing alive any more), so it is not returned.
void set_active_arena(KvArena* arena) noexcept;
KvArena* active_arena() noexcept;

// Number of arenas this process may hold at once.
constexpr int kMaxArenas = 64;
// Priority given to c10::SetCPUAllocator: the highest, so ours takes effect over the default (priority 0) and
// over anything installed with a lower one.
constexpr std::uint8_t kAllocatorPriority = 255;

}  // namespace kvp2p
