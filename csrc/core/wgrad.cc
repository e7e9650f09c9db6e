// ga_wgrad_accumulate on the CPU: one oneDNN matmul that writes a linear layer's weight gradient
// into its fp32 accumulator (dst = the accumulator, a sum post-op adds what it held, the
// micro-batch's weight as the runtime scale of the product).
//
// oneDNN is loaded at run time (dlopen), never linked: the core imports and works without it,
// and a CPU or dtype oneDNN has no kernel for is reported (ga_wgrad_cpu_path) and refused with
// kGaUnsupported, nothing written, so the caller folds a computed gradient instead. bf16/fp16
// inputs on a CPU whose oneDNN has no kernel for them are widened to fp32 (into per-thread
// scratch the size of the inputs, not of the weight) and take the fp32 kernel: the product is
// then summed in fp32 from the exact input values, as the bf16 kernel would. Only the
// types and constants of oneDNN's C headers (3.x) are compiled in; without the headers every
// entry point here says so.
#include "gradient_accumulator/wgrad.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "formulas.h"
#include "internal.h"

#if defined(GA_HAVE_ONEDNN)
#include <dlfcn.h>

#include "oneapi/dnnl/dnnl.h"
#endif

using namespace ga::detail;

namespace ga {
namespace detail {

void validate_wgrad(const ga_matrix* acc, const ga_matrix* dy, const ga_matrix* x,
                    const ga_accumulate_options* options, ga_device_type device, double* alpha,
                    double* beta) {
  if (acc == nullptr) fail(kGaInvalidArgument, "acc", "acc is null");
  if (dy == nullptr) fail(kGaInvalidArgument, "dy", "dy is null");
  if (x == nullptr) fail(kGaInvalidArgument, "x", "x is null");
  if (options == nullptr) fail(kGaInvalidArgument, "options", "options is null");
  const std::pair<const ga_matrix*, const char*> all[] = {{acc, "acc"}, {dy, "dy"}, {x, "x"}};
  for (const auto& [m, name] : all) {
    check_tensor(m->tensor, name);
    if (m->rows < 0 || m->cols < 0 || m->row_stride < 0 || m->col_stride < 0)
      fail(kGaInvalidArgument, name, std::string(name) + " has a negative size or stride");
    // The span the strides reach must lie inside the tensor's elements.
    if (m->rows > 0 && m->cols > 0) {
      const int64_t last = checked_add(checked_mul(m->rows - 1, m->row_stride, name),
                                       checked_mul(m->cols - 1, m->col_stride, name), name);
      if (last >= m->tensor.numel)
        fail(kGaInvalidArgument, name,
             std::string(name) + "'s strides reach past its " + std::to_string(m->tensor.numel) +
                 " elements");
    }
  }
  if (device == kGaCUDA) {
    int32_t id = -1;
    check_cuda(acc->tensor, "acc", &id);
    check_cuda(dy->tensor, "dy", &id);
    check_cuda(x->tensor, "x", &id);
  } else {
    check_cpu(acc->tensor, "acc");
    check_cpu(dy->tensor, "dy");
    check_cpu(x->tensor, "x");
  }
  check_dtype_in(acc->tensor, "acc", {kGaFloat32});
  check_dtype_in(dy->tensor, "dy", {kGaFloat32, kGaBFloat16, kGaFloat16});
  if (x->tensor.dtype != dy->tensor.dtype)
    fail(kGaTypeError, "x",
         std::string("x is ") + dtype_name(x->tensor.dtype) + " but dy is " +
             dtype_name(dy->tensor.dtype) + "; the GEMM takes one input dtype");
  if (dy->cols != acc->rows || x->cols != acc->cols || dy->rows != x->rows)
    fail(kGaInvalidArgument, "acc",
         "shapes do not chain: acc is " + std::to_string(acc->rows) + "x" +
             std::to_string(acc->cols) + ", dy " + std::to_string(dy->rows) + "x" +
             std::to_string(dy->cols) + ", x " + std::to_string(x->rows) + "x" +
             std::to_string(x->cols) + " (acc must be dy.cols x x.cols, dy and x the same rows)");
  if (acc->rows * acc->cols != acc->tensor.numel ||
      (acc->rows > 1 && acc->row_stride != acc->cols) || (acc->cols > 1 && acc->col_stride != 1))
    fail(kGaInvalidArgument, "acc", "acc must be a dense row-major matrix");
  accumulate_coefficients(*options, true, alpha, beta);
  std::vector<Range> written, read;
  add_range(written, acc->tensor, "acc");
  add_range(read, dy->tensor, "dy");
  add_range(read, x->tensor, "x");
  check_disjoint(written, read);
}

}  // namespace detail
}  // namespace ga

