// ga_cuda_wgrad_accumulate (cuda.h): acc ← a·acc + b·dyᵀx as one cuBLASLt matmul on the caller's
// stream, and ga_cublaslt_load. cuBLASLt is opened with dlopen, never linked, so the core (and
// the wheel) load without it; only its header is needed at build time (GA_HAVE_CUBLASLT).
//
// Row-major acc[out, in] is column-major C[in, out] with ldc = in, and C = xᵀ·dy: in column-major
// terms m = in, n = out, k = the rows of x and dy. A is x (row-major x read column-major is xᵀ, op
// N; a column-major x is read with op T) and B is dy (row-major dy read column-major is dyᵀ, op T;
// a column-major dy with op N).
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "../core/internal.h"
#include "gradient_accumulator/cuda.h"

#if defined(GA_HAVE_CUBLASLT)
#include <cublasLt.h>
#include <dlfcn.h>
#endif

namespace ga {
namespace cuda {

void check(cudaError_t e, const char* what);  // backend.cu
cudaMemPool_t scratch_pool(int device);       // backend.cu

namespace {

using detail::fail;

/// How one operand is read: its storage order and leading dimension.
struct Operand {
  bool row_major;  // element (r, c) at r·ld + c; else at r + c·ld
  int64_t ld;
};

/// The one unit stride of `m` and the other as the leading dimension; kGaUnsupported otherwise
/// (a broadcast, overlapping or doubly strided view: the caller copies and falls back).
Operand operand_of(const ga_matrix& m, const std::string& name) {
  const bool cols_unit = m.cols <= 1 || m.col_stride == 1;
  const bool rows_unit = m.rows <= 1 || m.row_stride == 1;
  if (cols_unit && (m.rows <= 1 || m.row_stride >= m.cols))
    return {true, m.rows <= 1 ? std::max<int64_t>(1, m.cols) : m.row_stride};
  if (rows_unit && (m.cols <= 1 || m.col_stride >= m.rows))
    return {false, m.cols <= 1 ? std::max<int64_t>(1, m.rows) : m.col_stride};
  fail(kGaUnsupported, name,
       name + " has strides (" + std::to_string(m.row_stride) + ", " +
           std::to_string(m.col_stride) +
           "); the fused GEMM needs one unit stride and the other at least the size along it");
}

void check_matrix(const ga_matrix* m, const char* name, int32_t* device) {
  if (m == nullptr) fail(kGaInvalidArgument, name, std::string(name) + " is null");
  detail::check_tensor(m->tensor, name);
  detail::check_cuda(m->tensor, name, device);
  if (m->rows < 0 || m->cols < 0 || m->row_stride < 0 || m->col_stride < 0)
    fail(kGaInvalidArgument, name,
         std::string(name) + " has a negative size or stride (sizes and strides are >= 0)");
  if (m->rows > 0 && m->cols > 0) {
    // The last element the strides reach must lie inside the tensor's numel.
    const int64_t last =
        detail::checked_add(detail::checked_mul(m->rows - 1, m->row_stride, name),
                            detail::checked_mul(m->cols - 1, m->col_stride, name), name);
    if (last >= m->tensor.numel)
      fail(kGaInvalidArgument, name,
           std::string(name) + ": " + std::to_string(m->rows) + "x" + std::to_string(m->cols) +
               " with strides (" + std::to_string(m->row_stride) + ", " +
               std::to_string(m->col_stride) + ") reaches element " + std::to_string(last) +
               " of a tensor of " + std::to_string(m->tensor.numel));
  }
}

/// The whole validation (nothing is enqueued before it passed): (a, b) as ga_accumulate has them
/// (accumulate_coefficients in core/accumulate.cc; a = 0 when the step overwrites).
struct Plan {
  int device;
  ga_dtype dtype;
  int64_t m, n, k;  // column-major GEMM sizes: in, out, rows
  Operand x, dy;
  double a, b;
};

Plan validate(const ga_matrix* acc, const ga_matrix* dy, const ga_matrix* x,
              const ga_accumulate_options* options) {
  if (options == nullptr) fail(kGaInvalidArgument, "options", "options is null");
  int32_t device = -1;
  check_matrix(acc, "acc", &device);
  check_matrix(dy, "dy", &device);
  check_matrix(x, "x", &device);
  detail::check_dtype_in(acc->tensor, "acc", {kGaFloat32});
  detail::check_dtype_in(dy->tensor, "dy", {kGaFloat32, kGaBFloat16, kGaFloat16});
  if (x->tensor.dtype != dy->tensor.dtype)
    fail(kGaTypeError, "x",
         std::string("x has dtype ") + detail::dtype_name(x->tensor.dtype) + " but dy has " +
             detail::dtype_name(dy->tensor.dtype) + "; they must be the same");
  if (dy->rows != x->rows)
    fail(kGaInvalidArgument, "x",
         "x has " + std::to_string(x->rows) + " rows but dy has " + std::to_string(dy->rows));
  if (acc->rows != dy->cols || acc->cols != x->cols)
    fail(kGaInvalidArgument, "acc",
         "acc is " + std::to_string(acc->rows) + "x" + std::to_string(acc->cols) + " but dyᵀx is " +
             std::to_string(dy->cols) + "x" + std::to_string(x->cols));
  if ((acc->cols > 1 && acc->col_stride != 1) || (acc->rows > 1 && acc->row_stride != acc->cols))
    fail(kGaInvalidArgument, "acc", "acc must be row-major and dense (strides (in, 1))");
  // The accumulate family's coefficients, one definition for every path (core/accumulate.cc).
  double a = 1.0, b = 1.0;
  detail::accumulate_coefficients(*options, true, &a, &b);
  if (options->overwrite) a = 0.0;
  std::vector<detail::Range> written, read;
  detail::add_range(written, acc->tensor, "acc");
  detail::add_range(read, dy->tensor, "dy");
  detail::add_range(read, x->tensor, "x");
  detail::check_disjoint(written, read);
  Plan p{device, dy->tensor.dtype, x->cols, dy->cols, x->rows, {}, {}, a, b};
  p.x = operand_of(*x, "x");
  p.dy = operand_of(*dy, "dy");
  return p;
}

/// The tensors' device must be the current one (the library never switches devices).
int current_device(int target) {
  cudaGetLastError();  // a stale error of an earlier call must not fail this one
  int current = 0;
  check(cudaGetDevice(&current), "cudaGetDevice");
  if (target >= 0 && target != current)
    fail(kGaInvalidArgument, "device",
         "the tensors are on cuda:" + std::to_string(target) + " but the current device is cuda:" +
             std::to_string(current) + "; make their device current first");
  return current;
}

__global__ void scale_kernel(float* p, int64_t n, float a) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    p[i] = a * p[i];
}

/// k = 0: no product, acc ← a·acc (zeros when a = 0: the old values are not read).
void scale_only(const Plan& p, float* acc, cudaStream_t stream) {
  const int64_t n = p.m * p.n;
  if (n == 0 || p.a == 1.0) return;
  current_device(p.device);
  if (p.a == 0.0) {
    check(cudaMemsetAsync(acc, 0, static_cast<size_t>(n) * sizeof(float), stream),
          "cudaMemsetAsync");
    return;
  }
  const int blocks = static_cast<int>(std::min<int64_t>((n + 255) / 256, 4096));
  scale_kernel<<<blocks, 256, 0, stream>>>(acc, n, static_cast<float>(p.a));
  check(cudaGetLastError(), "scale_kernel");
}

#if defined(GA_HAVE_CUBLASLT)

// ---- the cuBLASLt functions used, resolved with dlsym ----

#define GA_CUBLASLT_FUNCTIONS(X)          \
  X(cublasLtGetVersion)                   \
  X(cublasLtGetStatusString)              \
  X(cublasLtCreate)                       \
  X(cublasLtMatmulDescCreate)             \
  X(cublasLtMatmulDescSetAttribute)       \
  X(cublasLtMatmulDescDestroy)            \
  X(cublasLtMatrixLayoutCreate)           \
  X(cublasLtMatrixLayoutDestroy)          \
  X(cublasLtMatmulPreferenceCreate)       \
  X(cublasLtMatmulPreferenceSetAttribute) \
  X(cublasLtMatmulPreferenceDestroy)      \
  X(cublasLtMatmulAlgoGetHeuristic)       \
  X(cublasLtMatmul)

struct Lt {
#define GA_LT_MEMBER(name) decltype(&::name) name = nullptr;
  GA_CUBLASLT_FUNCTIONS(GA_LT_MEMBER)
#undef GA_LT_MEMBER
  std::string origin;  // the path or soname it came from, for messages
};

std::mutex g_load_mu;
std::atomic<const Lt*> g_lt{nullptr};

constexpr int kRuntimeMajor = CUDART_VERSION / 1000;

void load(const char* path) {
  std::lock_guard<std::mutex> lock(g_load_mu);
  if (g_lt.load(std::memory_order_acquire) != nullptr) return;
  const std::string soname = "libcublasLt.so." + std::to_string(kRuntimeMajor);
  void* lib = nullptr;
  std::string origin;
  if (path != nullptr) {
    origin = path;
    lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  } else {
    origin = soname;
    lib = dlopen(soname.c_str(), RTLD_NOW | RTLD_NOLOAD);  // already loaded (by torch, say)
    if (lib == nullptr) lib = dlopen(soname.c_str(), RTLD_NOW | RTLD_LOCAL);
  }
  if (lib == nullptr) {
    const char* why = dlerror();
    fail(kGaUnsupported, "path",
         "cuBLASLt could not be loaded from " + origin + ": " + (why ? why : "unknown error"));
  }
  auto lt = std::make_unique<Lt>();
  lt->origin = origin;
#define GA_LT_RESOLVE(name)                                                            \
  lt->name = reinterpret_cast<decltype(&::name)>(dlsym(lib, #name));                   \
  if (lt->name == nullptr) {                                                           \
    dlclose(lib);                                                                      \
    fail(kGaUnsupported, "path", origin + " has no " #name ": not a usable cuBLASLt"); \
  }
  GA_CUBLASLT_FUNCTIONS(GA_LT_RESOLVE)
#undef GA_LT_RESOLVE
  const size_t version = lt->cublasLtGetVersion();  // major·10000 + minor·100 + patch
  if (static_cast<int>(version / 10000) != kRuntimeMajor) {
    dlclose(lib);
    fail(kGaUnsupported, "path",
         origin + " is cuBLASLt " + std::to_string(version / 10000) + "." +
             std::to_string(version / 100 % 100) + ", but this build uses the CUDA " +
             std::to_string(kRuntimeMajor) + " runtime; load a cuBLASLt " +
             std::to_string(kRuntimeMajor) + ".x");
  }
  g_lt.store(lt.release(), std::memory_order_release);  // kept for the process's lifetime
}

void check_lt(const Lt& lt, cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS)
    fail(kGaRuntimeError, "",
         std::string("cuBLASLt error in ") + what + ": " + lt.cublasLtGetStatusString(s));
}

/// Largest power of two ≤ 256 dividing the address: the alignment the algorithm may assume.
uint32_t alignment_of(const void* p) {
  const uintptr_t v = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 256;
  while (a > 1 && v % a != 0) a /= 2;
  return a;
}

struct DeviceState {
  cublasLtHandle_t handle = nullptr;
  size_t workspace_bytes = 0;
};

/// Descriptors and the chosen algorithm of one case, made once.
struct Entry {
  bool usable = false;                            // the heuristic found an algorithm
  cublasStatus_t status = CUBLAS_STATUS_SUCCESS;  // the heuristic's answer where it found none
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  size_t workspace = 0;  // what the algorithm needs
};

using Key = std::tuple<int, int, int64_t, int64_t, int64_t, int64_t, int64_t, bool, bool, bool,
                       uint32_t, uint32_t, uint32_t>;

// Cases differ by the micro-batch's row count (uneven batches, packed sequences): bounded, so
// that a long run of distinct counts does not grow without end.
constexpr size_t kMaxEntries = 1024;

void destroy(const Lt& lt, Entry& e) {
  if (e.a) lt.cublasLtMatrixLayoutDestroy(e.a);
  if (e.b) lt.cublasLtMatrixLayoutDestroy(e.b);
  if (e.c) lt.cublasLtMatrixLayoutDestroy(e.c);
  if (e.desc) lt.cublasLtMatmulDescDestroy(e.desc);
}

// Shared: a call holds its entry while cublasLtMatmul reads the descriptors, so that another
// thread emptying the full cache destroys them only once that call has let go.
using EntryRef = std::shared_ptr<const Entry>;

std::mutex g_cache_mu;
std::map<int, DeviceState> g_devices;
std::map<Key, EntryRef> g_cache;

cudaDataType_t cuda_type(ga_dtype d) {
  switch (d) {
    case kGaBFloat16:
      return CUDA_R_16BF;
    case kGaFloat16:
      return CUDA_R_16F;
    default:
      return CUDA_R_32F;
  }
}

/// The entry of this case on the current device (under g_cache_mu): made on the first call.
EntryRef entry(const Lt& lt, const DeviceState& ds, const Plan& p, const Key& key, uint32_t align_x,
               uint32_t align_dy, uint32_t align_acc) {
  auto it = g_cache.find(key);
  if (it != g_cache.end()) return it->second;
  if (g_cache.size() >= kMaxEntries) g_cache.clear();  // entries in use live on until released
  // The deleter destroys the descriptors, of a half-made entry too when a call below fails.
  const Lt* ltp = &lt;  // the loaded library is kept for the process's lifetime
  std::shared_ptr<Entry> made(new Entry, [ltp](Entry* x) {
    destroy(*ltp, *x);
    delete x;
  });
  Entry& e = *made;
  const cudaDataType_t t = cuda_type(p.dtype);
  check_lt(lt, lt.cublasLtMatmulDescCreate(&e.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F),
           "cublasLtMatmulDescCreate");
  const int32_t op_a = p.x.row_major ? CUBLAS_OP_N : CUBLAS_OP_T;
  const int32_t op_b = p.dy.row_major ? CUBLAS_OP_T : CUBLAS_OP_N;
  check_lt(
      lt,
      lt.cublasLtMatmulDescSetAttribute(e.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof op_a),
      "cublasLtMatmulDescSetAttribute");
  check_lt(
      lt,
      lt.cublasLtMatmulDescSetAttribute(e.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof op_b),
      "cublasLtMatmulDescSetAttribute");
  // A as stored: in×k (op N) or k×in (op T); B: out×k (op T) or k×out (op N); C: in×out.
  const uint64_t m = p.m, n = p.n, k = p.k;
  check_lt(
      lt,
      lt.cublasLtMatrixLayoutCreate(&e.a, t, p.x.row_major ? m : k, p.x.row_major ? k : m, p.x.ld),
      "cublasLtMatrixLayoutCreate");
  check_lt(lt,
           lt.cublasLtMatrixLayoutCreate(&e.b, t, p.dy.row_major ? n : k, p.dy.row_major ? k : n,
                                         p.dy.ld),
           "cublasLtMatrixLayoutCreate");
  check_lt(lt, lt.cublasLtMatrixLayoutCreate(&e.c, CUDA_R_32F, m, n, static_cast<int64_t>(m)),
           "cublasLtMatrixLayoutCreate");
  cublasLtMatmulPreference_t pref = nullptr;
  check_lt(lt, lt.cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  cublasStatus_t s =
      lt.cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                              &ds.workspace_bytes, sizeof ds.workspace_bytes);
  const std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t> aligns[] = {
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_x},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_dy},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_acc},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_acc}};
  for (const auto& [attr, value] : aligns)
    if (s == CUBLAS_STATUS_SUCCESS)
      s = lt.cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof value);
  if (s == CUBLAS_STATUS_SUCCESS)
    s = lt.cublasLtMatmulAlgoGetHeuristic(ds.handle, e.desc, e.a, e.b, e.c, e.c, pref, 1, &result,
                                          &found);
  lt.cublasLtMatmulPreferenceDestroy(pref);
  // No algorithm is an answer (cached: the case falls back to a formed gradient), not an error:
  // NOT_SUPPORTED, and INVALID_VALUE for a layout or alignment this version's kernels reject.
  if (s != CUBLAS_STATUS_NOT_SUPPORTED && s != CUBLAS_STATUS_INVALID_VALUE)
    check_lt(lt, s, "cublasLtMatmulAlgoGetHeuristic");
  e.usable = s == CUBLAS_STATUS_SUCCESS && found > 0 && result.state == CUBLAS_STATUS_SUCCESS;
  e.status = s != CUBLAS_STATUS_SUCCESS ? s
             : found > 0                ? result.state
                                        : CUBLAS_STATUS_NOT_SUPPORTED;
  if (e.usable) {
    e.algo = result.algo;
    e.workspace = result.workspaceSize;
  }
  g_cache.emplace(key, made);
  return made;
}

