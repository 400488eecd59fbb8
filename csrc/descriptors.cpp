// See descriptors.h. Mirrors vllm_kvp2p/transfer/descriptors.py::build_descriptors_py step for step:
//
//   1. plane counts must match                                  (ValueError)
//   2. id counts must match                                     (ValueError, raised by block_runs)
//   3. runs of ids consecutive on both sides are collected
//   4. per plane, in order: block_bytes must match, then every local id, then every remote id must be in
//      [0, num_blocks)                                          (ValueError, first failure wins)
//   5. per plane, in order: one entry per run if both planes are dense (block_stride == block_bytes),
//      else one entry per block.
//
// All inputs are converted up front; anything that is not a 64-bit integer raises TypeError/OverflowError
// before any check of step 4 can raise ValueError, so a ValueError from here is always the one the
// reference raises. Step 4 is done for every plane before step 5 starts: the reference interleaves them,
// but its output is thrown away when it raises, so the outcome is the same.
#include "descriptors.h"

#include <Python.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace kvp2p {
namespace {

struct Plane {
  uint64_t base_addr;
  uint64_t block_stride;
  uint64_t block_bytes;
  int64_t num_blocks;

  bool dense() const { return block_stride == block_bytes; }
};

struct Run {
  int64_t local;
  int64_t remote;
  int64_t n;
};

[[noreturn]] void throw_python_error() { throw py::error_already_set(); }

// len(obj), raising what len() raises.
Py_ssize_t py_len(PyObject* obj) {
  Py_ssize_t n = PyObject_Size(obj);
  if (n < 0) throw_python_error();
  return n;
}

// Integers only (operator.index semantics: bool and numpy integers pass, float does not).
int64_t to_i64(PyObject* obj) {
  long long v;
  if (PyLong_Check(obj)) {
    v = PyLong_AsLongLong(obj);
  } else {
    PyObject* index = PyNumber_Index(obj);
    if (index == nullptr) throw_python_error();
    v = PyLong_AsLongLong(index);
    Py_DECREF(index);
  }
  if (v == -1 && PyErr_Occurred()) throw_python_error();
  return static_cast<int64_t>(v);
}

uint64_t to_u64(PyObject* obj) {
  unsigned long long v;
  if (PyLong_Check(obj)) {
    v = PyLong_AsUnsignedLongLong(obj);
  } else {
    PyObject* index = PyNumber_Index(obj);
    if (index == nullptr) throw_python_error();
    v = PyLong_AsUnsignedLongLong(index);
    Py_DECREF(index);
  }
  if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) throw_python_error();
  return static_cast<uint64_t>(v);
}

py::object get_attr(PyObject* obj, PyObject* name) {
  PyObject* value = PyObject_GetAttr(obj, name);
  if (value == nullptr) throw_python_error();
  return py::reinterpret_steal<py::object>(value);
}

// A list or tuple view of obj (obj itself when it already is one).
py::object as_fast_sequence(PyObject* obj, const char* what) {
  PyObject* seq = PySequence_Fast(obj, what);
  if (seq == nullptr) throw_python_error();
  return py::reinterpret_steal<py::object>(seq);
}

std::vector<Plane> read_planes(PyObject* obj) {
  // Interned once; the GIL is held whenever this runs.
  static PyObject* const s_base_addr = PyUnicode_InternFromString("base_addr");
  static PyObject* const s_block_stride = PyUnicode_InternFromString("block_stride");
  static PyObject* const s_block_bytes = PyUnicode_InternFromString("block_bytes");
  static PyObject* const s_num_blocks = PyUnicode_InternFromString("num_blocks");

  py::object seq = as_fast_sequence(obj, "planes must be a sequence of PlaneGeometry");
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.ptr());
  PyObject** items = PySequence_Fast_ITEMS(seq.ptr());
  std::vector<Plane> planes;
  planes.reserve(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = items[i];
    Plane p;
    p.base_addr = to_u64(get_attr(item, s_base_addr).ptr());
    p.block_stride = to_u64(get_attr(item, s_block_stride).ptr());
    p.block_bytes = to_u64(get_attr(item, s_block_bytes).ptr());
    p.num_blocks = to_i64(get_attr(item, s_num_blocks).ptr());
    planes.push_back(p);
  }
  return planes;
}