namespace {

/// acc ← alpha·acc where the GEMM cannot: before a running mean's add, and for n == 0.
void scale_in_place(const ga_matrix& acc, double alpha, bool overwrite) {
  float* a = static_cast<float*>(acc.tensor.data);
  const int64_t n = acc.tensor.numel;
  if (overwrite || alpha == 0.0) {
    if (n > 0) std::memset(a, 0, static_cast<size_t>(n) * sizeof(float));
    return;
  }
  if (alpha == 1.0) return;
  const float f = static_cast<float>(alpha);
  for (int64_t i = 0; i < n; ++i) a[i] *= f;
}

void write_what(char* what, size_t len, const std::string& s) {
  if (what != nullptr && len > 0) std::snprintf(what, len, "%s", s.c_str());
}

#if defined(GA_HAVE_ONEDNN)

// The oneDNN C functions used here, resolved from the loaded library.
struct Api {
  decltype(&dnnl_version) version = nullptr;
  decltype(&dnnl_engine_create) engine_create = nullptr;
  decltype(&dnnl_stream_create) stream_create = nullptr;
  decltype(&dnnl_memory_desc_create_with_strides) md_create = nullptr;
  decltype(&dnnl_memory_desc_destroy) md_destroy = nullptr;
  decltype(&dnnl_primitive_attr_create) attr_create = nullptr;
  decltype(&dnnl_primitive_attr_destroy) attr_destroy = nullptr;
  decltype(&dnnl_primitive_attr_set_scales_mask) attr_set_scales_mask = nullptr;
  decltype(&dnnl_primitive_attr_set_post_ops) attr_set_post_ops = nullptr;
  decltype(&dnnl_post_ops_create) post_ops_create = nullptr;
  decltype(&dnnl_post_ops_append_sum) post_ops_append_sum = nullptr;
  decltype(&dnnl_post_ops_destroy) post_ops_destroy = nullptr;
  decltype(&dnnl_matmul_primitive_desc_create) matmul_pd_create = nullptr;
  decltype(&dnnl_primitive_desc_query) pd_query = nullptr;
  decltype(&dnnl_primitive_desc_destroy) pd_destroy = nullptr;
  decltype(&dnnl_primitive_create) primitive_create = nullptr;
  decltype(&dnnl_primitive_execute) primitive_execute = nullptr;
  decltype(&dnnl_primitive_destroy) primitive_destroy = nullptr;
  decltype(&dnnl_memory_create) memory_create = nullptr;
  decltype(&dnnl_memory_set_data_handle) memory_set_data_handle = nullptr;
  decltype(&dnnl_memory_destroy) memory_destroy = nullptr;
  decltype(&dnnl_stream_wait) stream_wait = nullptr;
};

struct Library {
  std::mutex mu;
  bool loaded = false;
  std::string why = "oneDNN is not loaded (ga_onednn_load)";
  Api api;
  dnnl_engine_t engine = nullptr;
  std::string version;
};

Library& library() {
  static Library* lib = new Library;  // never destroyed: primitives may outlive static teardown
  return *lib;
}

template <typename F>
bool resolve(void* handle, const char* name, F* out, std::string* missing) {
  *out = reinterpret_cast<F>(dlsym(handle, name));
  if (*out == nullptr && missing->empty()) *missing = name;
  return *out != nullptr;
}

ga_status load(const char* path) {
  Library& lib = library();
  std::lock_guard<std::mutex> lock(lib.mu);
  if (lib.loaded) return kGaOk;
  const char* name = path != nullptr ? path : "libdnnl.so.3";
  void* h = dlopen(name, RTLD_NOW | RTLD_LOCAL);
  if (h == nullptr) {
    const char* err = dlerror();
    lib.why = std::string("oneDNN could not be loaded from ") + name + ": " +
              (err != nullptr ? err : "unknown error");
    set_last_error(kGaUnsupported, "path", lib.why);
    return kGaUnsupported;
  }
  Api a;
  std::string missing;
  resolve(h, "dnnl_version", &a.version, &missing);
  resolve(h, "dnnl_engine_create", &a.engine_create, &missing);
  resolve(h, "dnnl_stream_create", &a.stream_create, &missing);
  resolve(h, "dnnl_memory_desc_create_with_strides", &a.md_create, &missing);
  resolve(h, "dnnl_memory_desc_destroy", &a.md_destroy, &missing);
  resolve(h, "dnnl_primitive_attr_create", &a.attr_create, &missing);
  resolve(h, "dnnl_primitive_attr_destroy", &a.attr_destroy, &missing);
  resolve(h, "dnnl_primitive_attr_set_scales_mask", &a.attr_set_scales_mask, &missing);
  resolve(h, "dnnl_primitive_attr_set_post_ops", &a.attr_set_post_ops, &missing);
  resolve(h, "dnnl_post_ops_create", &a.post_ops_create, &missing);
  resolve(h, "dnnl_post_ops_append_sum", &a.post_ops_append_sum, &missing);
  resolve(h, "dnnl_post_ops_destroy", &a.post_ops_destroy, &missing);
  resolve(h, "dnnl_matmul_primitive_desc_create", &a.matmul_pd_create, &missing);
  resolve(h, "dnnl_primitive_desc_query", &a.pd_query, &missing);
  resolve(h, "dnnl_primitive_desc_destroy", &a.pd_destroy, &missing);
  resolve(h, "dnnl_primitive_create", &a.primitive_create, &missing);
  resolve(h, "dnnl_primitive_execute", &a.primitive_execute, &missing);
  resolve(h, "dnnl_primitive_destroy", &a.primitive_destroy, &missing);
  resolve(h, "dnnl_memory_create", &a.memory_create, &missing);
  resolve(h, "dnnl_memory_set_data_handle", &a.memory_set_data_handle, &missing);
  resolve(h, "dnnl_memory_destroy", &a.memory_destroy, &missing);
  resolve(h, "dnnl_stream_wait", &a.stream_wait, &missing);
  if (!missing.empty()) {
    lib.why = std::string(name) + " lacks " + missing + " (oneDNN 3.x expected)";
    set_last_error(kGaUnsupported, "path", lib.why);
    return kGaUnsupported;
  }
  const dnnl_version_t* v = a.version();
  lib.version =
      std::to_string(v->major) + "." + std::to_string(v->minor) + "." + std::to_string(v->patch);
  if (v->major != DNNL_VERSION_MAJOR) {
    lib.why = std::string(name) + " is oneDNN " + lib.version + "; this build takes oneDNN " +
              std::to_string(DNNL_VERSION_MAJOR) + ".x";
    set_last_error(kGaUnsupported, "path", lib.why);
    return kGaUnsupported;
  }
  if (a.engine_create(&lib.engine, dnnl_cpu, 0) != dnnl_success) {
    lib.why = "oneDNN could not create its CPU engine";
    set_last_error(kGaUnsupported, "path", lib.why);
    return kGaUnsupported;
  }
  lib.api = a;
  lib.loaded = true;
  lib.why.clear();
  return kGaOk;
}

// One primitive per layout: the shapes, strides, input dtype and whether the accumulator is
// read (sum post-op) or overwritten. Its memory objects take new data pointers each call.
struct Key {
  int dtype;
  int add;
  int64_t n, out, in, dy_rs, dy_cs, x_rs, x_cs;
  bool operator==(const Key& o) const {
    return dtype == o.dtype && add == o.add && n == o.n && out == o.out && in == o.in &&
           dy_rs == o.dy_rs && dy_cs == o.dy_cs && x_rs == o.x_rs && x_cs == o.x_cs;
  }
};
struct KeyHash {
  size_t operator()(const Key& k) const {
    size_t h = static_cast<size_t>(k.dtype) * 2 + static_cast<size_t>(k.add);
    for (int64_t v : {k.n, k.out, k.in, k.dy_rs, k.dy_cs, k.x_rs, k.x_cs})
      h = h * 1000003u ^ static_cast<size_t>(v);
    return h;
  }
};
struct Entry {
  dnnl_primitive_t prim = nullptr;  // null: oneDNN has no kernel (see `what`)
  dnnl_memory_t src = nullptr, wei = nullptr, dst = nullptr, scale = nullptr;
  std::string what;
};

// Per thread (memory objects and streams are not shared between threads), bounded; never
// destroyed at thread or process exit, when oneDNN itself may be gone.
struct Cache {
  dnnl_stream_t stream = nullptr;
  std::unordered_map<Key, Entry, KeyHash> entries;
};
constexpr size_t kMaxEntries = 512;

dnnl_data_type_t dnnl_dtype(ga_dtype d) {
  switch (d) {
    case kGaBFloat16:
      return dnnl_bf16;
    case kGaFloat16:
      return dnnl_f16;
    default:
      return dnnl_f32;
  }
}

// A stride for oneDNN: a dimension of size 1 never moves, any positive stride describes it.
int64_t usable(int64_t stride, int64_t size, int64_t other) {
  return size <= 1 && stride == 0 ? (other > 0 ? other : 1) : stride;
}

void destroy(const Api& a, Entry& e) {
  if (e.prim != nullptr) a.primitive_destroy(e.prim);
  for (dnnl_memory_t m : {e.src, e.wei, e.dst, e.scale})
    if (m != nullptr) a.memory_destroy(m);
  e = Entry{};
}

std::string status_text(dnnl_status_t st) {
  switch (st) {
    case dnnl_unimplemented:
      return "oneDNN has no matmul kernel for it on this CPU";
    case dnnl_out_of_memory:
      return "oneDNN ran out of memory";
    case dnnl_invalid_arguments:
      return "oneDNN refused the layout";
    default:
      return "oneDNN failed (status " + std::to_string(static_cast<int>(st)) + ")";
  }
}

// Build the primitive of `k` and its memory objects; on failure the entry holds the reason.
Entry create(const Api& a, dnnl_engine_t engine, const Key& k) {
  Entry e;
  const dnnl_data_type_t dt = dnnl_dtype(static_cast<ga_dtype>(k.dtype));
  // dst[out, in] = src[out, n] · weights[n, in]: src is dyᵀ, weights is x.
  const dnnl_dims_t src_dims = {k.out, k.n}, src_strides = {k.dy_cs, k.dy_rs};
  const dnnl_dims_t wei_dims = {k.n, k.in}, wei_strides = {k.x_rs, k.x_cs};
  const dnnl_dims_t dst_dims = {k.out, k.in}, dst_strides = {k.in, 1};
  const dnnl_dims_t one = {1}, one_stride = {1};
  dnnl_memory_desc_t src_md = nullptr, wei_md = nullptr, dst_md = nullptr, scale_md = nullptr;
  dnnl_primitive_attr_t attr = nullptr;
  dnnl_post_ops_t ops = nullptr;
  dnnl_primitive_desc_t pd = nullptr;
  dnnl_status_t st = a.md_create(&src_md, 2, src_dims, dt, src_strides);
  if (st == dnnl_success) st = a.md_create(&wei_md, 2, wei_dims, dt, wei_strides);
  if (st == dnnl_success) st = a.md_create(&dst_md, 2, dst_dims, dnnl_f32, dst_strides);
  if (st == dnnl_success) st = a.md_create(&scale_md, 1, one, dnnl_f32, one_stride);
  if (st == dnnl_success) st = a.attr_create(&attr);
  // The micro-batch's weight scales the product at run time (one value for the whole matrix).
  if (st == dnnl_success) st = a.attr_set_scales_mask(attr, DNNL_ARG_SRC, 0);
  if (st == dnnl_success && k.add) {
    st = a.post_ops_create(&ops);
    if (st == dnnl_success) st = a.post_ops_append_sum(ops, 1.0f, 0, dnnl_data_type_undef);
    if (st == dnnl_success) st = a.attr_set_post_ops(attr, ops);
  }
  if (st == dnnl_success)
    st = a.matmul_pd_create(&pd, engine, src_md, wei_md, nullptr, dst_md, attr);
  if (st == dnnl_success) {
    const char* impl = nullptr;
    if (a.pd_query(pd, dnnl_query_impl_info_str, 0, &impl) == dnnl_success && impl != nullptr)
      e.what = std::string("onednn:") + impl;
    st = a.primitive_create(&e.prim, pd);
  }
  if (st == dnnl_success) st = a.memory_create(&e.src, src_md, engine, DNNL_MEMORY_NONE);
  if (st == dnnl_success) st = a.memory_create(&e.wei, wei_md, engine, DNNL_MEMORY_NONE);
  if (st == dnnl_success) st = a.memory_create(&e.dst, dst_md, engine, DNNL_MEMORY_NONE);
  if (st == dnnl_success) st = a.memory_create(&e.scale, scale_md, engine, DNNL_MEMORY_NONE);
  if (pd != nullptr) a.pd_destroy(pd);
  if (ops != nullptr) a.post_ops_destroy(ops);
  if (attr != nullptr) a.attr_destroy(attr);
  for (dnnl_memory_desc_t md : {src_md, wei_md, dst_md, scale_md})
    if (md != nullptr) a.md_destroy(md);
  if (st != dnnl_success) {
    destroy(a, e);
    e.what =
        std::string(dtype_name(static_cast<ga_dtype>(k.dtype))) + " inputs: " + status_text(st);
  }
  return e;
}

// `m`'s elements as a dense row-major fp32 matrix in `buf`.
ga_matrix widened(const ga_matrix& m, std::vector<float>& buf) {
  buf.resize(static_cast<size_t>(m.rows * m.cols));
  const uint16_t* src = static_cast<const uint16_t*>(m.tensor.data);
  const bool bf16 = m.tensor.dtype == kGaBFloat16;
  for (int64_t r = 0; r < m.rows; ++r) {
    float* out = buf.data() + r * m.cols;
    const uint16_t* in = src + r * m.row_stride;
    for (int64_t c = 0; c < m.cols; ++c) {
      const uint16_t v = in[c * m.col_stride];
      out[c] = bf16 ? ga::formulas::bf16_to_float(v) : ga::formulas::half_to_float(v);
    }
  }
  ga_matrix w = m;
  w.tensor.data = buf.data();
  w.tensor.dtype = kGaFloat32;
  w.tensor.numel = m.rows * m.cols;
  w.row_stride = m.cols;
  w.col_stride = 1;
  return w;
}

Key key_of(const ga_matrix& dy, const ga_matrix& x, bool add) {
  const int64_t n = dy.rows, out = dy.cols, in = x.cols;
  return Key{static_cast<int>(dy.tensor.dtype),
             add ? 1 : 0,
             n,
             out,
             in,
             usable(dy.row_stride, n, out),
             usable(dy.col_stride, out, 1),
             usable(x.row_stride, n, in),
             usable(x.col_stride, in, 1)};
}

// The calling thread's primitive of `k` (created on first use). Caller holds nothing.
Entry& entry(Library& lib, Cache& cache, const Key& k) {
  auto it = cache.entries.find(k);
  if (it != cache.entries.end()) return it->second;
  if (cache.entries.size() >= kMaxEntries) {
    for (auto& kv : cache.entries) destroy(lib.api, kv.second);
    cache.entries.clear();
  }
  return cache.entries.emplace(k, create(lib.api, lib.engine, k)).first->second;
}

Cache& thread_cache(Library& lib) {
  static thread_local Cache* cache = nullptr;  // leaked on purpose, see Cache
  if (cache == nullptr) {
    cache = new Cache;
    if (lib.api.stream_create(&cache->stream, lib.engine, dnnl_stream_default_flags) !=
        dnnl_success)
      fail(kGaRuntimeError, "", "oneDNN could not create a CPU stream");
  }
  return *cache;
}

bool loaded(Library& lib, std::string* why) {
  std::lock_guard<std::mutex> lock(lib.mu);
  if (!lib.loaded) *why = lib.why;
  return lib.loaded;
}

#endif  // GA_HAVE_ONEDNN

}  // namespace