void matmul(const Plan& p, const ga_matrix& acc, const ga_matrix& dy, const ga_matrix& x,
            cudaStream_t stream) {
  const Lt* ltp = g_lt.load(std::memory_order_acquire);
  if (ltp == nullptr) fail(kGaUnsupported, "", "cuBLASLt is not loaded (ga_cublaslt_load)");
  const Lt& lt = *ltp;
  const int device = current_device(p.device);
  const uint32_t align_x = alignment_of(x.tensor.data), align_dy = alignment_of(dy.tensor.data),
                 align_acc = alignment_of(acc.tensor.data);
  const Key key{device,
                static_cast<int>(p.dtype),
                p.m,
                p.n,
                p.k,
                p.x.ld,
                p.dy.ld,
                p.x.row_major,
                p.dy.row_major,
                p.a == 0.0,
                align_x,
                align_dy,
                align_acc};
  cublasLtHandle_t handle;
  EntryRef e;
  {
    std::lock_guard<std::mutex> lock(g_cache_mu);
    DeviceState& ds = g_devices[device];
    if (ds.handle == nullptr) {
      int major = 0;
      check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device),
            "cudaDeviceGetAttribute");
      ds.workspace_bytes = size_t(major >= 9 ? 32 : 4) << 20;
      check_lt(lt, lt.cublasLtCreate(&ds.handle), "cublasLtCreate");
    }
    e = entry(lt, ds, p, key, align_x, align_dy, align_acc);
    handle = ds.handle;
  }
  if (!e->usable)
    fail(kGaUnsupported, "",
         "cuBLASLt has no algorithm for this case (" + std::string(detail::dtype_name(p.dtype)) +
             ", m=" + std::to_string(p.m) + " n=" + std::to_string(p.n) +
             " k=" + std::to_string(p.k) + "; " + lt.cublasLtGetStatusString(e->status) + ")");
  const size_t workspace_bytes = e->workspace;
  // The workspace comes stream-ordered from the library's scratch pool, per call: correct for
  // calls on several streams and threads at once and inside CUDA graph capture, where one
  // buffer per device would need cross-stream events; the pool keeps it mapped between calls.
  void* workspace = nullptr;
  if (workspace_bytes > 0)
    check(cudaMallocFromPoolAsync(&workspace, workspace_bytes, scratch_pool(device), stream),
          "cudaMallocFromPoolAsync");
  const float alpha = static_cast<float>(p.b), beta = static_cast<float>(p.a);
  void* c = acc.tensor.data;
  const cublasStatus_t s =
      lt.cublasLtMatmul(handle, e->desc, &alpha, x.tensor.data, e->a, dy.tensor.data, e->b, &beta,
                        c, e->c, c, e->c, &e->algo, workspace, workspace_bytes, stream);
  if (workspace != nullptr) cudaFreeAsync(workspace, stream);
  check_lt(lt, s, "cublasLtMatmul");
}

