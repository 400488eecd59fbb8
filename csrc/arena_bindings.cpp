// Python module vllm_kvp2p._arena (KV arena, CPU). Use it through vllm_kvp2p.arena, which imports torch first
// (this module links libc10) and keeps the per-thread activation stack.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "arena.h"

#ifndef KVP2P_TORCH_VERSION
#define KVP2P_TORCH_VERSION "unknown"
#endif

namespace py = pybind11;

namespace {

// What Python holds: owning a KvArena until Python lets go of it (then KvArena::drop_owner decides when the region
// really goes: now, or when its last tensor is freed).
class ArenaHandle {
 public:
  ArenaHandle(std::size_t size, bool huge_pages) : arena_(new kvp2p::KvArena(size, huge_pages)) {}
  ~ArenaHandle() { kvp2p::KvArena::drop_owner(arena_); }
  ArenaHandle(const ArenaHandle&) = delete;
  ArenaHandle& operator=(const ArenaHandle&) = delete;

  kvp2p::KvArena* get() const { return arena_; }
  kvp2p::ArenaStats stats() const { return arena_->stats(); }

 private:
  kvp2p::KvArena* arena_;
};

}  // namespace

PYBIND11_MODULE(_arena, m) {
  m.doc() = "KV arena for the CPU (use vllm_kvp2p.arena rather than this module directly; import torch first).";

  py::class_<ArenaHandle>(m, "Arena")
      .def(py::init<std::size_t, bool>(), py::arg("size_bytes"), py::arg("huge_pages") = true,
           "Reserve one anonymous private mmap region of size_bytes rounded up to 2 MiB, 2 MiB aligned;\n"
           "madvise(MADV_HUGEPAGE) on it when huge_pages.")
      .def_property_readonly("base", [](const ArenaHandle& h) { return h.stats().base; })
      .def_property_readonly("size", [](const ArenaHandle& h) { return h.stats().size; })
      .def_property_readonly("used", [](const ArenaHandle& h) { return h.stats().used; })
      .def_property_readonly("live", [](const ArenaHandle& h) { return h.stats().live; })
      .def_property_readonly("active", [](const ArenaHandle& h) { return h.stats().active; })
      .def_property_readonly("huge_pages", [](const ArenaHandle& h) { return h.stats().huge_pages; })
      .def_property_readonly("closed", [](const ArenaHandle& h) { return h.stats().closed; })
      .def(
          "contains",
          [](const ArenaHandle& h, std::uintptr_t ptr, std::size_t nbytes) { return h.get()->contains(ptr, nbytes); },
          py::arg("ptr"), py::arg("nbytes"))
      .def(
          "release", [](ArenaHandle& h) { h.get()->release(); },
          "Unmap the region; RuntimeError while allocations from it are alive or it is active in a thread.");

  m.def("install", &kvp2p::install_cpu_allocator,
        "Install the arena-aware CPU allocator (once per process); returns whether it is the current one.");
  m.def("installed", &kvp2p::cpu_allocator_installed, "Whether the arena-aware CPU allocator is the current one.");
  m.def(
      "set_active",
      [](ArenaHandle* h) { kvp2p::set_active_arena(h != nullptr ? h->get() : nullptr); }, py::arg("arena").none(true),
      "Make `arena` (None: none) the one the calling thread's CPU allocations come from.");
  m.def(
      "active_base",
      [] {
        const kvp2p::KvArena* a = kvp2p::active_arena();
        return a != nullptr ? a->stats().base : std::uintptr_t{0};
      },
      "Base address of the calling thread's active arena, 0 when none.");

  m.attr("PIECE_ALIGN") = kvp2p::kArenaPieceAlign;
  m.attr("REGION_ALIGN") = kvp2p::kArenaRegionAlign;
  m.attr("MAX_ARENAS") = kvp2p::kMaxArenas;
  m.attr("TORCH_VERSION") = std::string(KVP2P_TORCH_VERSION);
}
