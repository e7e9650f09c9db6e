// Registered tensor sets: a list of tensors imported and checked once, whose descriptors the
// core's calls reuse. A call re-checks cheaply what can have changed since (a tensor freed, its
// memory re-allocated or moved, resized, another dtype or layout) and refuses a set that is out
// of date, naming the tensor; it never reads through a stale pointer.
#ifndef GRADIENT_ACCUMULATOR_PYTHON_TENSOR_SET_H_
#define GRADIENT_ACCUMULATOR_PYTHON_TENSOR_SET_H_

#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "dlpack.h"

namespace ga {
namespace python {

/// A registered tensor changed since (Python: gradient_accumulator._C.StaleTensorError, a
/// ValueError).
class StaleTensorError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// What a plain torch tensor's metadata holds, read straight from torch's objects (see
/// tensor_set.cc, TorchLayout): two snapshots that compare equal describe the same elements at
/// the same address.
struct TorchSnap {
  const void* impl = nullptr;  // the tensor's TensorImpl
  uintptr_t storage = 0;       // its StorageImpl
  uintptr_t storage_data = 0;  // the storage's data pointer
  int64_t storage_offset = 0;  // in elements
  int64_t numel = 0;
  int64_t ndim = 0;
  int64_t sizes[5] = {};
  int64_t strides[5] = {};
  uint64_t keys = 0;  // dispatch keys (a negative-bit view, a wrapper tensor, ... differ)
  uint16_t dtype = 0;
  uint8_t device[3] = {};
};

/// One registered tensor.
struct SetEntry {
  py::object ref;         // a weak reference (a strong one for objects that take none)
  bool weak = false;      // whether `ref` is a weakref
  bool fast = false;      // a plain torch tensor: re-checked through torch's own accessors
  ga_tensor desc{};       // as the core takes it
  Layout layout;          // as imported
  py::object dtype;       // torch: the dtype object
  py::object shape;       // torch: the torch.Size
  py::object strides;     // torch: stride() when not contiguous, else None
  uintptr_t data_ptr{};   // torch: data_ptr()
  bool has_snap = false;  // torch: `snap` taken (its metadata can be read directly)
  TorchSnap snap;
};

/// A registered list of tensors (gradient_accumulator.core.TensorSet).
class TensorSet {
 public:
  TensorSet(py::handle tensors, bool writable, const std::string& name);

  size_t size() const { return entries_.size(); }
  bool writable() const { return writable_; }
  bool is_cuda() const;
  int32_t device_id() const;
  const std::vector<SetEntry>& entries() const { return entries_; }
  /// The tensor at `i` (None once freed).
  py::object get(size_t i) const;

 private:
  std::vector<SetEntry> entries_;
  bool writable_;
};

/// The tensors a core call takes for one list argument: their descriptors and layouts, and what
/// keeps them alive during the call.
struct Tensors {
  std::vector<ga_tensor> desc;
  std::vector<const Layout*> layout;
  std::vector<TensorRef> refs;     // imported for this call
  std::vector<py::object> held;    // members of a set, held for the call
  std::shared_ptr<TensorSet> set;  // the set, when one was passed

  bool is_cuda() const { return !desc.empty() && desc[0].device_type == kGaCUDA; }
  int32_t device_id() const { return desc.empty() ? 0 : desc[0].device_id; }
  ga_tensor_list list() const { return {desc.data(), static_cast<int64_t>(desc.size())}; }
};

/// `obj` as a call's list argument `name`: a registered TensorSet (re-checked), or a list or
/// tuple of tensors (imported). With `like`, plain torch tensors laid out, typed and placed like
/// `like`'s (a gradient for each registered accumulator) are taken through torch's accessors
/// instead of a DLPack export each; anything else is imported as usual.
Tensors tensor_list(py::handle obj, const std::string& name, bool writable,
                    const Tensors* like = nullptr);

/// Each pair i of `a` and `b` (updated element for element) shares one layout.
void same_layouts(const Tensors& a, const std::string& a_name, const Tensors& b,
                  const std::string& b_name);

/// Register the TensorSet class on the module.
void bind_tensor_set(py::module_& m);

}  // namespace python
}  // namespace ga

#endif  // GRADIENT_ACCUMULATOR_PYTHON_TENSOR_SET_H_
