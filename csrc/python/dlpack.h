// DLPack import/export for the _C module: any framework tensor → ga_tensor descriptor, and the
// arena's views → DLPack capsules. The structs below follow the DLPack ABI (v0.8 legacy capsule
// "dltensor" and v1 "dltensor_versioned").
#ifndef GRADIENT_ACCUMULATOR_PYTHON_DLPACK_H_
#define GRADIENT_ACCUMULATOR_PYTHON_DLPACK_H_

#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gradient_accumulator/gradient_accumulator.h"

namespace ga {
namespace python {

namespace py = pybind11;

extern "C" {
struct DLDevice {
  int32_t device_type;  // 1 CPU, 2 CUDA, 3 CUDA host, 13 CUDA managed
  int32_t device_id;
};
struct DLDataType {
  uint8_t code;  // 0 int, 1 uint, 2 float, 4 bfloat
  uint8_t bits;
  uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;
  uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};
struct DLPackVersion {
  uint32_t major;
  uint32_t minor;
};
struct DLManagedTensorVersioned {
  DLPackVersion version;
  void* manager_ctx;
  void (*deleter)(DLManagedTensorVersioned* self);
  uint64_t flags;  // bit 0: read-only
  DLTensor dl_tensor;
};
}

/// Where a tensor's elements sit. The core sees a tensor as one span of `numel` elements, so it
/// takes any dense, non-overlapping layout (C-contiguous, channels-last, a permutation): tensors
/// that are updated together must then share it, element for element (see same_layout).
struct Layout {
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;  // in elements; 0 for dimensions of size 1 (they do not move)
  bool contiguous = true;        // C order (row-major)
};

/// A borrowed tensor: the descriptor plus what keeps the memory alive during the call.
struct TensorRef {
  ga_tensor desc;
  Layout layout;
  py::object keep_alive;
};

/// Import `obj` (an object with __dlpack__, or a DLPack capsule). Checks dtype, device and that
/// the elements form one dense span; raises TypeError/ValueError naming `name`.
TensorRef import_tensor(py::handle obj, const std::string& name, bool writable);

/// Refuse a tensor that is not C-contiguous (for callers that index it by shape).
void require_contiguous(const Layout& layout, const std::string& name);

/// Refuse a pair of tensors updated element for element whose layouts differ: both must be
/// C-contiguous, or have the same shape and strides. `name` is the one that is refused.
void same_layout(const Layout& ref, const Layout& other, const std::string& name,
                 const std::string& ref_name);

}  // namespace python
}  // namespace ga

#endif  // GRADIENT_ACCUMULATOR_PYTHON_DLPACK_H_