#endif  // GA_HAVE_CUBLASLT

}  // namespace
}  // namespace cuda
}  // namespace ga

extern "C" {

ga_status ga_cuda_wgrad_accumulate(const ga_matrix* acc, const ga_matrix* dy, const ga_matrix* x,
                                   const ga_accumulate_options* options, void* stream) {
  return ga::detail::guarded([&] {
    const ga::cuda::Plan p = ga::cuda::validate(acc, dy, x, options);
    const auto s = static_cast<cudaStream_t>(stream);
    if (p.m == 0 || p.n == 0) return;  // an empty accumulator: nothing to write
    if (p.k == 0) {
      ga::cuda::scale_only(p, static_cast<float*>(acc->tensor.data), s);
      return;
    }
#if defined(GA_HAVE_CUBLASLT)
    ga::cuda::matmul(p, *acc, *dy, *x, s);
#else
    ga::detail::fail(kGaUnsupported, "",
                     "this build has no cuBLASLt headers (rebuild with cublasLt.h found: "
                     "GA_CUBLASLT_INCLUDE_DIR)");
#endif
  });
}

ga_status ga_cublaslt_load(const char* path) {
  return ga::detail::guarded([&] {
#if defined(GA_HAVE_CUBLASLT)
    ga::cuda::load(path);
#else
    (void)path;
    ga::detail::fail(kGaUnsupported, "",
                     "this build has no cuBLASLt headers (rebuild with cublasLt.h found: "
                     "GA_CUBLASLT_INCLUDE_DIR)");
#endif
  });
}

}  // extern "C"