extern "C" {

ga_status ga_onednn_load(const char* path) {
#if defined(GA_HAVE_ONEDNN)
  clear_last_error();
  return load(path);
#else
  (void)path;
  set_last_error(kGaUnsupported, "path",
                 "this build of gradient-accumulator has no oneDNN support (built without "
                 "oneDNN's headers)");
  return kGaUnsupported;
#endif
}

ga_status ga_wgrad_accumulate(const ga_matrix* acc, const ga_matrix* dy, const ga_matrix* x,
                              const ga_accumulate_options* options) {
  return guarded([&] {
    double alpha = 1.0, beta = 1.0;
    validate_wgrad(acc, dy, x, options, kGaCPU, &alpha, &beta);
    const bool overwrite = options->overwrite != 0 || alpha == 0.0;
    if (acc->tensor.numel == 0) return;
    if (dy->rows == 0) {  // no rows: the product is zero
      scale_in_place(*acc, alpha, overwrite);
      return;
    }
#if defined(GA_HAVE_ONEDNN)
    Library& lib = library();
    std::string why;
    if (!loaded(lib, &why)) fail(kGaUnsupported, "", why);
    Cache& cache = thread_cache(lib);
    const ga_matrix* dm = dy;
    const ga_matrix* xm = x;
    Entry* e = &entry(lib, cache, key_of(*dm, *xm, !overwrite));
    ga_matrix dy32, x32;
    if (e->prim == nullptr && dy->tensor.dtype != kGaFloat32) {
      // No bf16/fp16 kernel on this CPU: the fp32 one on widened copies of the inputs.
      static thread_local std::vector<float> dy_buf, x_buf;
      dy32 = widened(*dy, dy_buf);
      x32 = widened(*x, x_buf);
      dm = &dy32;
      xm = &x32;
      e = &entry(lib, cache, key_of(*dm, *xm, !overwrite));
    }
    if (e->prim == nullptr) fail(kGaUnsupported, "dy", e->what);
    const Api& a = lib.api;
    // A running mean scales what the accumulator held first; the GEMM then adds (sum 1).
    if (!overwrite) scale_in_place(*acc, alpha, false);
    float scale = static_cast<float>(beta);
    a.memory_set_data_handle(e->src, dm->tensor.data);
    a.memory_set_data_handle(e->wei, xm->tensor.data);
    a.memory_set_data_handle(e->dst, acc->tensor.data);
    a.memory_set_data_handle(e->scale, &scale);
    const dnnl_exec_arg_t args[] = {{DNNL_ARG_SRC, e->src},
                                    {DNNL_ARG_WEIGHTS, e->wei},
                                    {DNNL_ARG_DST, e->dst},
                                    {DNNL_ARG_ATTR_SCALES | DNNL_ARG_SRC, e->scale}};
    dnnl_status_t st = a.primitive_execute(e->prim, cache.stream, 4, args);
    if (st == dnnl_success) st = a.stream_wait(cache.stream);
    if (st != dnnl_success) fail(kGaRuntimeError, "", "oneDNN matmul failed: " + status_text(st));
#else
    (void)alpha;
    (void)beta;
    fail(kGaUnsupported, "",
         "this build of gradient-accumulator has no oneDNN support (built without oneDNN's "
         "headers)");
#endif
  });
}

ga_status ga_bias_accumulate(const ga_tensor* acc, const ga_matrix* dy,
                             const ga_accumulate_options* options) {
  return guarded([&] {
    if (acc == nullptr) fail(kGaInvalidArgument, "bias_acc", "bias_acc is null");
    if (dy == nullptr) fail(kGaInvalidArgument, "dy", "dy is null");
    if (options == nullptr) fail(kGaInvalidArgument, "options", "options is null");
    check_tensor(*acc, "bias_acc");
    check_cpu(*acc, "bias_acc");
    check_dtype_in(*acc, "bias_acc", {kGaFloat32});
    if (acc->numel != dy->cols)
      fail(kGaInvalidArgument, "bias_acc",
           "bias_acc has " + std::to_string(acc->numel) + " elements but dy has " +
               std::to_string(dy->cols) + " columns");
    // dy's own checks are ga_wgrad_accumulate's: a one-column x stands in for the weight side.
    ga_matrix as_acc{*acc, dy->cols, 1, 1, 1};
    ga_matrix ones{dy->tensor, dy->rows, 1, dy->row_stride, 0};
    double alpha = 1.0, beta = 1.0;
    validate_wgrad(&as_acc, dy, &ones, options, kGaCPU, &alpha, &beta);
    const int64_t out = dy->cols;
    float* a = static_cast<float*>(acc->data);
    const bool overwrite = options->overwrite != 0 || alpha == 0.0;
    static thread_local std::vector<float> sums;
    sums.assign(static_cast<size_t>(out), 0.0f);
    const ga_dtype dt = dy->tensor.dtype;
    for (int64_t r = 0; r < dy->rows; ++r) {
      const int64_t base = r * dy->row_stride;
      if (dt == kGaFloat32) {
        const float* d = static_cast<const float*>(dy->tensor.data) + base;
        for (int64_t c = 0; c < out; ++c) sums[c] += d[c * dy->col_stride];
      } else {
        const uint16_t* d = static_cast<const uint16_t*>(dy->tensor.data) + base;
        for (int64_t c = 0; c < out; ++c) {
          const uint16_t v = d[c * dy->col_stride];
          sums[c] +=
              dt == kGaBFloat16 ? ga::formulas::bf16_to_float(v) : ga::formulas::half_to_float(v);
        }
      }
    }
    const float fa = static_cast<float>(alpha), fb = static_cast<float>(beta);
    for (int64_t c = 0; c < out; ++c)
      a[c] = overwrite ? fb * sums[c] : std::fma(fb, sums[c], fa * a[c]);
  });
}

int ga_wgrad_cpu_path(ga_dtype dtype, int64_t n, int64_t out, int64_t in, char* what, size_t len) {
#if defined(GA_HAVE_ONEDNN)
  Library& lib = library();
  std::string why;
  if (!loaded(lib, &why)) {
    write_what(what, len, why);
    return 0;
  }
  if (n <= 0 || out <= 0 || in <= 0) {
    write_what(what, len, "empty shape: no GEMM");
    return 1;
  }
  int fused = 0;
  const ga_status s = guarded([&] {
    ga_matrix dy{{nullptr, n * out, dtype, kGaCPU, 0}, n, out, out, 1};
    ga_matrix x{{nullptr, n * in, dtype, kGaCPU, 0}, n, in, in, 1};
    Cache& cache = thread_cache(lib);
    Entry* e = &entry(lib, cache, key_of(dy, x, true));
    std::string said = e->what;
    if (e->prim == nullptr && dtype != kGaFloat32) {
      dy.tensor.dtype = x.tensor.dtype = kGaFloat32;
      e = &entry(lib, cache, key_of(dy, x, true));
      if (e->prim != nullptr) said = e->what + " on inputs widened to float32 (" + said + ")";
    }
    write_what(what, len, said);
    fused = e->prim != nullptr;
  });
  if (s != kGaOk) write_what(what, len, ga_last_error());
  return fused;
#else
  (void)dtype;
  (void)n;
  (void)out;
  (void)in;
  write_what(what, len, "built without oneDNN's headers");
  return 0;
#endif
}

}  // extern "C"
