// Registered tensor sets (see tensor_set.h).
#include "tensor_set.h"

#include <cstdlib>
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

/// Where torch keeps a tensor's metadata: the byte offsets, in torch's own objects, of the fields
/// a registered tensor's re-check compares (TensorImpl: storage, storage offset, element count,
/// sizes and strides, dtype, device, dispatch keys; StorageImpl: the data pointer). They are not
/// a public interface, so nothing here assumes them: they are found once, by probing tensors
/// whose values are known (through torch's public accessors) for the one offset that holds each
/// value in every probe. A field not found, or found at more than one offset, leaves the direct
/// reads off and every re-check goes through torch's accessors as before. A direct read only
/// ever confirms that nothing changed: any difference falls back to the accessors, which name
/// what changed.
struct TorchLayout {
  bool ok = false;
  size_t impl = 0;  // THPVariable: the TensorImpl*
  size_t storage = 0, storage_offset = 0, numel = 0, ndim = 0, sizes = 0, strides = 0, dtype = 0,
         device = 0, keys = 0;  // TensorImpl
  size_t storage_data = 0;      // StorageImpl
  uint16_t dtype_code[4] = {};  // data_type_ of float32, float16, bfloat16, float64
};

// Probed extents: the Python object's head, a TensorImpl (176 bytes in torch 2.x), the start of
// a StorageImpl.
constexpr size_t kObjectSpan = 48;
constexpr size_t kImplSpan = 176;
constexpr size_t kStorageSpan = 64;
constexpr int kInlineDims = 5;

template <class T>
T read_at(const void* base, size_t offset) {
  T v;
  std::memcpy(&v, static_cast<const char*>(base) + offset, sizeof(T));
  return v;
}

/// A probe tensor and what torch's accessors say about it.
struct Probe {
  py::object tensor;
  const void* obj;
  const void* impl;
  uintptr_t storage, storage_data;
  int64_t storage_offset, numel;
  std::vector<int64_t> sizes, strides;
  int dtype;  // index into TorchAccess::dtypes
};

Probe make_probe(py::module_& torch, int dtype, const char* name, std::vector<int64_t> sizes,
                 std::vector<int64_t> strides, int64_t offset) {
  int64_t span = 1;
  for (size_t d = 0; d < sizes.size(); ++d) span += (sizes[d] - 1) * strides[d];
  py::object base = torch.attr("empty")(offset + span, py::arg("dtype") = torch.attr(name));
  py::tuple shape(sizes.size()), step(strides.size());
  for (size_t d = 0; d < sizes.size(); ++d) {
    shape[d] = py::int_(sizes[d]);
    step[d] = py::int_(strides[d]);
  }
  py::object t = base.attr("as_strided")(shape, step, offset);
  py::object st = t.attr("untyped_storage")();
  Probe p;
  p.tensor = t;
  p.obj = t.ptr();
  p.impl = reinterpret_cast<const void*>(t.attr("_cdata").cast<uintptr_t>());
  p.storage = st.attr("_cdata").cast<uintptr_t>();
  p.storage_data = st.attr("data_ptr")().cast<uintptr_t>();
  p.storage_offset = t.attr("storage_offset")().cast<int64_t>();
  p.numel = t.attr("numel")().cast<int64_t>();
  p.sizes = std::move(sizes);
  p.strides = std::move(strides);
  p.dtype = dtype;
  return p;
}

/// The one offset in [from, to) (step `step`) where `holds(offset)` is true, or `to` when there
/// is none or more than one.
template <class F>
size_t only_offset(size_t from, size_t to, size_t step, F holds) {
  size_t found = to;
  for (size_t o = from; o + 8 <= to; o += step) {
    if (!holds(o)) continue;
    if (found != to) return to;
    found = o;
  }
  return found;
}

