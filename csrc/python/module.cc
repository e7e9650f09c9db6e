// gradient_accumulator._C: DLPack tensors → core descriptors, checks, GIL release, errors →
// Python exceptions (ValueError / TypeError / RuntimeError, naming the argument).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "../core/lists_checked.h"
#include "dlpack.h"
#include "gradient_accumulator/cpp.h"
#include "tensor_set.h"

namespace py = pybind11;
using ga::python::import_tensor;
using ga::python::require_contiguous;
using ga::python::same_layouts;
using ga::python::tensor_list;
using ga::python::TensorRef;
using ga::python::Tensors;
using ga::python::TensorSet;

namespace {

/// Call the core without the GIL and turn a failure into the matching Python exception.
template <typename F>
void call_core(F&& f) {
  ga_status status;
  std::string message, argument;
  {
    py::gil_scoped_release release;
    status = f();
    if (status != kGaOk) {
      message = ga_last_error();
      argument = ga_last_error_argument();
    }
  }
  // Every message names its argument; prefix the name where the core's text does not say it.
  if (!argument.empty() && message.find(argument) == std::string::npos)
    message = argument + ": " + message;
  switch (status) {
    case kGaOk:
      return;
    case kGaInvalidArgument:
      throw py::value_error(message);
    case kGaTypeError:
      throw py::type_error(message);
    default:
      throw std::runtime_error(message);
  }
}

/// The data pointer of an optional one-element device output (e.g. a flag) checked for dtype,
/// size and device; nullptr for None.
template <typename T>
T* scalar_out(const py::object& obj, const char* name, ga_dtype dtype, int64_t numel,
              ga_device_type device, int32_t device_id, TensorRef& keep) {
  if (obj.is_none()) return nullptr;
  keep = import_tensor(obj, name, true);
  if (keep.desc.dtype != dtype || keep.desc.numel != numel)
    throw py::type_error(std::string(name) + " must be a " +
                         (dtype == kGaFloat64 ? "float64" : "float32") + " tensor of " +
                         std::to_string(numel) + " element(s)");
  if (keep.desc.device_type != device || (device == kGaCUDA && keep.desc.device_id != device_id))
    throw py::type_error(std::string(name) + " must be on the same device as the tensors");
  return static_cast<T*>(keep.desc.data);
}

void* as_stream(uintptr_t stream) { return reinterpret_cast<void*>(stream); }

ga_accumulate_mode parse_mode(const std::string& mode) {
  if (mode == "sum" || mode == "mean") return kGaAccumulateSum;
  if (mode == "running_mean") return kGaAccumulateRunningMean;
  throw py::value_error("mode must be 'sum', 'mean' or 'running_mean', got '" + mode + "'");
}

/// A C enum's values as Python spells them: one table per enum serves both directions.
template <typename E>
struct EnumName {
  const char* name;
  E value;
};

constexpr EnumName<ga_optimizer> kOptimizerNames[] = {{"none", kGaOptimizerNone},
                                                      {"sgd", kGaOptimizerSGD},
                                                      {"adam", kGaOptimizerAdam},
                                                      {"adamw", kGaOptimizerAdamW}};
constexpr EnumName<ga_clip_mode> kClipNames[] = {
    {"none", kGaClipNone}, {"global_norm", kGaClipGlobalNorm}, {"agc", kGaClipAgc}};

template <typename E, size_t N>
E enum_from_name(const EnumName<E> (&table)[N], const std::string& name, const char* what) {
  std::string choices;
  for (size_t i = 0; i < N; ++i) {
    if (name == table[i].name) return table[i].value;
    choices += std::string(i == 0 ? "'" : i + 1 == N ? " or '" : ", '") + table[i].name + "'";
  }
  throw py::value_error(std::string(what) + " must be " + choices + ", got '" + name + "'");
}

template <typename E, size_t N>
const char* enum_name(const EnumName<E> (&table)[N], E value) {
  for (const EnumName<E>& e : table)
    if (e.value == value) return e.name;
  return table[0].name;
}

// A list of (int, "leading" | "trailing") tuples, read without building a string per entry;
// false for anything else (then converted the general way, with its errors).
bool parse_units_fast(const py::object& units, size_t n, std::vector<ga_units>& out) {
  if (!PyList_CheckExact(units.ptr()) || static_cast<size_t>(PyList_GET_SIZE(units.ptr())) != n)
    return false;
  out.resize(n);
  for (size_t i = 0; i < n; ++i) {
    PyObject* u = PyList_GET_ITEM(units.ptr(), static_cast<Py_ssize_t>(i));
    if (!PyTuple_CheckExact(u) || PyTuple_GET_SIZE(u) != 2) return false;
    PyObject* count = PyTuple_GET_ITEM(u, 0);
    PyObject* layout = PyTuple_GET_ITEM(u, 1);
    if (!PyLong_CheckExact(count) || !PyUnicode_CheckExact(layout)) return false;
    const long long c = PyLong_AsLongLong(count);
    if (c == -1 && PyErr_Occurred()) {
      PyErr_Clear();
      return false;
    }
    out[i].num_units = c;
    if (PyUnicode_CompareWithASCIIString(layout, "leading") == 0)
      out[i].layout = kGaUnitsLeading;
    else if (PyUnicode_CompareWithASCIIString(layout, "trailing") == 0)
      out[i].layout = kGaUnitsTrailing;
    else
      return false;
  }
  return true;
}

std::vector<ga_units> parse_units(const py::object& units, size_t n) {
  std::vector<ga_units> out;
  if (units.is_none()) return out;
  if (parse_units_fast(units, n, out)) return out;
  out.clear();
  auto seq = units.cast<std::vector<std::pair<int64_t, std::string>>>();
  if (seq.size() != n)
    throw py::value_error("units has " + std::to_string(seq.size()) + " entries but there are " +
                          std::to_string(n) + " tensors");
  for (size_t i = 0; i < seq.size(); ++i) {
    ga_units u{seq[i].first, kGaUnitsLeading};
    if (seq[i].second == "leading")
      u.layout = kGaUnitsLeading;
    else if (seq[i].second == "trailing")
      u.layout = kGaUnitsTrailing;
    else
      throw py::value_error("units[" + std::to_string(i) +
                            "] layout must be 'leading' or "
                            "'trailing', got '" +
                            seq[i].second + "'");
    out.push_back(u);
  }
  return out;
}

/// AGC's units are consecutive spans of a tensor's memory: a tensor that is not C-contiguous is
/// taken when its units are its first dimension and that dimension is the outermost in memory
/// (a channels-last convolution weight: (out, in, h, w) stored out-major, then h, w, in).
void check_unit_span(const ga::python::Layout& l, const std::string& name, const ga_units& u) {
  if (l.contiguous || u.num_units <= 1) return;
  int64_t numel = 1;
  for (int64_t d : l.shape) numel *= d;
  if (u.layout == kGaUnitsLeading && !l.shape.empty() && l.shape[0] == u.num_units &&
      l.strides[0] * l.shape[0] == numel)
    return;
  throw py::value_error(name +
                        " is not contiguous and its units are not consecutive in memory "
                        "(adaptive clipping takes a unit per slice of the first dimension, "
                        "which must be the outermost one in memory); pass a contiguous tensor");
}

void check_unit_spans(const Tensors& t, const std::string& name, const std::vector<ga_units>& u) {
  for (size_t i = 0; i < t.layout.size() && i < u.size(); ++i)
    if (!t.layout[i]->contiguous && u[i].num_units > 1)  // the name only where it is checked
      check_unit_span(*t.layout[i], name + "[" + std::to_string(i) + "]", u[i]);
}

py::tuple accumulate(py::handle accumulators, py::handle grads, double weight,
                     const std::string& mode, double weight_before, bool overwrite,
                     bool compute_sumsq, uintptr_t stream, const py::object& nonfinite_out,
                     const py::object& sumsq_out) {
  ga_accumulate_options o{parse_mode(mode), weight, weight_before, overwrite ? 1 : 0};
  Tensors acc = tensor_list(accumulators, "accumulators", true);
  Tensors g = tensor_list(grads, "grads", false, &acc);
  same_layouts(acc, "accumulators", g, "grads");
  const ga_device_type dev = acc.is_cuda() ? kGaCUDA : kGaCPU;
  TensorRef flag_ref, sumsq_ref;
  float* flag = scalar_out<float>(nonfinite_out, "nonfinite_out", kGaFloat32, 1, dev,
                                  acc.device_id(), flag_ref);
  double* sumsq =
      scalar_out<double>(sumsq_out, "sumsq_out", kGaFloat64, 1, dev, acc.device_id(), sumsq_ref);
  if (dev == kGaCUDA) {
    // Results stay on the device: the flag and the sum of squares go to the given tensors.
    call_core([&] {
      return ga_cuda_accumulate(acc.list(), g.list(), &o, flag, compute_sumsq ? sumsq : nullptr,
                                as_stream(stream));
    });
    return py::make_tuple(py::none(), py::none());
  }
  ga_accumulate_result r{};
  call_core([&] { return ga_accumulate(acc.list(), g.list(), &o, compute_sumsq, &r); });
  if (flag != nullptr && r.nonfinite) *flag = 1.0f;
  if (sumsq != nullptr && compute_sumsq) *sumsq = r.sumsq;
  return py::make_tuple(r.nonfinite != 0, compute_sumsq ? py::cast(r.sumsq) : py::none());
}

ga_dtype parse_dtype(const std::string& name) {
  if (name == "float32") return kGaFloat32;
  if (name == "bfloat16") return kGaBFloat16;
  if (name == "float16") return kGaFloat16;
  throw py::value_error("dtype must be 'float32', 'bfloat16' or 'float16', got '" + name + "'");
}

/// Load a run-time library into the core (`load` is ga_onednn_load or ga_cublaslt_load) from
/// `path`, or by its soname for None: (loaded, why not).
py::tuple load_library(ga_status (*load)(const char*), const py::object& path) {
  const std::string p = path.is_none() ? std::string() : py::cast<std::string>(path);
  ga_status s;
  std::string why;
  {
    py::gil_scoped_release release;
    s = load(path.is_none() ? nullptr : p.c_str());
    if (s != kGaOk) why = ga_last_error();
  }
  return py::make_tuple(s == kGaOk, why);
}

/// A 2-D tensor as the core's strided matrix (a dimension of size 1 has stride 0 here).
ga_matrix as_matrix(const TensorRef& t, const std::string& name) {
  if (t.layout.shape.size() != 2)
    throw py::value_error(name + " must be 2-D, got " + std::to_string(t.layout.shape.size()) +
                          " dimensions");
  return ga_matrix{t.desc, t.layout.shape[0], t.layout.shape[1], t.layout.strides[0],
                   t.layout.strides[1]};
}

/// acc ← a·acc + b·dyᵀx (wgrad.h). Returns (True, "") when done, (False, reason) when the
/// build, the loaded libraries or the CPU have no fused path for it (nothing written); raises
/// on bad arguments.
py::tuple wgrad_accumulate(py::handle acc, py::handle dy, py::handle x, double weight,
                           const std::string& mode, double weight_before, bool overwrite,
                           uintptr_t stream, const py::object& bias_acc, bool bias_overwrite) {
  ga_accumulate_options o{parse_mode(mode), weight, weight_before, overwrite ? 1 : 0};
  TensorRef a = import_tensor(acc, "acc", true);
  TensorRef d = import_tensor(dy, "dy", false);
  TensorRef in = import_tensor(x, "x", false);
  const ga_matrix am = as_matrix(a, "acc"), dm = as_matrix(d, "dy"), xm = as_matrix(in, "x");
  TensorRef b;
  const bool with_bias = !bias_acc.is_none();
  if (with_bias) {
    b = import_tensor(bias_acc, "bias_acc", true);
    if (a.desc.device_type == kGaCUDA)
      throw py::type_error("bias_acc: the bias's fold on CUDA is an accumulate() of Σdy");
    // Checked before the weight's GEMM writes anything.
    if (b.desc.dtype != kGaFloat32 || b.desc.numel != dm.cols)
      throw py::type_error("bias_acc must be a float32 tensor of dy's " + std::to_string(dm.cols) +
                           " columns");
  }
  ga_accumulate_options ob = o;
  ob.overwrite = bias_overwrite ? 1 : 0;
  ga_status status;
  std::string why;
  {
    py::gil_scoped_release release;
    status = a.desc.device_type == kGaCUDA
                 ? ga_cuda_wgrad_accumulate(&am, &dm, &xm, &o, as_stream(stream))
                 : ga_wgrad_accumulate(&am, &dm, &xm, &o);
    if (status == kGaUnsupported) why = ga_last_error();
    // The bias's fold only once the weight's is done: a refusal leaves both as they were.
    if (status == kGaOk && with_bias) status = ga_bias_accumulate(&b.desc, &dm, &ob);
  }
  if (status == kGaUnsupported) return py::make_tuple(false, why);
  call_core([&] { return status; });  // unreachable for kGaOk; re-raises the others
  return py::make_tuple(true, std::string());
}

py::object sum_of_squares(py::handle tensors, uintptr_t stream, const py::object& out) {
  Tensors t = tensor_list(tensors, "tensors", false);
  const ga_device_type dev = t.is_cuda() ? kGaCUDA : kGaCPU;
  TensorRef out_ref;
  double* o = scalar_out<double>(out, "out", kGaFloat64, 1, dev, t.device_id(), out_ref);
  if (dev == kGaCUDA) {
    if (o == nullptr) throw py::value_error("out is required for CUDA tensors");
    call_core([&] { return ga_cuda_sum_of_squares(t.list(), o, as_stream(stream)); });
    return py::none();
  }
  double s = 0;
  call_core([&] { return ga_sum_of_squares(t.list(), &s); });
  if (o != nullptr) *o = s;
  return py::cast(s);
}

void unitwise_norm(py::handle tensor, py::handle norms, int64_t num_units,
                   const std::string& layout, uintptr_t stream) {
  auto t = import_tensor(tensor, "tensor", false);
  // The Python API calls the output `out`: check it here so that errors name it so.
  auto n = import_tensor(norms, "out", true);
  if (n.desc.dtype != kGaFloat32 && n.desc.dtype != kGaFloat64)
    throw py::type_error("out must be a float32 or float64 tensor");
  if (n.desc.numel != num_units)
    throw py::value_error("out has " + std::to_string(n.desc.numel) + " elements, expected " +
                          std::to_string(num_units) + " (one per unit)");
  const auto* tb = static_cast<const char*>(t.desc.data);
  const auto* nb = static_cast<const char*>(n.desc.data);
  if (t.desc.numel > 0 && n.desc.numel > 0 &&
      tb < nb + n.desc.numel * ga_dtype_size(n.desc.dtype) &&
      nb < tb + t.desc.numel * ga_dtype_size(t.desc.dtype))
    throw py::value_error("out overlaps tensor in memory (the buffers must not alias)");
  auto u =
      parse_units(py::cast(std::vector<std::pair<int64_t, std::string>>{{num_units, layout}}), 1);
  check_unit_span(t.layout, "tensor", u[0]);
  if (t.desc.device_type == kGaCUDA)
    call_core([&] { return ga_cuda_unitwise_norm(t.desc, u[0], n.desc, as_stream(stream)); });
  else
    call_core([&] { return ga_unitwise_norm(t.desc, u[0], n.desc); });
}

void adaptive_clip(py::handle params, py::handle grads, const py::object& units, double clip_factor,
                   double eps, uintptr_t stream) {
  Tensors p = tensor_list(params, "params", false);
  Tensors g = tensor_list(grads, "grads", true);
  if (p.desc.size() != g.desc.size())
    throw py::value_error("grads has " + std::to_string(g.desc.size()) +
                          " tensors but params has " + std::to_string(p.desc.size()));
  same_layouts(p, "params", g, "grads");
  auto u = parse_units(units, g.desc.size());
  if (u.size() != g.desc.size()) throw py::value_error("units is required");
  check_unit_spans(p, "params", u);
  if (g.is_cuda())
    call_core([&] {
      return ga_cuda_adaptive_clip(p.list(), g.list(), u.data(), clip_factor, eps,
                                   as_stream(stream));
    });
  else
    call_core([&] { return ga_adaptive_clip(p.list(), g.list(), u.data(), clip_factor, eps); });
}

// ---- calls on registered sets: the lists' own checks once ----
//
// A registered set's tensors keep the descriptors they were registered with (a call refuses a
// set whose tensor changed, before the core sees it), so whether a combination of sets passes
// the core's checks of the lists themselves (lengths, dtypes, devices, overlaps) cannot change
// either, for the same rules (the optimizer, momentum, AGC). The last combinations that passed
// are remembered, by identity; a freed set never matches again.

struct CheckedApply {
  const TensorSet* raw[5] = {};       // null: the list was not passed
  std::weak_ptr<TensorSet> alive[5];  // while not expired, raw[k] is still that set
  int optimizer = 0;
  bool momentum = false;
  int clip = 0;

