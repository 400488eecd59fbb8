// Python module vllm_kvp2p._C. Use it through vllm_kvp2p._ext, which falls back to the pure-Python code when
// this module is missing.
#include <pybind11/pybind11.h>

#include "descriptors.h"

#ifndef KVP2P_WITH_NPU
#define KVP2P_WITH_NPU 0
#endif

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "C++ fast paths of vllm_kvp2p (use vllm_kvp2p._ext rather than this module directly).";

  m.def("build_descriptors", &kvp2p::build_descriptors, py::arg("local_planes"), py::arg("remote_planes"),
        py::arg("local_ids"), py::arg("remote_ids"),
        "build_descriptors(local_planes, remote_planes, local_ids, remote_ids)"
        " -> tuple[list[int], list[int], list[int]]\n\n"
        "Same output as vllm_kvp2p.transfer.descriptors.build_descriptors_py (local addresses, remote\n"
        "addresses, lengths). ValueError under the same conditions; TypeError/OverflowError for values that\n"
        "are not 64-bit integers or addresses beyond 2**64 - 1 (vllm_kvp2p._ext then uses the Python code).");

  // Whether the NPU allocator backend (CMake option KVP2P_BUILD_NPU, needs CANN) was compiled in.
  m.attr("HAS_NPU") = py::bool_(KVP2P_WITH_NPU != 0);
}