std::vector<int64_t> read_ids(PyObject* obj) {
  py::object seq = as_fast_sequence(obj, "block ids must be a sequence of int");
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.ptr());
  PyObject** items = PySequence_Fast_ITEMS(seq.ptr());
  std::vector<int64_t> ids(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) ids[static_cast<size_t>(i)] = to_i64(items[i]);
  return ids;
}

// Maximal runs consecutive on both sides (block_runs in the reference).
std::vector<Run> block_runs(const std::vector<int64_t>& local_ids, const std::vector<int64_t>& remote_ids) {
  std::vector<Run> runs;
  runs.reserve(local_ids.size());
  for (size_t i = 0; i < local_ids.size(); ++i) {
    const int64_t lb = local_ids[i];
    const int64_t rb = remote_ids[i];
    if (!runs.empty()) {
      Run& last = runs.back();
      int64_t next_local, next_remote;
      // An overflowing l0 + n cannot equal any int64 id, just as the unbounded sum in Python cannot.
      if (!__builtin_add_overflow(last.local, last.n, &next_local) && lb == next_local &&
          !__builtin_add_overflow(last.remote, last.n, &next_remote) && rb == next_remote) {
        ++last.n;
        continue;
      }
    }
    runs.push_back(Run{lb, rb, 1});
  }
  return runs;
}

struct Extent {
  int64_t min = 0;
  int64_t max = -1;
};

Extent extent(const std::vector<int64_t>& ids) {
  Extent e;
  if (ids.empty()) return e;
  e.min = e.max = ids[0];
  for (int64_t b : ids) {
    if (b < e.min) e.min = b;
    if (b > e.max) e.max = b;
  }
  return e;
}

void check_ids(const Plane& plane, const std::vector<int64_t>& ids, const Extent& ext, const char* side,
               size_t index) {
  if (ids.empty() || (ext.min >= 0 && ext.max < plane.num_blocks)) return;
  for (int64_t b : ids) {  // error path only: report the first bad id, as the reference does
    if (!(0 <= b && b < plane.num_blocks)) {
      throw std::invalid_argument(std::string(side) + " block id " + std::to_string(b) + " out of range for plane " +
                                  std::to_string(index) + " with " + std::to_string(plane.num_blocks) +
                                  " blocks");
    }
  }
}

// base + max_id * stride must fit: every address emitted for this plane is at most that.
void check_address_range(const Plane& plane, int64_t max_id, const char* side, size_t index) {
  if (max_id < 0) return;  // no ids
  uint64_t offset, end;
  if (__builtin_mul_overflow(static_cast<uint64_t>(max_id), plane.block_stride, &offset) ||
      __builtin_add_overflow(plane.base_addr, offset, &end)) {
    throw std::overflow_error(std::string("plane ") + std::to_string(index) + ": " + side +
                              " address of block " + std::to_string(max_id) + " exceeds 64 bits");
  }
}

PyObject* new_int(uint64_t v) {
  PyObject* obj = PyLong_FromUnsignedLongLong(static_cast<unsigned long long>(v));
  if (obj == nullptr) throw_python_error();
  return obj;
}

}  // namespace

