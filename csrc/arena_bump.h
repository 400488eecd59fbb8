// The bump logic shared by the KV arenas: the CPU one (csrc/arena.cpp, module vllm_kvp2p._arena) and the Ascend
// one (csrc/npu/npu_arena.cpp, compiled into vllm_kvp2p._C when KVP2P_BUILD_NPU=ON and CANN is found).
//
// A BumpRange hands out consecutive, aligned pieces of one reserved region and never reuses a piece: the KV cache
// is allocated once, at start-up, and lives as long as the worker. It only counts the pieces still alive, so the
// owner can refuse to give the region back while one is. Header-only, no dependency; not thread-safe by itself
// (the owners hold a mutex around it).
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvp2p {

// Alignment of every piece handed out (bytes). Tensors are big: keep it simple and generous.
constexpr std::size_t kArenaPieceAlign = 256;
// Alignment of a region's base and size: one huge page, the registration granularity HCCL wants on Ascend.
constexpr std::size_t kArenaRegionAlign = std::size_t{2} << 20;

// Round n up to a multiple of align (a power of two); false when that overflows.
inline bool arena_align_up(std::size_t n, std::size_t align, std::size_t* out) {
  if (n > SIZE_MAX - (align - 1)) return false;
  *out = (n + align - 1) & ~(align - 1);
  return true;
}

struct BumpRange {
  std::uintptr_t base = 0;  // 0: nothing reserved (or released)
  std::size_t size = 0;     // bytes reserved
  std::size_t used = 0;     // bytes handed out, alignment padding included (never decreases)
  std::size_t live = 0;     // pieces handed out and not yet given back

  // A piece of n bytes (n > 0) at the next multiple of `align`, or nullptr when it does not fit.
  void* take(std::size_t n, std::size_t align = kArenaPieceAlign) {
    std::size_t start = 0;
    if (base == 0 || n == 0 || !arena_align_up(used, align, &start)) return nullptr;
    if (start > size || n > size - start) return nullptr;
    used = start + n;
    ++live;
    return reinterpret_cast<void*>(base + start);
  }

  bool contains(const void* p) const {
    const auto a = reinterpret_cast<std::uintptr_t>(p);
    return base != 0 && a >= base && a - base < size;
  }

  // A piece went away; false when none was counted alive (a bug in the caller).
  bool give_back() {
    if (live == 0) return false;
    --live;
    return true;
  }
};

}  // namespace kvp2p