  bool expired() const {
    for (int k = 0; k < 5; ++k)
      if (raw[k] != nullptr && alive[k].expired()) return true;
    return false;
  }
};

std::vector<CheckedApply>& checked_applies() {
  static std::vector<CheckedApply> v;
  return v;
}

// Every list passed is a registered CPU set (the accumulators at least); lists not passed are
// empty.
bool all_sets(const Tensors* const lists[5]) {
  for (int k = 0; k < 5; ++k)
    if (lists[k]->set == nullptr && !lists[k]->desc.empty()) return false;
  return lists[1]->set != nullptr && !lists[1]->is_cuda();
}

bool lists_checked_before(const Tensors& p, const Tensors& a, const Tensors& s1, const Tensors& s2,
                          const Tensors& go, const ga_apply_options& o) {
  const Tensors* const lists[5] = {&p, &a, &s1, &s2, &go};
  if (!all_sets(lists)) return false;
  const bool momentum = o.momentum != 0.0;
  for (const CheckedApply& c : checked_applies()) {
    if (c.optimizer != o.optimizer || c.momentum != momentum || c.clip != o.clip) continue;
    bool same = true;
    for (int k = 0; k < 5 && same; ++k)
      same = c.raw[k] == lists[k]->set.get() && (c.raw[k] == nullptr || !c.alive[k].expired());
    if (same) return true;
  }
  return false;
}

void remember_lists_checked(const Tensors& p, const Tensors& a, const Tensors& s1,
                            const Tensors& s2, const Tensors& go, const ga_apply_options& o) {
  const Tensors* const lists[5] = {&p, &a, &s1, &s2, &go};
  if (!all_sets(lists)) return;
  auto& v = checked_applies();
  v.erase(std::remove_if(v.begin(), v.end(), [](const CheckedApply& c) { return c.expired(); }),
          v.end());
  if (v.size() >= 16) v.erase(v.begin());  // the most recent few
  CheckedApply c;
  for (int k = 0; k < 5; ++k) {
    c.raw[k] = lists[k]->set.get();
    c.alive[k] = lists[k]->set;
  }
  c.optimizer = o.optimizer;
  c.momentum = o.momentum != 0.0;
  c.clip = o.clip;
  v.push_back(c);
}

/// The fused apply's options as Python builds them (gradient_accumulator.core.apply): the C
/// struct itself, plus owners for its two pointer fields (the clip coefficient tensor and the AGC
/// units), which are imported when the call is made.
struct ApplyOptions {
  ga_apply_options o{};
  py::object clip_coef = py::none();
  py::object units = py::none();
  py::object step_counters = py::none();
  py::object skip_flag = py::none();
};

py::dict apply(py::handle params, py::handle accumulators, py::handle state1, py::handle state2,
               py::handle grads_out, const ApplyOptions& options, uintptr_t stream,
               const py::object& stats_out) {
  ga_apply_options o = options.o;
  o.clip_coef = nullptr;
  o.units = nullptr;
  o.step_counters = nullptr;
  o.skip_flag = nullptr;
  const py::object& clip_coef = options.clip_coef;
  const py::object& units = options.units;
  const bool update = o.optimizer != kGaOptimizerNone;
  auto empty = py::list();
  Tensors p = tensor_list(params.is_none() ? empty : params, "params", update);
  Tensors a = tensor_list(accumulators, "accumulators", true);
  Tensors s1 = tensor_list(state1.is_none() ? empty : state1, "state1", true);
  Tensors s2 = tensor_list(state2.is_none() ? empty : state2, "state2", true);
  Tensors go = tensor_list(grads_out.is_none() ? empty : grads_out, "grads_out", true);
  same_layouts(a, "accumulators", p, "params");
  same_layouts(a, "accumulators", s1, "state1");
  same_layouts(a, "accumulators", s2, "state2");
  same_layouts(a, "accumulators", go, "grads_out");
  const ga_device_type dev = a.is_cuda() ? kGaCUDA : kGaCPU;
  TensorRef coef;
  if (!clip_coef.is_none()) {
    coef = import_tensor(clip_coef, "clip_coef", false);
    if (coef.desc.dtype != kGaFloat32 || coef.desc.numel != 1)
      throw py::type_error("clip_coef must be a float32 tensor of one element");
    if (coef.desc.device_type != dev || (dev == kGaCUDA && coef.desc.device_id != a.device_id()))
      throw py::type_error(dev == kGaCUDA ? "clip_coef must be on the accumulators' CUDA device"
                                          : "clip_coef must be on the CPU for CPU tensors");
    o.clip_coef = static_cast<const float*>(coef.desc.data);
  }
  TensorRef stats_ref, skip_ref;
  auto* stats = scalar_out<ga_cuda_apply_stats>(stats_out, "stats_out", kGaFloat32, 3, dev,
                                                a.device_id(), stats_ref);
  o.skip_flag = scalar_out<float>(options.skip_flag, "skip_flag", kGaFloat32, 1, dev, a.device_id(),
                                  skip_ref);
  // One float32 counter per tensor, on the tensors' device, written in place.
  std::vector<TensorRef> counter_refs;
  std::vector<float*> counters;
  if (!options.step_counters.is_none()) {
    const py::object& sc = options.step_counters;
    if (py::isinstance<py::str>(sc) || !py::isinstance<py::sequence>(sc))
      throw py::type_error("step_counters must be a list of tensors");
    py::sequence seq = py::reinterpret_borrow<py::sequence>(sc);
    if (seq.size() != a.desc.size())
      throw py::value_error("step_counters has " + std::to_string(seq.size()) +
                            " tensors but accumulators has " + std::to_string(a.desc.size()));
    counter_refs.resize(seq.size());
    for (size_t i = 0; i < seq.size(); ++i) {
      const std::string name = "step_counters[" + std::to_string(i) + "]";
      counters.push_back(scalar_out<float>(seq[i], name.c_str(), kGaFloat32, 1, dev, a.device_id(),
                                           counter_refs[i]));
    }
    o.step_counters = counters.data();
  }
  if (!units.is_none() && p.desc.size() != a.desc.size())
    throw py::value_error("params has " + std::to_string(p.desc.size()) +
                          " tensors but accumulators has " + std::to_string(a.desc.size()));
  auto u = parse_units(units, a.desc.size());
  if (o.clip == kGaClipAgc) {
    if (u.empty() && !a.desc.empty()) throw py::value_error("units is required for clip='agc'");
    check_unit_spans(p, "params", u);
    o.units = u.data();
  }
  ga_apply_tensors t{p.list(), a.list(), s1.list(), s2.list(), go.list()};
  py::dict out;
  if (dev == kGaCUDA) {
    // The outcome stays on the device, in stats_out (grad_norm, clip_coef, skipped).
    call_core([&] { return ga_cuda_apply(&t, &o, nullptr, stats, as_stream(stream)); });
    out["skipped"] = py::none();
    out["grad_norm"] = py::none();
    out["clip_coef"] = py::none();
    return out;
  }
  if (stats != nullptr) throw py::value_error("stats_out is for CUDA tensors");
  ga_apply_result r{};
  if (lists_checked_before(p, a, s1, s2, go, o)) {
    call_core([&] { return ga::apply_lists_checked(&t, &o, &r); });
  } else {
    call_core([&] { return ga_apply(&t, &o, &r); });
    remember_lists_checked(p, a, s1, s2, go, o);
  }
  out["skipped"] = r.skipped != 0;
  out["grad_norm"] = r.grad_norm >= 0 ? py::cast(r.grad_norm) : py::none();
  out["clip_coef"] = r.clip_coef >= 0 ? py::cast(r.clip_coef) : py::none();
  return out;
}

void bn_moments(py::handle x, int64_t outer, int64_t channels, int64_t inner, py::handle mean,
                py::handle m2) {
  auto xr = import_tensor(x, "x", false);
  require_contiguous(xr.layout, "x");
  auto mr = import_tensor(mean, "mean", true);
  auto qr = import_tensor(m2, "m2", true);
  call_core([&] { return ga_bn_moments(xr.desc, outer, channels, inner, mr.desc, qr.desc); });
}

double bn_merge(double count_a, py::handle mean_a, py::handle m2_a, double count_b,
                py::handle mean_b, py::handle m2_b, uintptr_t stream) {
  auto ma = import_tensor(mean_a, "mean_a", true);
  auto qa = import_tensor(m2_a, "m2_a", true);
  auto mb = import_tensor(mean_b, "mean_b", false);
  auto qb = import_tensor(m2_b, "m2_b", false);
  if (ma.desc.device_type == kGaCUDA)
    call_core([&] {
      return ga_cuda_bn_merge(&count_a, ma.desc, qa.desc, count_b, mb.desc, qb.desc,
                              as_stream(stream));
    });
  else
    call_core([&] { return ga_bn_merge(&count_a, ma.desc, qa.desc, count_b, mb.desc, qb.desc); });
  return count_a;
}

void bn_update_running(py::handle running_mean, py::handle running_var, py::handle mean,
                       py::handle m2, double count, double new_weight, bool unbiased,
                       uintptr_t stream) {
  auto rm = import_tensor(running_mean, "running_mean", true);
  auto rv = import_tensor(running_var, "running_var", true);
  auto m = import_tensor(mean, "mean", false);
  auto q = import_tensor(m2, "m2", false);
  call_core([&] {
    if (rm.desc.device_type == kGaCUDA)
      return ga_cuda_bn_update_running(rm.desc, rv.desc, m.desc, q.desc, count, new_weight,
                                       unbiased, as_stream(stream));
    return ga_bn_update_running(rm.desc, rv.desc, m.desc, q.desc, count, new_weight, unbiased);
  });
}

void zero(py::handle tensors, uintptr_t stream) {
  Tensors t = tensor_list(tensors, "tensors", true);
  call_core([&] {
    if (t.is_cuda()) return ga_cuda_zero(t.list(), as_stream(stream));
    return ga_zero(t.list());
  });
}

py::tuple arena_plan(const std::vector<int64_t>& numels, int64_t alignment, int64_t bucket_numel,
                     bool reverse) {
  const size_t n = numels.size();
  std::vector<int64_t> offsets(n), bucket_of(n), bucket_start(n + 1);
  int64_t num_buckets = 0, total = 0;
  ga_arena_plan_options o{alignment, bucket_numel, reverse ? 1 : 0};
  call_core([&] {
    return ga_arena_plan(numels.data(), static_cast<int64_t>(n), &o, offsets.data(),
                         bucket_of.data(), bucket_start.data(), &num_buckets, &total);
  });
  bucket_start.resize(static_cast<size_t>(num_buckets) + 1);
  return py::make_tuple(offsets, bucket_of, bucket_start, total);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "Compiled core of gradient-accumulator (use gradient_accumulator.core instead).";
  m.attr("__version__") = ga_version();
  m.def("cpu_isa", [] { return std::string(ga_cpu_isa()); });
  m.def("num_threads", &ga_cpu_num_threads);
  m.def("has_cuda", [] { return ga_has_cuda() != 0; });
  m.def("cuda_device_count", &ga_cuda_device_count);
  m.def("cuda_probe", [] {
    ga_cuda_probe_result r;
    {
      py::gil_scoped_release release;  // loading the driver can take a while
      ga_cuda_probe(&r);
    }
    return py::make_tuple(r.code, r.device_count, r.driver_version, r.runtime_version,
                          std::string(r.reason));
  });
  ga::python::bind_tensor_set(m);
  m.def("accumulate", &accumulate, py::arg("accumulators"), py::arg("grads"), py::arg("weight"),
        py::arg("mode"), py::arg("weight_before"), py::arg("overwrite"), py::arg("compute_sumsq"),
        py::arg("stream") = 0, py::arg("nonfinite_out") = py::none(),
        py::arg("sumsq_out") = py::none());
  m.def("wgrad_accumulate", &wgrad_accumulate, py::arg("acc"), py::arg("dy"), py::arg("x"),
        py::arg("weight"), py::arg("mode"), py::arg("weight_before"), py::arg("overwrite"),
        py::arg("stream") = 0, py::arg("bias_acc") = py::none(), py::arg("bias_overwrite") = false);
  m.def(
      "onednn_load", [](const py::object& path) { return load_library(&ga_onednn_load, path); },
      py::arg("path") = py::none());
  m.def(
      "cublaslt_load", [](const py::object& path) { return load_library(&ga_cublaslt_load, path); },
      py::arg("path") = py::none());
  m.def(
      "wgrad_cpu_path",
      [](const std::string& dtype, int64_t n, int64_t out, int64_t in) {
        char what[512] = {0};
        int fused;
        {
          py::gil_scoped_release release;
          fused = ga_wgrad_cpu_path(parse_dtype(dtype), n, out, in, what, sizeof(what));
        }
        return py::make_tuple(fused != 0, std::string(what));
      },
      py::arg("dtype"), py::arg("n"), py::arg("out"), py::arg("in_features"));
  m.def("sum_of_squares", &sum_of_squares, py::arg("tensors"), py::arg("stream") = 0,
        py::arg("out") = py::none());
  m.def("unitwise_norm", &unitwise_norm, py::arg("tensor"), py::arg("norms"), py::arg("num_units"),
        py::arg("layout"), py::arg("stream") = 0);
  m.def("adaptive_clip", &adaptive_clip, py::arg("params"), py::arg("grads"), py::arg("units"),
        py::arg("clip_factor"), py::arg("eps"), py::arg("stream") = 0);
  py::class_<ApplyOptions> opts(m, "ApplyOptions",
                                "ga_apply_options (apply.h), field for field; strings for enums");
  opts.def(py::init<>())
      .def_property(
          "optimizer",
          [](const ApplyOptions& a) { return enum_name(kOptimizerNames, a.o.optimizer); },
          [](ApplyOptions& a, const std::string& v) {
            a.o.optimizer = enum_from_name(kOptimizerNames, v, "optimizer");
          })
      .def_property(
          "clip", [](const ApplyOptions& a) { return enum_name(kClipNames, a.o.clip); },
          [](ApplyOptions& a, const std::string& v) {
            a.o.clip = enum_from_name(kClipNames, v, "clip");
          })
      .def_readwrite("clip_coef", &ApplyOptions::clip_coef)
      .def_readwrite("units", &ApplyOptions::units)
      .def_readwrite("step_counters", &ApplyOptions::step_counters)
      .def_readwrite("skip_flag", &ApplyOptions::skip_flag);
  // Every number of the C struct, under its C name, as its C type (int flags as bool).
#define GA_APPLY_OPTION(field, type)                                              \
  opts.def_property(                                                              \
      #field, [](const ApplyOptions& a) { return static_cast<type>(a.o.field); }, \
      [](ApplyOptions& a, type v) { a.o.field = v; })
  GA_APPLY_OPTION(grad_scale, double);
  GA_APPLY_OPTION(max_norm, double);
  GA_APPLY_OPTION(clip_factor, double);
  GA_APPLY_OPTION(agc_eps, double);
  GA_APPLY_OPTION(skip_nonfinite, bool);
  GA_APPLY_OPTION(reset, bool);
  GA_APPLY_OPTION(lr, double);
  GA_APPLY_OPTION(weight_decay, double);
  GA_APPLY_OPTION(maximize, bool);
  GA_APPLY_OPTION(momentum, double);
  GA_APPLY_OPTION(dampening, double);
  GA_APPLY_OPTION(nesterov, bool);
  GA_APPLY_OPTION(momentum_initialized, bool);
  GA_APPLY_OPTION(beta1, double);
  GA_APPLY_OPTION(beta2, double);
  GA_APPLY_OPTION(adam_eps, double);
  GA_APPLY_OPTION(step, int64_t);
#undef GA_APPLY_OPTION
  m.def("apply", &apply, py::arg("params"), py::arg("accumulators"), py::arg("state1"),
        py::arg("state2"), py::arg("grads_out"), py::arg("options"), py::arg("stream") = 0,
        py::arg("stats_out") = py::none());
  m.def("bn_moments", &bn_moments, py::arg("x"), py::arg("outer"), py::arg("channels"),
        py::arg("inner"), py::arg("mean"), py::arg("m2"));
  m.def("bn_merge", &bn_merge, py::arg("count_a"), py::arg("mean_a"), py::arg("m2_a"),
        py::arg("count_b"), py::arg("mean_b"), py::arg("m2_b"), py::arg("stream") = 0);
  m.def("bn_update_running", &bn_update_running, py::arg("running_mean"), py::arg("running_var"),
        py::arg("mean"), py::arg("m2"), py::arg("count"), py::arg("new_weight"),
        py::arg("unbiased"), py::arg("stream") = 0);
  m.def("zero", &zero, py::arg("tensors"), py::arg("stream") = 0);
  m.def("arena_plan", &arena_plan, py::arg("numels"), py::arg("alignment"), py::arg("bucket_numel"),
        py::arg("reverse"));
}
