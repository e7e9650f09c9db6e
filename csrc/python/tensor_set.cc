// Registered tensor sets (see tensor_set.h).
#include "tensor_set.h"

#include <cstring>
#include <utility>

namespace ga {
namespace python {

namespace {

/// torch's own accessors, looked up once from the torch module a tensor came from (nothing here
/// needs torch to be installed). Leaked on purpose: they outlive the interpreter's teardown.
struct TorchAccess {
  PyTypeObject* tensor = nullptr;     // torch.Tensor
  PyTypeObject* parameter = nullptr;  // torch.nn.Parameter
  PyObject* dtype = nullptr;          // getset descriptors
  PyObject* shape = nullptr;
  PyObject* numel = nullptr;
  PyObject* data_ptr = nullptr;  // method descriptors
  PyObject* is_contiguous = nullptr;
  PyObject* stride = nullptr;
  PyObject* is_neg = nullptr;
  PyObject* get_device = nullptr;
  PyObject* dtypes[4] = {};  // float32, float16, bfloat16, float64
  ga_dtype codes[4] = {kGaFloat32, kGaFloat16, kGaBFloat16, kGaFloat64};
};

/// The accessors when `obj` is exactly a torch.Tensor or torch.nn.Parameter (subclasses may
/// override anything and take the DLPack path), else nullptr.
const TorchAccess* torch_access(PyObject* obj) {
  static TorchAccess access;
  static bool looked_up = false;
  PyTypeObject* type = Py_TYPE(obj);
  if (access.tensor != nullptr) {
    return (type == access.tensor || type == access.parameter) ? &access : nullptr;
  }
  if (looked_up) return nullptr;
  const char* tp = type->tp_name;
  if (std::strcmp(tp, "Tensor") != 0 && std::strcmp(tp, "Parameter") != 0) return nullptr;
  py::object module = py::getattr(reinterpret_cast<PyObject*>(type), "__module__", py::none());
  if (module.is_none() || py::str(module).cast<std::string>().rfind("torch", 0) != 0)
    return nullptr;
  looked_up = true;
  py::module_ torch = py::module_::import("torch");
  py::object tensor = torch.attr("Tensor");
  auto keep = [](py::object o) { return o.release().ptr(); };
  access.dtype = keep(tensor.attr("dtype"));
  access.shape = keep(tensor.attr("shape"));
  access.data_ptr = keep(tensor.attr("data_ptr"));
  access.numel = keep(tensor.attr("numel"));
  access.is_contiguous = keep(tensor.attr("is_contiguous"));
  access.stride = keep(tensor.attr("stride"));
  access.is_neg = keep(tensor.attr("is_neg"));
  access.get_device = keep(tensor.attr("get_device"));
  const char* names[4] = {"float32", "float16", "bfloat16", "float64"};
  for (int k = 0; k < 4; ++k) access.dtypes[k] = keep(torch.attr(names[k]));
  access.parameter = reinterpret_cast<PyTypeObject*>(keep(torch.attr("nn").attr("Parameter")));
  access.tensor = reinterpret_cast<PyTypeObject*>(keep(tensor));
  return (type == access.tensor || type == access.parameter) ? &access : nullptr;
}

/// A getset descriptor's value on `obj` (a new reference; nullptr with an exception set).
PyObject* getset(PyObject* descr, PyObject* obj) {
  return Py_TYPE(descr)->tp_descr_get(descr, obj, reinterpret_cast<PyObject*>(Py_TYPE(obj)));
}

/// A method descriptor called on `obj` without arguments (a new reference).
PyObject* call0(PyObject* method, PyObject* obj) {
  return PyObject_Vectorcall(method, &obj, 1, nullptr);
}

/// A new reference as a py::object, raising the pending Python error for nullptr.
py::object own(PyObject* o) {
  if (o == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(o);
}

std::string item(const std::string& name, size_t i) { return name + "[" + std::to_string(i) + "]"; }

[[noreturn]] void stale(const std::string& who, const std::string& what) {
  throw StaleTensorError(who + " " + what +
                         " since its tensor set was registered; register the tensors again "
                         "(core.tensor_set)");
}

bool same_desc(const ga_tensor& a, const ga_tensor& b) {
  return a.data == b.data && a.numel == b.numel && a.dtype == b.dtype &&
         a.device_type == b.device_type && a.device_id == b.device_id;
}

}  // namespace

TensorSet::TensorSet(py::handle tensors, bool writable, const std::string& name)
    : writable_(writable) {
  if (py::isinstance<py::str>(tensors) || !py::isinstance<py::sequence>(tensors) ||
      py::hasattr(tensors, "__dlpack__"))
    throw py::type_error(name + " must be a list or tuple of tensors");
  py::sequence seq = py::reinterpret_borrow<py::sequence>(tensors);
  entries_.reserve(seq.size());
  for (size_t i = 0; i < seq.size(); ++i) {
    py::object obj = seq[i];
    const std::string who = item(name, i);
    if (PyCapsule_CheckExact(obj.ptr()))
      throw py::type_error(who +
                           " is a DLPack capsule, which can be read once; register the "
                           "tensor itself");
    TensorRef r = import_tensor(obj, who, writable);
    SetEntry e;
    e.desc = r.desc;
    e.layout = std::move(r.layout);
    r.keep_alive = py::none();  // the capsule holds the tensor: drop it, keep a weak reference
    PyObject* weak = PyWeakref_NewRef(obj.ptr(), nullptr);
    if (weak != nullptr) {
      e.ref = py::reinterpret_steal<py::object>(weak);
      e.weak = true;
    } else {
      PyErr_Clear();
      e.ref = obj;
    }
    if (const TorchAccess* t = torch_access(obj.ptr())) {
      e.dtype = own(getset(t->dtype, obj.ptr()));
      e.shape = own(getset(t->shape, obj.ptr()));
      e.strides = e.layout.contiguous ? py::none() : own(call0(t->stride, obj.ptr()));
      e.data_ptr = PyLong_AsSize_t(own(call0(t->data_ptr, obj.ptr())).ptr());
      if (PyErr_Occurred()) throw py::error_already_set();
      // The DLPack export of a negative-bit view is of a resolved copy: re-import those.
      const bool neg = py::bool_(own(call0(t->is_neg, obj.ptr())));
      e.fast =
          !neg && (e.desc.numel == 0 || reinterpret_cast<uintptr_t>(e.desc.data) == e.data_ptr);
    }
    entries_.push_back(std::move(e));
  }
}

bool TensorSet::is_cuda() const {
  return !entries_.empty() && entries_[0].desc.device_type == kGaCUDA;
}

int32_t TensorSet::device_id() const { return entries_.empty() ? 0 : entries_[0].desc.device_id; }

py::object TensorSet::get(size_t i) const {
  const SetEntry& e = entries_.at(i);
  if (!e.weak) return e.ref;
  return py::reinterpret_borrow<py::object>(PyWeakref_GetObject(e.ref.ptr()));
}

namespace {

/// Re-check a set's tensors for a call; their descriptors go to `out`.
void check_set(const std::shared_ptr<TensorSet>& set, const std::string& name, bool writable,
               Tensors& out) {
  if (writable && !set->writable())
    throw py::value_error(name +
                          " is a tensor set registered with writable=False, but is "
                          "written to here");
  const auto& entries = set->entries();
  out.desc.reserve(entries.size());
  out.layout.reserve(entries.size());
  out.held.reserve(entries.size());
  for (size_t i = 0; i < entries.size(); ++i) {
    const SetEntry& e = entries[i];
    PyObject* obj = e.weak ? PyWeakref_GetObject(e.ref.ptr()) : e.ref.ptr();
    if (obj == nullptr) throw py::error_already_set();
    if (obj == Py_None) stale(item(name, i), "was freed");
    out.held.push_back(py::reinterpret_borrow<py::object>(obj));
    const TorchAccess* t = e.fast ? torch_access(obj) : nullptr;
    if (t != nullptr) {
      py::object dtype = own(getset(t->dtype, obj));
      if (!dtype.is(e.dtype))
        stale(item(name, i), "changed dtype from " + py::str(e.dtype).cast<std::string>() + " to " +
                                 py::str(dtype).cast<std::string>());
      // The core sees a span of numel elements: the element count, the data pointer and the
      // layout are what it depends on (torch.Size is costly to make: only for non-C layouts).
      const long long numel = PyLong_AsLongLong(own(call0(t->numel, obj)).ptr());
      if (PyErr_Occurred()) throw py::error_already_set();
      if (numel != e.desc.numel)
        stale(item(name, i), "was resized from " + std::to_string(e.desc.numel) + " to " +
                                 std::to_string(numel) + " elements");
      const size_t ptr = PyLong_AsSize_t(own(call0(t->data_ptr, obj)).ptr());
      if (PyErr_Occurred()) throw py::error_already_set();
      if (ptr != e.data_ptr) stale(item(name, i), "was re-allocated or moved to another device");
      bool same;
      if (e.strides.is_none()) {
        same = own(call0(t->is_contiguous, obj)).ptr() == Py_True;
      } else {
        const int s =
            PyObject_RichCompareBool(own(call0(t->stride, obj)).ptr(), e.strides.ptr(), Py_EQ);
        const int z = s == 1 ? PyObject_RichCompareBool(own(getset(t->shape, obj)).ptr(),
                                                        e.shape.ptr(), Py_EQ)
                             : s;
        if (z < 0) throw py::error_already_set();
        same = z == 1;
      }
      if (!same) stale(item(name, i), "changed its memory layout (strides)");
    } else {
      // Anything else is imported again and compared: the checks of an unregistered call.
      out.refs.push_back(import_tensor(obj, item(name, i), writable));
      const TensorRef& r = out.refs.back();
      if (!same_desc(r.desc, e.desc)) {
        if (r.desc.dtype != e.desc.dtype) stale(item(name, i), "changed dtype");
        if (r.desc.numel != e.desc.numel) stale(item(name, i), "was resized");
        stale(item(name, i), "was re-allocated or moved to another device");
      }
      if (r.layout.shape != e.layout.shape || r.layout.strides != e.layout.strides)
        stale(item(name, i), "was reshaped or changed its memory layout");
    }
    out.desc.push_back(e.desc);
    out.layout.push_back(&e.layout);
  }
}

/// A plain torch tensor `obj` typed (any supported dtype), shaped, laid out and placed like
/// registered `like`: its descriptor, read through torch's accessors. False (no error pending)
/// for anything else, which the caller imports through DLPack.
bool fast_like(PyObject* obj, const SetEntry& like, ga_tensor& desc) {
  const TorchAccess* t = torch_access(obj);
  if (t == nullptr || like.shape.is_none()) return false;
  PyObject* dtype = getset(t->dtype, obj);
  if (dtype == nullptr) return PyErr_Clear(), false;
  int k = 0;
  while (k < 4 && dtype != t->dtypes[k]) ++k;
  Py_DECREF(dtype);
  if (k == 4) return false;
  PyObject* r = call0(t->numel, obj);
  if (r == nullptr) return PyErr_Clear(), false;
  const long long numel = PyLong_AsLongLong(r);
  Py_DECREF(r);
  if (PyErr_Occurred()) return PyErr_Clear(), false;
  if (numel != like.desc.numel) return false;
  if (like.strides.is_none()) {
    r = call0(t->is_contiguous, obj);
    if (r == nullptr) return PyErr_Clear(), false;
    const bool ok = r == Py_True;
    Py_DECREF(r);
    if (!ok) return false;
  } else {
    r = call0(t->stride, obj);
    if (r == nullptr) return PyErr_Clear(), false;
    int same = PyObject_RichCompareBool(r, like.strides.ptr(), Py_EQ);
    Py_DECREF(r);
    if (same != 1) return PyErr_Clear(), false;
    r = getset(t->shape, obj);
    if (r == nullptr) return PyErr_Clear(), false;
    same = PyObject_RichCompareBool(r, like.shape.ptr(), Py_EQ);
    Py_DECREF(r);
    if (same != 1) return PyErr_Clear(), false;
  }
  r = call0(t->is_neg, obj);
  if (r == nullptr) return PyErr_Clear(), false;
  const bool neg = r != Py_False;
  Py_DECREF(r);
  if (neg) return false;
  r = call0(t->get_device, obj);
  if (r == nullptr) return PyErr_Clear(), false;
  const long device = PyLong_AsLong(r);
  Py_DECREF(r);
  if (PyErr_Occurred()) return PyErr_Clear(), false;
  const bool cuda = like.desc.device_type == kGaCUDA;
  if (cuda ? device != like.desc.device_id : device != -1) return false;
  r = call0(t->data_ptr, obj);
  if (r == nullptr) return PyErr_Clear(), false;
  void* data = PyLong_AsVoidPtr(r);
  Py_DECREF(r);
  if (PyErr_Occurred()) return PyErr_Clear(), false;
  if (data == nullptr && like.desc.numel > 0) return false;  // e.g. a meta tensor
  desc.data = data;
  desc.numel = like.desc.numel;
  desc.dtype = t->codes[k];
  desc.device_type = like.desc.device_type;
  desc.device_id = like.desc.device_id;
  return true;
}

}  // namespace

Tensors tensor_list(py::handle obj, const std::string& name, bool writable, const Tensors* like) {
  Tensors out;
  if (py::isinstance<TensorSet>(obj)) {
    out.set = py::cast<std::shared_ptr<TensorSet>>(obj);
    check_set(out.set, name, writable, out);
    return out;
  }
  if (py::isinstance<py::str>(obj) || !py::isinstance<py::sequence>(obj) ||
      py::hasattr(obj, "__dlpack__"))
    throw py::type_error(name + " must be a list or tuple of tensors");
  py::sequence s = py::reinterpret_borrow<py::sequence>(obj);
  const size_t n = s.size();
  out.desc.reserve(n);
  out.layout.reserve(n);
  out.refs.reserve(n);  // layouts point into refs: no reallocation
  const bool fast = like != nullptr && like->set != nullptr && !writable;
  if (fast) out.held.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    py::object t = s[i];
    ga_tensor d{};
    if (fast && i < like->set->size() && fast_like(t.ptr(), like->set->entries()[i], d)) {
      out.desc.push_back(d);
      out.layout.push_back(&like->set->entries()[i].layout);
      out.held.push_back(std::move(t));
      continue;
    }
    out.refs.push_back(import_tensor(t, item(name, i), writable));
    out.desc.push_back(out.refs.back().desc);
    out.layout.push_back(&out.refs.back().layout);
  }
  return out;
}

void same_layouts(const Tensors& a, const std::string& a_name, const Tensors& b,
                  const std::string& b_name) {
  const size_t n = std::min(a.layout.size(), b.layout.size());
  for (size_t i = 0; i < n; ++i)
    if (a.layout[i] != b.layout[i])
      same_layout(*a.layout[i], *b.layout[i], item(b_name, i), item(a_name, i));
}

void bind_tensor_set(py::module_& m) {
  py::register_exception<StaleTensorError>(m, "StaleTensorError", PyExc_ValueError);
  py::class_<TensorSet, std::shared_ptr<TensorSet>>(
      m, "TensorSet", py::dynamic_attr(),
      "A list of tensors imported and checked once (gradient_accumulator.core.TensorSet).")
      .def(py::init<py::handle, bool, const std::string&>(), py::arg("tensors"),
           py::arg("writable") = true, py::arg("name") = "tensors")
      .def("__len__", &TensorSet::size)
      .def("__getitem__",
           [](const TensorSet& s, int64_t i) {
             const int64_t n = static_cast<int64_t>(s.size());
             if (i < 0) i += n;
             if (i < 0 || i >= n) throw py::index_error("tensor set index out of range");
             return s.get(static_cast<size_t>(i));
           })
      .def_property_readonly("writable", &TensorSet::writable)
      .def_property_readonly("is_cuda", &TensorSet::is_cuda);
}

}  // namespace python
}  // namespace ga
