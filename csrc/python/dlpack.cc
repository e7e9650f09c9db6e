// DLPack import (framework tensors → descriptors) and export (arena views → capsules).
#include "dlpack.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <stdexcept>

namespace ga {
namespace python {

namespace {

ga_dtype to_ga_dtype(const DLDataType& t, const std::string& name) {
  if (t.lanes == 1) {
    if (t.code == 2 && t.bits == 32) return kGaFloat32;
    if (t.code == 2 && t.bits == 16) return kGaFloat16;
    if (t.code == 2 && t.bits == 64) return kGaFloat64;
    if (t.code == 4 && t.bits == 16) return kGaBFloat16;
  }
  throw py::type_error(name + " has an unsupported dtype (DLPack code " + std::to_string(t.code) +
                       ", " + std::to_string(t.bits) +
                       " bits); expected float32, float16, bfloat16 or float64");
}

TensorRef from_dltensor(const DLTensor& t, const std::string& name, bool read_only, bool writable,
                        py::object keep) {
  TensorRef ref;
  ref.keep_alive = std::move(keep);
  ref.desc.dtype = to_ga_dtype(t.dtype, name);
  switch (t.device.device_type) {
    case 1:
    case 3:
      ref.desc.device_type = kGaCPU;
      break;
    case 2:
    case 13:
      ref.desc.device_type = kGaCUDA;
      break;
    default:
      throw py::type_error(name + " lives on an unsupported device (DLPack device type " +
                           std::to_string(t.device.device_type) + "); expected CPU or CUDA");
  }
  ref.desc.device_id = ref.desc.device_type == kGaCPU ? 0 : t.device.device_id;
  int64_t numel = 1;
  if (t.ndim < 0 || (t.ndim > 0 && t.shape == nullptr))
    throw py::value_error(name + " has an invalid DLPack shape");
  ref.layout.shape.assign(t.shape, t.shape + t.ndim);
  for (int64_t d : ref.layout.shape) {
    if (d < 0) throw py::value_error(name + " has a negative dimension");
    if (d != 0 && numel > std::numeric_limits<int64_t>::max() / d)
      throw py::value_error(name + ": its element count overflows int64");
    numel *= d;
  }
  ref.layout.strides.assign(static_cast<size_t>(t.ndim), 0);
  if (t.strides != nullptr && numel > 1) {
    // Dense and non-overlapping: ordered by stride, each dimension steps over exactly the
    // elements of the faster ones. Size-1 dimensions never move and are left out.
    std::vector<int32_t> order;
    for (int32_t d = 0; d < t.ndim; ++d) {
      if (t.shape[d] != 1) order.push_back(d);
      if (t.shape[d] != 1) ref.layout.strides[d] = t.strides[d];
    }
    std::stable_sort(order.begin(), order.end(),
                     [&](int32_t a, int32_t b) { return t.strides[a] > t.strides[b]; });
    int64_t expected = 1;
    for (size_t k = order.size(); k-- > 0;) {
      if (t.strides[order[k]] != expected)
        throw py::value_error(name + " is not contiguous; pass a contiguous tensor");
      expected *= t.shape[order[k]];
    }
    int64_t c_order = 1;
    for (int32_t d = t.ndim - 1; d >= 0; --d) {
      if (t.shape[d] != 1 && t.strides[d] != c_order) ref.layout.contiguous = false;
      c_order *= t.shape[d];
    }
  }
  if (ref.layout.contiguous) {
    int64_t c_order = 1;
    for (int32_t d = t.ndim - 1; d >= 0; --d) {
      if (t.shape[d] != 1) ref.layout.strides[d] = c_order;
      c_order *= t.shape[d];
    }
  }
  if (writable && read_only) throw py::value_error(name + " is read-only but is written to");
  ref.desc.numel = numel;
  ref.desc.data = static_cast<char*>(t.data) + t.byte_offset;
  return ref;
}

}  // namespace

namespace {

/// torch functions the import needs, looked up once (leaked on purpose: they outlive the
/// interpreter's teardown).
struct TorchFns {
  PyObject* to_dlpack = nullptr;     // torch's C-level DLPack exporter
  PyObject* is_neg = nullptr;        // torch.Tensor.is_neg, unbound
  PyObject* is_inference = nullptr;  // torch.Tensor.is_inference, unbound
  PyObject* inference_mode_enabled = nullptr;
};

/// The torch functions when ``obj`` is a torch tensor, else nullptr. Looked up from the torch
/// module the tensor came from, so nothing here needs torch to be installed.
const TorchFns* torch_fns(const py::object& obj) {
  static TorchFns fns;
  PyTypeObject* type = Py_TYPE(obj.ptr());
  const char* tp = type->tp_name;
  if (std::strcmp(tp, "Tensor") != 0 && std::strcmp(tp, "Parameter") != 0) return nullptr;
  py::object module = py::getattr(reinterpret_cast<PyObject*>(type), "__module__", py::none());
  if (module.is_none() || py::str(module).cast<std::string>().rfind("torch", 0) != 0)
    return nullptr;
  if (fns.to_dlpack == nullptr) {
    py::module_ torch = py::module_::import("torch");
    auto keep = [](py::object o) { return o.release().ptr(); };
    fns.is_neg = keep(torch.attr("Tensor").attr("is_neg"));
    fns.is_inference = keep(torch.attr("Tensor").attr("is_inference"));
    fns.inference_mode_enabled = keep(torch.attr("is_inference_mode_enabled"));
    fns.to_dlpack = keep(py::module_::import("torch.utils.dlpack").attr("to_dlpack"));
  }
  return &fns;
}

bool call_flag(PyObject* fn, PyObject* arg) {
  PyObject* r = arg ? PyObject_CallOneArg(fn, arg) : PyObject_CallNoArgs(fn);
  if (r == nullptr) throw py::error_already_set();
  const int truth = PyObject_IsTrue(r);
  Py_DECREF(r);
  if (truth < 0) throw py::error_already_set();
  return truth != 0;
}

/// Frameworks whose arrays are immutable values for their users: JAX arrays and TensorFlow
/// tensors and variables. Writing through their DLPack buffer would change a value that other
/// references (and TensorFlow's own copy-on-write bookkeeping) take as fixed.
const char* immutable_framework(py::handle obj) {
  py::object module =
      py::getattr(reinterpret_cast<PyObject*>(Py_TYPE(obj.ptr())), "__module__", py::none());
  if (module.is_none()) return nullptr;
  const std::string m = py::str(module).cast<std::string>();
  if (m.rfind("jax", 0) == 0) return "a JAX array";
  if (m.rfind("tensorflow", 0) == 0 || m.rfind("tf_keras", 0) == 0) return "a TensorFlow tensor";
  return nullptr;
}

/// numpy before 2.1 exports no read-only array through DLPack (its legacy capsule cannot say
/// read-only). For such an array this returns a writable alias of the same memory, made from
/// its __array_interface__ (the alias keeps the array alive); the caller marks the imported
/// tensor read-only, so it is only ever read. None for anything else.
py::object numpy_read_only_alias(const py::object& src) {
  py::module_ np = py::module_::import("numpy");
  if (!py::isinstance(src, np.attr("ndarray")) || py::bool_(src.attr("flags").attr("writeable")))
    return py::none();
  py::dict face(src.attr("__array_interface__"));
  face["data"] = py::make_tuple(py::tuple(face["data"])[0], false);
  py::object holder = py::module_::import("types").attr("SimpleNamespace")();
  py::setattr(holder, "__array_interface__", face);
  py::setattr(holder, "base", src);
  return np.attr("asarray")(holder);
}

}  // namespace

TensorRef import_tensor(py::handle obj, const std::string& name, bool writable) {
  if (obj.is_none()) throw py::type_error(name + " is None; expected a tensor");
  py::object cap_obj;
  bool read_only = false;  // a read-only numpy array imported through its alias
  if (PyCapsule_CheckExact(obj.ptr())) {
    cap_obj = py::reinterpret_borrow<py::object>(obj);
  } else {
    py::object src = py::reinterpret_borrow<py::object>(obj);
    if (!py::hasattr(src, "__dlpack__"))
      throw py::type_error(
          name + " of type " + std::string(py::str(py::type::of(obj).attr("__name__"))) +
          " does not support DLPack; pass a numpy, torch, jax or tensorflow tensor");
    const TorchFns* torch = torch_fns(src);
    if (torch != nullptr) {
      // DLPack has no negative bit: torch exports a _neg_view() (or x.conj().imag) with the
      // un-negated memory. Read one through a resolved copy; never write one.
      if (call_flag(torch->is_neg, src.ptr())) {
        if (writable)
          throw py::value_error(name +
                                " is a negative-bit view (e.g. x._neg_view() or "
                                "x.conj().imag) and is written to; pass x.resolve_neg()");
        src = src.attr("resolve_neg")();
      }
      // torch forbids in-place updates of inference tensors outside inference mode.
      if (writable && call_flag(torch->is_inference, src.ptr()) &&
          !call_flag(torch->inference_mode_enabled, nullptr))
        throw py::value_error(name +
                              " is an inference-mode tensor, which torch allows no "
                              "in-place update of outside torch.inference_mode(); it is written "
                              "to here (clone it first)");
    } else if (writable) {
      if (const char* kind = immutable_framework(src))
        throw py::value_error(name + " is " + kind +
                              ", which is immutable, but is written to "
                              "here; pass a mutable buffer (e.g. a NumPy array or torch tensor)");
    }
    // torch refuses to export tensors that require grad; their storage is what we want.
    if (py::hasattr(src, "requires_grad") && py::bool_(src.attr("requires_grad")))
      src = src.attr("detach")();
    // torch.Tensor.__dlpack__ is Python code that costs several microseconds per tensor, which
    // dominates calls on many small tensors; torch's C-level exporter does the same in a tenth.
    if (torch != nullptr) {
      PyObject* cap = PyObject_CallOneArg(torch->to_dlpack, src.ptr());
      if (cap == nullptr) throw py::error_already_set();
      cap_obj = py::reinterpret_steal<py::object>(cap);
    } else {
      try {
        // Ask for a DLPack 1.x capsule first: it carries the read-only flag, so a read-only
        // array (numpy refuses to export one as a legacy capsule) can still be read from.
        try {
          cap_obj = src.attr("__dlpack__")(py::arg("max_version") = py::make_tuple(1, 0));
        } catch (py::error_already_set& e) {
          if (!e.matches(PyExc_TypeError)) throw;
          cap_obj = src.attr("__dlpack__")();  // a producer that predates max_version
        }
      } catch (py::error_already_set& e) {
        // numpy 1.23-2.0 refuse a read-only array with BufferError, numpy 1.22 with TypeError.
        const bool buffer_error = e.matches(PyExc_BufferError);
        if (!buffer_error && !e.matches(PyExc_TypeError)) throw;
        py::object alias = numpy_read_only_alias(src);
        const bool is_numpy = py::isinstance(src, py::module_::import("numpy").attr("ndarray"));
        if (alias.is_none() && !buffer_error && is_numpy)  // numpy 1.22: e.g. a bool array
          throw py::type_error(name + " has an unsupported dtype (numpy " +
                               std::string(py::str(src.attr("dtype"))) +
                               "); expected float32, float16, bfloat16 or float64");
        if (alias.is_none()) {
          if (!buffer_error) throw;
          throw py::value_error(name +
                                " cannot be exported through DLPack (read-only or not a plain "
                                "array): " +
                                std::string(e.what()));
        }
        cap_obj = alias.attr("__dlpack__")();
        read_only = true;
      }
    }
  }
  PyObject* cap = cap_obj.ptr();
  if (PyCapsule_IsValid(cap, "dltensor")) {
    auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(cap, "dltensor"));
    return from_dltensor(m->dl_tensor, name, read_only, writable, cap_obj);
  }
  if (PyCapsule_IsValid(cap, "dltensor_versioned")) {
    auto* m =
        static_cast<DLManagedTensorVersioned*>(PyCapsule_GetPointer(cap, "dltensor_versioned"));
    return from_dltensor(m->dl_tensor, name, (m->flags & 1u) != 0, writable, cap_obj);
  }
  throw py::value_error(name + " is a DLPack capsule that was already consumed");
}

namespace {
std::string dims(const std::vector<int64_t>& v) {
  std::string s = "(";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + (v.size() == 1 ? ",)" : ")");
}
}  // namespace

void require_contiguous(const Layout& layout, const std::string& name) {
  if (!layout.contiguous)
    throw py::value_error(name + " is not contiguous; pass a contiguous tensor");
}

void same_layout(const Layout& ref, const Layout& other, const std::string& name,
                 const std::string& ref_name) {
  if (ref.contiguous && other.contiguous) return;
  if (ref.shape == other.shape && ref.strides == other.strides) return;
  const std::string& odd = other.contiguous ? ref_name : name;
  throw py::value_error(odd + " is not contiguous and " + name + " (shape " + dims(other.shape) +
                        ", strides " + dims(other.strides) + ") is not laid out like " + ref_name +
                        " (shape " + dims(ref.shape) + ", strides " + dims(ref.strides) +
                        "): tensors updated together must share one memory layout");
}

}  // namespace python
}  // namespace ga
