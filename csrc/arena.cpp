// KV arena (CPU) and the arena-aware c10 CPU allocator. See arena.h.
#include "arena.h"

#include <sys/mman.h>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/Device.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>

namespace kvp2p {
namespace {

// ---------------------------------------------------------------------------------------------------------------
// Registry of the arenas' address ranges, read without a lock by every CPU free (dispatch_delete) while an arena
// exists. A slot is published by storing `begin` last and withdrawn by clearing `begin` first; a range is withdrawn
// only when no piece of it is alive, so a pointer that matches a published range is a live piece of that arena.
// Writers hold g_registry. All of it is trivially destructible: nothing here runs at process exit.
// ---------------------------------------------------------------------------------------------------------------
struct Slot {
  std::atomic<std::uintptr_t> begin{0};
  std::atomic<std::uintptr_t> end{0};
  std::atomic<KvArena*> arena{nullptr};
};

std::mutex g_registry;
Slot g_slots[kMaxArenas];
std::atomic<int> g_slot_high{0};    // slots [0, high) may be in use
std::atomic<int> g_arena_count{0};  // published ranges

thread_local KvArena* t_active = nullptr;

c10::DeleterFnPtr g_fallback_raw = nullptr;  // raw deleter of the allocator we wrap (set once, at install)

int publish(KvArena* arena, std::uintptr_t begin, std::size_t size) {  // g_registry held
  for (int i = 0; i < kMaxArenas; ++i) {
    Slot& s = g_slots[i];
    if (s.begin.load(std::memory_order_relaxed) != 0 || s.arena.load(std::memory_order_relaxed) != nullptr) continue;
    s.arena.store(arena, std::memory_order_relaxed);
    s.end.store(begin + size, std::memory_order_relaxed);
    s.begin.store(begin, std::memory_order_release);
    if (g_slot_high.load(std::memory_order_relaxed) < i + 1) g_slot_high.store(i + 1, std::memory_order_release);
    g_arena_count.fetch_add(1, std::memory_order_release);
    return i;
  }
  return -1;
}

void withdraw(int i) {  // g_registry held
  Slot& s = g_slots[i];
  s.begin.store(0, std::memory_order_release);
  s.end.store(0, std::memory_order_relaxed);
  s.arena.store(nullptr, std::memory_order_relaxed);
  g_arena_count.fetch_sub(1, std::memory_order_release);
}

KvArena* find_arena(const void* p) noexcept {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  const int high = g_slot_high.load(std::memory_order_acquire);
  for (int i = 0; i < high; ++i) {
    const std::uintptr_t b = g_slots[i].begin.load(std::memory_order_acquire);
    if (b != 0 && a >= b && a < g_slots[i].end.load(std::memory_order_relaxed)) {
      return g_slots[i].arena.load(std::memory_order_relaxed);
    }
  }
  return nullptr;
}

// The deleter of every DataPtr our allocator hands out (and its raw_deleter): an arena piece only decrements its
// arena's live count; anything else goes to the wrapped allocator's own deleter. One relaxed load while no arena
// exists.
void dispatch_delete(void* p) {
  if (p != nullptr && g_arena_count.load(std::memory_order_acquire) != 0) {
    if (KvArena* arena = find_arena(p)) {
      arena->free_piece(p);
      return;
    }
  }
  if (g_fallback_raw != nullptr) g_fallback_raw(p);
}

// Transparent huge pages switched off system-wide ("[never]")? Then MADV_HUGEPAGE is accepted but gives nothing.
bool thp_disabled() {
  std::ifstream f("/sys/kernel/mm/transparent_hugepage/enabled");
  if (!f) return false;
  const std::string mode((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  return mode.find("[never]") != std::string::npos;
}

std::string hex(std::uintptr_t v) {
  char buf[2 + 2 * sizeof(v) + 1];
  std::snprintf(buf, sizeof(buf), "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

// ---------------------------------------------------------------------------------------------------------------
// The allocator: in front of the CPU allocator that was current at install time.
// ---------------------------------------------------------------------------------------------------------------
class ArenaCPUAllocator final : public c10::Allocator {
 public:
  explicit ArenaCPUAllocator(c10::Allocator* fallback) : fallback_(fallback) {}

  c10::DataPtr allocate(std::size_t n) override {
    KvArena* arena = t_active;
    if (arena == nullptr || n == 0) {
      c10::DataPtr d = fallback_->allocate(n);
      // Same memory, same deleter behind dispatch_delete, so that allocate() keeps returning raw_deleter().
      if (g_fallback_raw != nullptr) (void)d.compare_exchange_deleter(g_fallback_raw, &dispatch_delete);
      return d;
    }
    void* p = arena->allocate(n);
    return {p, p, &dispatch_delete, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return g_fallback_raw != nullptr ? &dispatch_delete : nullptr; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

 private:
  c10::Allocator* fallback_;
};

std::once_flag g_install_once;
ArenaCPUAllocator* g_allocator = nullptr;  // never deleted: c10 keeps a raw pointer until the process ends

}  // namespace

// ---------------------------------------------------------------------------------------------------------------
// KvArena
// ---------------------------------------------------------------------------------------------------------------
KvArena::KvArena(std::size_t size, bool huge_pages) {
  std::size_t rounded = 0;
  if (size == 0) throw std::invalid_argument("KvArena: size must be > 0");
  if (!arena_align_up(size, kArenaRegionAlign, &rounded) || rounded > SIZE_MAX / 2) {
    throw std::invalid_argument("KvArena: size " + std::to_string(size) + " is too large");
  }
  // Over-reserve by one alignment unit, then trim both ends so the region starts on a 2 MiB boundary.
  const std::size_t reserve = rounded + kArenaRegionAlign;
  void* raw = ::mmap(nullptr, reserve, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) {
    const int err = errno;
    throw std::runtime_error("KvArena: mmap of " + std::to_string(reserve) + " bytes failed: " + std::strerror(err));
  }
  const auto start = reinterpret_cast<std::uintptr_t>(raw);
  std::uintptr_t base = 0;
  arena_align_up(start, kArenaRegionAlign, &base);
  const std::size_t head = base - start;
  const std::size_t tail = reserve - head - rounded;
  if (head != 0) ::munmap(raw, head);
  if (tail != 0) ::munmap(reinterpret_cast<void*>(base + rounded), tail);

#ifdef MADV_HUGEPAGE
  // Transparent huge pages where the OS gives them, ordinary pages otherwise.
  huge_pages_ =
      huge_pages && ::madvise(reinterpret_cast<void*>(base), rounded, MADV_HUGEPAGE) == 0 && !thp_disabled();
#else
  (void)huge_pages;
#endif

  {
    std::lock_guard<std::mutex> reg(g_registry);
    slot_ = publish(this, base, rounded);
  }
  if (slot_ < 0) {
    ::munmap(reinterpret_cast<void*>(base), rounded);
    throw std::runtime_error("KvArena: this process already holds " + std::to_string(kMaxArenas) +
                             " arenas; close one first");
  }
  range_.base = base;
  range_.size = rounded;
  mapped_base_ = base;
  mapped_size_ = rounded;
}

KvArena::~KvArena() = default;

void* KvArena::allocate(std::size_t n) {
  std::lock_guard<std::mutex> lk(mu_);
  TORCH_CHECK(!closed_, "vllm_kvp2p KvArena at ", hex(mapped_base_), " is closed: cannot allocate ", n,
              " bytes from it");
  void* p = range_.take(n);
  if (p == nullptr) {
    const std::size_t free_bytes = range_.size - std::min(range_.used, range_.size);
    TORCH_CHECK_WITH(OutOfMemoryError, false, "vllm_kvp2p KvArena overflow: cannot allocate ", n,
                     " bytes from the arena of ", range_.size, " bytes at ", hex(mapped_base_), ": ", range_.used,
                     " bytes used, ", free_bytes, " free (pieces are ", kArenaPieceAlign,
                     "-byte aligned and never reused). Make the arena larger "
                     "(vllm_kvp2p.arena.arena_size_for computes what vLLM allocates).");
  }
  return p;
}

void KvArena::free_piece(void* /*p*/) noexcept {
  bool dead = false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    range_.give_back();
    dead = orphaned_ && range_.live == 0 && active_ == 0;
  }
  if (!dead) return;
  {
    std::lock_guard<std::mutex> reg(g_registry);
    std::lock_guard<std::mutex> lk(mu_);
    unmap_locked();
  }
  delete this;
}

void KvArena::add_activation(int delta) noexcept {
  bool dead = false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (delta < 0 && active_ < static_cast<std::size_t>(-delta)) {
      active_ = 0;
    } else {
      active_ = static_cast<std::size_t>(static_cast<long long>(active_) + delta);
    }
    dead = orphaned_ && range_.live == 0 && active_ == 0;
  }
  if (!dead) return;
  {
    std::lock_guard<std::mutex> reg(g_registry);
    std::lock_guard<std::mutex> lk(mu_);
    unmap_locked();
  }
  delete this;
}

void KvArena::release() {
  std::lock_guard<std::mutex> reg(g_registry);
  std::lock_guard<std::mutex> lk(mu_);
  if (closed_) return;
  if (range_.live != 0) {
    throw std::runtime_error("KvArena at " + hex(mapped_base_) + ": cannot release while " +
                             std::to_string(range_.live) +
                             " tensor allocation(s) from it are alive (delete the tensors first)");
  }
  if (active_ != 0) {
    throw std::runtime_error("KvArena at " + hex(mapped_base_) + ": cannot release while it is active in " +
                             std::to_string(active_) + " thread(s) (leave its scope() first)");
  }
  unmap_locked();
}

void KvArena::unmap_locked() noexcept {
  if (closed_) return;
  if (slot_ >= 0) withdraw(slot_);
  slot_ = -1;
  ::munmap(reinterpret_cast<void*>(mapped_base_), mapped_size_);
  range_.base = 0;
  closed_ = true;
}

void KvArena::drop_owner(KvArena* arena) noexcept {
  if (arena == nullptr) return;
  {
    std::lock_guard<std::mutex> reg(g_registry);
    std::lock_guard<std::mutex> lk(arena->mu_);
    arena->orphaned_ = true;
    // Still in use: the last free_piece / deactivation deletes it.
    if (arena->range_.live != 0 || arena->active_ != 0) return;
    arena->unmap_locked();
  }
  delete arena;
}

ArenaStats KvArena::stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  return ArenaStats{mapped_base_, mapped_size_, range_.used, range_.live, active_, huge_pages_, closed_};
}

bool KvArena::contains(std::uintptr_t addr, std::size_t nbytes) const {
  std::lock_guard<std::mutex> lk(mu_);
  if (closed_ || addr < mapped_base_) return false;
  const std::size_t offset = addr - mapped_base_;
  return offset <= mapped_size_ && nbytes <= mapped_size_ - offset && (nbytes != 0 || offset < mapped_size_);
}

// ---------------------------------------------------------------------------------------------------------------
// Installation and activation
// ---------------------------------------------------------------------------------------------------------------
bool install_cpu_allocator() {
  std::call_once(g_install_once, [] {
    c10::Allocator* current = c10::GetCPUAllocator();
    g_fallback_raw = current->raw_deleter();
    g_allocator = new ArenaCPUAllocator(current);
    c10::SetCPUAllocator(g_allocator, kAllocatorPriority);
  });
  return cpu_allocator_installed();
}

bool cpu_allocator_installed() { return g_allocator != nullptr && c10::GetCPUAllocator() == g_allocator; }

void set_active_arena(KvArena* arena) noexcept {
  KvArena* prev = t_active;
  if (prev == arena) return;
  if (arena != nullptr) arena->add_activation(+1);
  t_active = arena;
  if (prev != nullptr) prev->add_activation(-1);  // may delete prev (an orphan with nothing alive): last
}

KvArena* active_arena() noexcept { return t_active; }

}  // namespace kvp2p