TorchLayout probe_layout() {
  TorchLayout L;
  py::module_ torch = py::module_::import("torch");
  // Distinct sizes, strides and offsets, every dtype, a non-C layout, the most inline dims.
  std::vector<Probe> p;
  p.push_back(make_probe(torch, 0, "float32", {13, 17, 19}, {1, 13, 221}, 1237));
  p.push_back(make_probe(torch, 3, "float64", {5, 7}, {7, 1}, 11));
  p.push_back(make_probe(torch, 1, "float16", {29}, {1}, 3));
  p.push_back(make_probe(torch, 2, "bfloat16", {2, 3, 5, 7, 11}, {1155, 385, 77, 11, 1}, 0));
  p.push_back(make_probe(torch, 0, "float32", {6}, {1}, 0));
  p.push_back(make_probe(torch, 0, "float32", {4, 9}, {1, 4}, 2));
  const Probe& plain = p[4];
  py::object neg_view = plain.tensor.attr("_neg_view")();
  const void* neg = reinterpret_cast<const void*>(neg_view.attr("_cdata").cast<uintptr_t>());

  auto all = [&](auto f) {
    for (const Probe& q : p)
      if (!f(q)) return false;
    return true;
  };
  const size_t none = ~size_t{0};
  auto pick = [&](size_t from, size_t to, size_t step, auto holds) {
    const size_t o = only_offset(from, to, step, holds);
    return o == to ? none : o;
  };
  // PyObject_HEAD, then the at::Tensor (a TensorImpl*).
  L.impl = pick(sizeof(PyObject), kObjectSpan, 8, [&](size_t o) {
    return all([&](const Probe& q) { return read_at<const void*>(q.obj, o) == q.impl; });
  });
  if (L.impl == none) return L;
  auto impl_word = [&](auto value) {
    return pick(8, kImplSpan, 8, [&](size_t o) {
      return all([&](const Probe& q) {
        return read_at<uint64_t>(q.impl, o) == static_cast<uint64_t>(value(q));
      });
    });
  };
  L.storage = impl_word([](const Probe& q) { return q.storage; });
  L.storage_offset = impl_word([](const Probe& q) { return q.storage_offset; });
  L.numel = impl_word([](const Probe& q) { return q.numel; });
  L.ndim = impl_word([](const Probe& q) { return q.sizes.size(); });
  auto impl_seq = [&](bool strides) {
    return pick(8, kImplSpan - 8 * kInlineDims, 8, [&](size_t o) {
      return all([&](const Probe& q) {
        const auto& v = strides ? q.strides : q.sizes;
        for (size_t d = 0; d < v.size(); ++d)
          if (read_at<int64_t>(q.impl, o + 8 * d) != v[d]) return false;
        return true;
      });
    });
  };
  L.sizes = impl_seq(false);
  L.strides = impl_seq(true);
  if (L.storage == none || L.storage_offset == none || L.numel == none || L.ndim == none ||
      L.sizes == none || L.strides == none)
    return L;
  // The first word that holds the data pointer (the allocation's context, later, is often the
  // same address).
  L.storage_data = 8;
  while (L.storage_data < kStorageSpan && !all([&](const Probe& q) {
           return read_at<uintptr_t>(reinterpret_cast<const void*>(q.storage), L.storage_data) ==
                  q.storage_data;
         }))
    L.storage_data += 8;
  if (L.storage_data >= kStorageSpan) return L;
  // The dtype: 16 bits, the same for every probe of one dtype, different across dtypes.
  L.dtype = pick(8, kImplSpan, 2, [&](size_t o) {
    uint16_t code[4];
    bool seen[4] = {};
    for (const Probe& q : p) {
      const uint16_t v = read_at<uint16_t>(q.impl, o);
      if (seen[q.dtype] && code[q.dtype] != v) return false;
      seen[q.dtype] = true;
      code[q.dtype] = v;
    }
    for (int a = 0; a < 4; ++a)
      for (int b = a + 1; b < 4; ++b)
        if (code[a] == code[b]) return false;
    return true;
  });
  if (L.dtype == none) return L;
  for (const Probe& q : p) L.dtype_code[q.dtype] = read_at<uint16_t>(q.impl, L.dtype);
  // The device: a CPU tensor's optional<Device> holds {type 0, index -1, engaged}.
  L.device = pick(8, kImplSpan - 5, 1, [&](size_t o) {
    return all([&](const Probe& q) {
      const auto* b = static_cast<const uint8_t*>(q.impl) + o;
      return b[0] == 0 && b[1] == 0xff && b[2] == 1;
    });
  });
  // The dispatch keys: the same for every probe, one bit more in a negative-bit view.
  L.keys = pick(8, kImplSpan, 8, [&](size_t o) {
    const uint64_t k = read_at<uint64_t>(plain.impl, o);
    const uint64_t d = k ^ read_at<uint64_t>(neg, o);
    if (d == 0 || (d & (d - 1)) != 0) return false;
    return all([&](const Probe& q) { return read_at<uint64_t>(q.impl, o) == k; });
  });
  L.ok = L.device != none && L.keys != none;
  return L;
}

/// The layout, probed on first use (nullptr when the direct reads are off). Callers hold the
/// GIL; the probe runs Python code, during which another thread may take the GIL and call here:
/// it gets nullptr (torch's accessors) rather than waiting on a static initialiser while holding
/// the GIL the probe needs.
const TorchLayout* torch_layout() {
  static const TorchLayout* layout = nullptr;
  static int state = 0;  // 0: not probed, 1: probing, 2: done
  if (state != 0) return state == 2 ? layout : nullptr;
  state = 1;
  TorchLayout L;
  const char* env = std::getenv("GA_TORCH_DIRECT_READS");
  if (env != nullptr && std::string(env) == "0") {
    state = 2;  // turned off by the user: every re-check through torch's accessors
    return nullptr;
  }
  try {
    L = probe_layout();
  } catch (const std::exception&) {
    L.ok = false;  // a torch without an accessor the probes use, or one they cannot read
  }
  layout = L.ok ? new TorchLayout(L) : nullptr;  // leaked on purpose, like TorchAccess
  state = 2;
  return layout;
}

