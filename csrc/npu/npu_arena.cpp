// KV arena for Ascend NPUs: the C entry points torch-npu's NPUPluggableAllocator expects, serving every allocation
// from ONE device reservation so that Mooncake/HCCL register the whole KV cache as one 2 MiB aligned region.
//
// Compiled into vllm_kvp2p._C only with -DKVP2P_BUILD_NPU=ON and the CANN headers found (see CMakeLists.txt;
// vllm_kvp2p._C.HAS_NPU then says so). Intended use, in the NPU worker, around vLLM's KV cache allocation:
//
//   lib = ctypes.CDLL(vllm_kvp2p._C.__file__)
//   lib.kvp2p_npu_arena_reserve(ctypes.c_size_t(nbytes), device)          # on the worker's thread
//   alloc = torch_npu.npu.memory.NPUPluggableAllocator(vllm_kvp2p._C.__file__, "kvp2p_npu_malloc", "kvp2p_npu_free")
//   pool = torch.npu.MemPool(alloc._allocator)
//   with torch.npu.use_mem_pool(pool): ...allocate the KV cache...
//
// Bump allocation (csrc/arena_bump.h, shared with the CPU arena): pieces are never reused; kvp2p_npu_free only
// counts them down, and the reservation goes back to the device with kvp2p_npu_arena_release once none is alive.
// One arena per device index. All functions are thread-safe.
#include <acl/acl.h>
#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <mutex>

#include "arena_bump.h"

// _C is built with hidden visibility; these must be visible to dlsym (NPUPluggableAllocator, ctypes).
#define KVP2P_NPU_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

constexpr int kMaxDevices = 64;
// torch-npu's caching allocator hands out 512-byte granules; keep its alignment guarantee.
constexpr std::size_t kNpuPieceAlign = 512;

struct DeviceArena {
  void* reservation = nullptr;  // what aclrtMalloc returned; base is the first 2 MiB boundary inside it
  kvp2p::BumpRange range;
};

std::mutex g_mu;
DeviceArena g_arenas[kMaxDevices];

DeviceArena* arena_of(int device) { return device >= 0 && device < kMaxDevices ? &g_arenas[device] : nullptr; }

}  // namespace

// Reserves max(size, 1) bytes rounded up to 2 MiB on `device`, 2 MiB aligned, with one
// aclrtMalloc(..., ACL_MEM_MALLOC_HUGE_FIRST). Call it on a thread whose current device is `device`.
// Returns 0, -1 for a bad device / size or an arena already reserved there, else the ACL error code.
KVP2P_NPU_EXPORT int kvp2p_npu_arena_reserve(std::size_t size, int device) {
  std::lock_guard<std::mutex> lk(g_mu);
  DeviceArena* a = arena_of(device);
  std::size_t rounded = 0;
  if (a == nullptr || a->reservation != nullptr || size == 0 ||
      !kvp2p::arena_align_up(size, kvp2p::kArenaRegionAlign, &rounded) || rounded > SIZE_MAX / 2) {
    return -1;
  }
  void* raw = nullptr;
  const aclError err = aclrtMalloc(&raw, rounded + kvp2p::kArenaRegionAlign, ACL_MEM_MALLOC_HUGE_FIRST);
  if (err != ACL_SUCCESS) return static_cast<int>(err);
  std::uintptr_t base = 0;
  kvp2p::arena_align_up(reinterpret_cast<std::uintptr_t>(raw), kvp2p::kArenaRegionAlign, &base);
  a->reservation = raw;
  a->range = kvp2p::BumpRange{};
  a->range.base = base;
  a->range.size = rounded;
  return 0;
}

// NPUPluggableAllocator's malloc: a piece of the device's arena, nullptr when there is none or it is full (torch-npu
// then reports out-of-memory).
KVP2P_NPU_EXPORT void* kvp2p_npu_malloc(ssize_t size, int device, aclrtStream /*stream*/) {
  if (size <= 0) return nullptr;
  std::lock_guard<std::mutex> lk(g_mu);
  DeviceArena* a = arena_of(device);
  return a != nullptr ? a->range.take(static_cast<std::size_t>(size), kNpuPieceAlign) : nullptr;
}

// NPUPluggableAllocator's free: the piece is not reused, only counted down.
KVP2P_NPU_EXPORT void kvp2p_npu_free(void* ptr, ssize_t /*size*/, int device, aclrtStream /*stream*/) {
  std::lock_guard<std::mutex> lk(g_mu);
  DeviceArena* a = arena_of(device);
  if (a != nullptr && a->range.contains(ptr)) a->range.give_back();
}

// Base, size, bytes used and live pieces of the device's arena (any pointer may be null). Returns 0, or -1 when
// the device has no arena.
KVP2P_NPU_EXPORT int kvp2p_npu_arena_info(int device, std::uint64_t* base, std::uint64_t* size, std::uint64_t* used,
                                          std::uint64_t* live) {
  std::lock_guard<std::mutex> lk(g_mu);
  const DeviceArena* a = arena_of(device);
  if (a == nullptr || a->reservation == nullptr) return -1;
  if (base != nullptr) *base = a->range.base;
  if (size != nullptr) *size = a->range.size;
  if (used != nullptr) *used = a->range.used;
  if (live != nullptr) *live = a->range.live;
  return 0;
}

// Gives the reservation back (aclrtFree). Returns 0, -1 while pieces are alive or when there is no arena, else the
// ACL error code.
KVP2P_NPU_EXPORT int kvp2p_npu_arena_release(int device) {
  std::lock_guard<std::mutex> lk(g_mu);
  DeviceArena* a = arena_of(device);
  if (a == nullptr || a->reservation == nullptr || a->range.live != 0) return -1;
  const aclError err = aclrtFree(a->reservation);
  if (err != ACL_SUCCESS) return static_cast<int>(err);
  a->reservation = nullptr;
  a->range = kvp2p::BumpRange{};
  return 0;
}
