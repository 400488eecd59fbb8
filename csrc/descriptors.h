// Block ids -> Mooncake transfer descriptors: the C++ twin of
// vllm_kvp2p/transfer/descriptors.py::build_descriptors_py (the reference).
//
// Both must give identical output for every input (same entries, same order, ValueError under the same
// conditions). tests/unit/test_descriptors_native.py checks that with property tests, and
// tests/unit/test_descriptors_properties.py the properties both must have.
#pragma once

#include <pybind11/pybind11.h>

namespace kvp2p {

// build_descriptors(local_planes, remote_planes, local_ids, remote_ids) -> (local_addrs, remote_addrs, lengths)
//
// Planes are objects with integer attributes base_addr, block_stride, block_bytes, num_blocks (PlaneGeometry);
// ids are sequences of integers. Returns a tuple of three lists of Python ints.
//
// Raises:
//   ValueError     the conditions under which the Python reference raises ValueError (plane count or id count
//                  mismatch, block_bytes mismatch, id out of range), with the same messages;
//   TypeError      an input is not a sequence of the expected shape, or a value is not an integer;
//   OverflowError  a value does not fit 64 bits (ids and num_blocks: signed, addresses and sizes: unsigned),
//                  or an address or length would exceed 2**64 - 1.
// The Python wrapper (vllm_kvp2p/_ext.py) answers the last two by running the Python reference, whose
// arbitrary-precision arithmetic defines the result there.
pybind11::tuple build_descriptors(pybind11::handle local_planes, pybind11::handle remote_planes,
                                  pybind11::handle local_ids, pybind11::handle remote_ids);

}  // namespace kvp2p