py::tuple build_descriptors(py::handle local_planes, py::handle remote_planes, py::handle local_ids,
                            py::handle remote_ids) {
  // 1-2: the reference's first two checks, on len() alone.
  const Py_ssize_t n_local_planes = py_len(local_planes.ptr());
  const Py_ssize_t n_remote_planes = py_len(remote_planes.ptr());
  if (n_local_planes != n_remote_planes) {
    throw std::invalid_argument(std::to_string(n_local_planes) + " local planes but " +
                                std::to_string(n_remote_planes) + " remote planes");
  }
  const Py_ssize_t n_local_ids = py_len(local_ids.ptr());
  const Py_ssize_t n_remote_ids = py_len(remote_ids.ptr());
  if (n_local_ids != n_remote_ids) {
    throw std::invalid_argument(std::to_string(n_local_ids) + " local blocks but " + std::to_string(n_remote_ids) +
                                " remote blocks");
  }

  const std::vector<int64_t> lids = read_ids(local_ids.ptr());
  const std::vector<int64_t> rids = read_ids(remote_ids.ptr());
  const std::vector<Plane> lplanes = read_planes(local_planes.ptr());
  const std::vector<Plane> rplanes = read_planes(remote_planes.ptr());
  if (lids.size() != rids.size() || lplanes.size() != rplanes.size()) {
    throw py::type_error("sequence length changed while it was read");
  }

  // 3
  const std::vector<Run> runs = block_runs(lids, rids);
  int64_t longest_run = 0;
  for (const Run& r : runs) longest_run = r.n > longest_run ? r.n : longest_run;

  // 4 (and the 64-bit range checks, which the reference does not need)
  const Extent lext = extent(lids);
  const Extent rext = extent(rids);
  size_t total = 0;
  for (size_t i = 0; i < lplanes.size(); ++i) {
    const Plane& lp = lplanes[i];
    const Plane& rp = rplanes[i];
    if (lp.block_bytes != rp.block_bytes) {
      throw std::invalid_argument("plane " + std::to_string(i) + ": local block is " +
                                  std::to_string(lp.block_bytes) + " B but remote block is " +
                                  std::to_string(rp.block_bytes) + " B");
    }
    check_ids(lp, lids, lext, "local", i);
    check_ids(rp, rids, rext, "remote", i);
    total += (lp.dense() && rp.dense()) ? runs.size() : lids.size();
  }
  for (size_t i = 0; i < lplanes.size(); ++i) {
    const Plane& lp = lplanes[i];
    const Plane& rp = rplanes[i];
    check_address_range(lp, lext.max, "local", i);
    check_address_range(rp, rext.max, "remote", i);
    uint64_t longest_length;
    if (lp.dense() && rp.dense() &&
        __builtin_mul_overflow(static_cast<uint64_t>(longest_run), lp.block_bytes, &longest_length)) {
      throw std::overflow_error("plane " + std::to_string(i) + ": a run of " + std::to_string(longest_run) +
                                " blocks of " + std::to_string(lp.block_bytes) + " B exceeds 64 bits");
    }
  }

  // 5. Ids are in [0, num_blocks) here and no sum or product below overflows (checked above).
  const Py_ssize_t size = static_cast<Py_ssize_t>(total);
  py::list local_addrs(size), remote_addrs(size), lengths(size);
  PyObject* const la = local_addrs.ptr();
  PyObject* const ra = remote_addrs.ptr();
  PyObject* const ln = lengths.ptr();
  Py_ssize_t k = 0;
  for (size_t i = 0; i < lplanes.size(); ++i) {
    const Plane& lp = lplanes[i];
    const Plane& rp = rplanes[i];
    if (lids.empty()) continue;
    // One shared int for the length of a single block (most entries): fewer allocations.
    py::object block_len = py::reinterpret_steal<py::object>(new_int(lp.block_bytes));
    if (lp.dense() && rp.dense()) {
      for (const Run& r : runs) {
        PyList_SET_ITEM(la, k, new_int(lp.base_addr + static_cast<uint64_t>(r.local) * lp.block_stride));
        PyList_SET_ITEM(ra, k, new_int(rp.base_addr + static_cast<uint64_t>(r.remote) * rp.block_stride));
        PyList_SET_ITEM(ln, k,
                        r.n == 1 ? block_len.inc_ref().ptr() : new_int(static_cast<uint64_t>(r.n) * lp.block_bytes));
        ++k;
      }
    } else {
      for (size_t j = 0; j < lids.size(); ++j) {
        PyList_SET_ITEM(la, k, new_int(lp.base_addr + static_cast<uint64_t>(lids[j]) * lp.block_stride));
        PyList_SET_ITEM(ra, k, new_int(rp.base_addr + static_cast<uint64_t>(rids[j]) * rp.block_stride));
        PyList_SET_ITEM(ln, k, block_len.inc_ref().ptr());
        ++k;
      }
    }
  }
  return py::make_tuple(std::move(local_addrs), std::move(remote_addrs), std::move(lengths));
}

}  // namespace kvp2p