/// `obj`'s metadata read directly (exactly a torch.Tensor or nn.Parameter, its sizes inline):
/// false otherwise.
bool snap_of(const TorchAccess& t, const TorchLayout& L, PyObject* obj, TorchSnap& s) {
  if (Py_TYPE(obj) != t.tensor && Py_TYPE(obj) != t.parameter) return false;
  const void* impl = read_at<const void*>(obj, L.impl);
  if (impl == nullptr) return false;
  s.ndim = read_at<int64_t>(impl, L.ndim);
  if (s.ndim < 0 || s.ndim > kInlineDims) return false;
  s.impl = impl;
  s.storage = read_at<uintptr_t>(impl, L.storage);
  if (s.storage == 0) return false;
  s.storage_data = read_at<uintptr_t>(reinterpret_cast<const void*>(s.storage), L.storage_data);
  s.storage_offset = read_at<int64_t>(impl, L.storage_offset);
  s.numel = read_at<int64_t>(impl, L.numel);
  for (int64_t d = 0; d < s.ndim; ++d) {
    s.sizes[d] = read_at<int64_t>(impl, L.sizes + 8 * d);
    s.strides[d] = read_at<int64_t>(impl, L.strides + 8 * d);
  }
  s.keys = read_at<uint64_t>(impl, L.keys);
  s.dtype = read_at<uint16_t>(impl, L.dtype);
  std::memcpy(s.device, static_cast<const char*>(impl) + L.device, 3);
  return true;
}

/// Same shape, strides, dispatch keys and device.
bool same_form(const TorchSnap& a, const TorchSnap& b) {
  if (a.ndim != b.ndim || a.numel != b.numel || a.keys != b.keys ||
      std::memcmp(a.device, b.device, 3) != 0)
    return false;
  for (int64_t d = 0; d < a.ndim; ++d)
    if (a.sizes[d] != b.sizes[d] || a.strides[d] != b.strides[d]) return false;
  return true;
}

bool same_snap(const TorchSnap& a, const TorchSnap& b) {
  return a.impl == b.impl && a.storage == b.storage && a.storage_data == b.storage_data &&
         a.storage_offset == b.storage_offset && a.dtype == b.dtype && same_form(a, b);
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
      const TorchLayout* L = e.fast ? torch_layout() : nullptr;
      e.has_snap = L != nullptr && snap_of(*t, *L, obj.ptr(), e.snap);
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
    const TorchAccess* access = e.has_snap ? torch_access(obj) : nullptr;
    if (access != nullptr) {
      // Read straight from torch's objects: unchanged, the registration's checks still hold.
      // (No access: the object's class was changed since; it is imported and compared.)
      TorchSnap now;
      if (snap_of(*access, *torch_layout(), obj, now) && same_snap(now, e.snap)) {
        out.desc.push_back(e.desc);
        out.layout.push_back(&e.layout);
        continue;
      }
    }
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
  if (like.has_snap) {
    // Read straight from torch's objects: the same shape, strides, device and dispatch keys as
    // `like` (so not a negative-bit view, nor a wrapper), one of the four dtypes.
    TorchSnap s;
    if (snap_of(*t, *torch_layout(), obj, s) && same_form(s, like.snap)) {
      static const size_t itemsize[4] = {4, 2, 2, 8};
      const TorchLayout& L = *torch_layout();
      int k = 0;
      while (k < 4 && s.dtype != L.dtype_code[k]) ++k;
      if (k < 4 && (s.storage_data != 0 || like.desc.numel == 0)) {
        desc.data = reinterpret_cast<void*>(s.storage_data + s.storage_offset * itemsize[k]);
        desc.numel = like.desc.numel;
        desc.dtype = t->codes[k];
        desc.device_type = like.desc.device_type;
        desc.device_id = like.desc.device_id;
        return true;
      }
    }
  }
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
  for (size_t i = 0; i < n; ++i) {
    const Layout& x = *a.layout[i];
    const Layout& y = *b.layout[i];
    // The names are built only for a pair that differs (one call checks every pair of its
    // lists: two strings per tensor cost more than the rest of a call on small tensors).
    if (&x == &y || (x.contiguous && y.contiguous) ||
        (x.shape == y.shape && x.strides == y.strides))
      continue;
    same_layout(x, y, item(b_name, i), item(a_name, i));
  }
}

void bind_tensor_set(py::module_& m) {
  py::register_exception<StaleTensorError>(m, "StaleTensorError", PyExc_ValueError);
  m.def(
      "_torch_direct_reads",
      [] {
        return torch_access(py::module_::import("torch").attr("zeros")(1).ptr()) != nullptr &&
               torch_layout() != nullptr;
      },
      "Whether registered torch tensors are re-checked by reading torch's metadata directly.");
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
