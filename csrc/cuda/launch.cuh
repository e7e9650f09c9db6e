// Launching the pipelines of ops.h on a CUDA stream: the __global__ kernels around the bodies
// of device_common.cuh / ops.h, and CudaBackend, which launches them on the caller's stream.
// Nothing here synchronises with the device.
//
// Each op family's translation unit (accumulate.cu, norms.cu, apply.cu, apply_adam.cu,
// apply_adamw.cu, copy.cu, batchnorm.cu) includes this header and instantiates only the kernels its
// own pipelines need, so the families compile in parallel. The kernels and the backend have
// internal linkage on purpose: every translation unit registers its own instantiations with the
// CUDA runtime, and no kernel template is shared across translation units. The per-device state
// that must exist once (SM counts, the scratch memory pool) is defined in backend.cu.
#ifndef GRADIENT_ACCUMULATOR_CUDA_LAUNCH_CUH_
#define GRADIENT_ACCUMULATOR_CUDA_LAUNCH_CUH_

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <string>

#include "ops.h"

namespace ga {
namespace cuda {

// Defined once, in backend.cu.
/// Turns a CUDA error into the library's runtime error (and clears a sticky launch error).
void check(cudaError_t e, const char* what);
/// Multiprocessor count of `device`, cached.
int sm_count(int device);
/// The stream-ordered memory pool of the library's scratch memory on `device`.
cudaMemPool_t scratch_pool(int device);
/// ga_cuda_apply for Adam (defined in apply_adam.cu) and AdamW (apply_adamw.cu).
ga_status apply_adam(const ga_apply_tensors* tensors, const ga_apply_options* options,
                     const float* skip_flag, ga_cuda_apply_stats* stats, void* stream);
ga_status apply_adamw(const ga_apply_tensors* tensors, const ga_apply_options* options,
                      const float* skip_flag, ga_cuda_apply_stats* stats, void* stream);

namespace {

// ---- device reductions, in the orders that host_warp_tree / host_block_tree reproduce ----

__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
  for (int off = kWarp / 2; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
  return v;
}

/// Σ over the block; the result is valid in thread 0.
__device__ __forceinline__ double block_sum(double v) {
  __shared__ double part[kThreads / kWarp];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  v = warp_sum(v);
  __syncthreads();  // the previous call's readers of `part` are done
  if (lane == 0) part[warp] = v;
  __syncthreads();
  if (warp == 0) v = warp_sum(lane < kThreads / kWarp ? part[lane] : 0.0);
  return v;
}

// ---- kernels ----

// Kernel arguments must fit the classic 4 KiB parameter space (no dependence on CUDA 12.1's
// larger limit): the fused apply's are the largest.
static_assert(sizeof(Meta<5>) +
                      sizeof(ApplyOp<Opt::kAdamW, false, true, true, float, float, float>) +
                      3 * sizeof(void*) <=
                  4096,
              "launch metadata too large for the kernel parameter space");

template <bool Reduce, int L, typename Op>
__global__ void __launch_bounds__(kThreads)
    chunk_kernel(const Meta<L> m, const Op op, int64_t n, double* partials, float* flag) {
  ThreadState st;
  for (int64_t c = blockIdx.x; c < n; c += gridDim.x) {
    double v = chunk_thread(m, op, c, static_cast<int>(threadIdx.x), kThreads, st);
    if (Reduce) {
      v = block_sum(v);
      if (threadIdx.x == 0) {
        const int t = tensor_of(m, c);
        partials[m.out_base[t] + (c - m.start[t])] = v;
      }
    }
  }
  if (flag != nullptr && st.bad) *flag = 1.0f;  // every writer stores the same value
}

template <int L, typename T0, typename T1>
__global__ void __launch_bounds__(kThreads)
    unit_kernel(const Meta<L> m, int64_t tasks, double* out0, double* out1) {
  constexpr int kWarps = kThreads / kWarp;
  const int lane = threadIdx.x % kWarp;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t task = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / kWarp; task < tasks;
       task += stride) {  // the same trip count for every lane of a warp
    double s0, s1;
    int u;
    unit_task_lane<L, T0, T1>(m, task, lane, s0, s1, u);
    const int t = tensor_of(m, task);
    if ((m.trailing >> t) & 1u) {
      if (u >= 0) {
        out0[u] = s0;
        if (L > 1) out1[u] = s1;
      }
    } else {
      s0 = warp_sum(s0);
      if (L > 1) s1 = warp_sum(s1);
      if (lane == 0) {
        out0[u] = s0;
        if (L > 1) out1[u] = s1;
      }
    }
  }
}

template <typename F>
__global__ void __launch_bounds__(kThreads) for_each_kernel(int64_t n, const F f) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads)
    f(i);
}

template <typename Post>
__global__ void __launch_bounds__(kThreads)
    sum_partials_kernel(const double* p, int64_t n, const Post post) {
  double v = 0.0;
  for (int64_t j = threadIdx.x; j < n; j += kThreads) v += p[j];
  v = block_sum(v);
  if (threadIdx.x == 0) post(v);
}

/// Blocks of a chunked launch over `n` chunks (see Grid in ops.h); `per_sm`: resident blocks of
/// the kernel per SM (not used by Grid::kPerChunk).
template <typename Op>
inline int chunk_blocks(int64_t n, int sms, int per_sm) {
  switch (grid_of<Op>::value) {
    case Grid::kPerChunk:
      return static_cast<int>(n);  // n < 2^31: the chunk starts are int32
    case Grid::kTwoPerSm:
      return static_cast<int>(std::min<int64_t>(n, int64_t(sms) * std::min(per_sm, 2)));
    default:
      return static_cast<int>(std::min<int64_t>(n, int64_t(sms) * per_sm));
  }
}

// ---- errors ----

inline void check_launch(const char* kernel) { check(cudaGetLastError(), kernel); }

/// Launches on `stream`, on the current device, which must be the tensors' (`device`): the
/// library never switches devices (that would create a context on the caller's device; the
/// Python layer makes the tensors' device current). The checks run at the first launch, after
/// validation, so bad input is reported as such even without a GPU. Scratch memory is freed
/// stream-ordered when the call ends.
class CudaBackend {
 public:
  CudaBackend(cudaStream_t stream, int device) : stream_(stream), target_(device) {}
  ~CudaBackend() {
    if (scratch_ != nullptr) cudaFreeAsync(scratch_, stream_);
  }
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  static constexpr int kCachedDevices = 64;

  int max_blocks() {
    if (device_ < 0) {
      cudaGetLastError();  // a stale error of an earlier call must not fail this one
      int current = 0;
      check(cudaGetDevice(&current), "cudaGetDevice");
      if (target_ >= 0 && target_ != current)
        detail::fail(kGaInvalidArgument, "device",
                     "the tensors are on cuda:" + std::to_string(target_) +
                         " but the current device is cuda:" + std::to_string(current) +
                         "; make their device current first");
      device_ = current;
      sms_ = sm_count(device_);
    }
    return sms_ * (2048 / kThreads);  // enough resident blocks to fill every SM
  }

  char* workspace(size_t bytes) {
    max_blocks();
    if (scratch_ != nullptr) detail::fail(kGaRuntimeError, "", "internal: one workspace per call");
    void* p = nullptr;
    check(cudaMallocFromPoolAsync(&p, std::max<size_t>(bytes, 256), scratch_pool(device_), stream_),
          "cudaMallocFromPoolAsync");
    scratch_ = p;
    return static_cast<char*>(p);
  }

  void zero_bytes(void* p, size_t bytes) {
    max_blocks();
    check(cudaMemsetAsync(p, 0, bytes, stream_), "cudaMemsetAsync");
  }

  template <bool Reduce, int L, typename Op>
  void chunks(const Meta<L>& m, const Op& op, int64_t n, double* partials, float* flag) {
    if (n == 0) return;
    max_blocks();
    int per_sm = 0;
    if (grid_of<Op>::value != Grid::kPerChunk) {
      // Blocks every SM can hold at once, as the kernel's registers allow (asked once per kernel
      // and device): the resident grid, or the cap of a smaller one.
      static std::atomic<int> resident[kCachedDevices] = {};
      per_sm = device_ < kCachedDevices ? resident[device_].load(std::memory_order_relaxed) : 0;
      if (per_sm == 0) {
        check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, chunk_kernel<Reduce, L, Op>,
                                                            kThreads, 0),
              "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
        per_sm = std::max(per_sm, 1);
        if (device_ < kCachedDevices) resident[device_].store(per_sm, std::memory_order_relaxed);
      }
    }
    const int blocks = chunk_blocks<Op>(n, sms_, per_sm);
    chunk_kernel<Reduce, L, Op><<<blocks, kThreads, 0, stream_>>>(m, op, n, partials, flag);
    check_launch("chunk_kernel");
  }

  template <typename T0, typename T1, int L>
  void unit_sums(const Meta<L>& m, int64_t tasks, double* out0, double* out1) {
    if (tasks == 0) return;
    constexpr int kWarps = kThreads / kWarp;
    const int blocks =
        static_cast<int>(std::min<int64_t>((tasks + kWarps - 1) / kWarps, max_blocks()));
    unit_kernel<L, T0, T1><<<blocks, kThreads, 0, stream_>>>(m, tasks, out0, out1);
    check_launch("unit_kernel");
  }

  template <typename F>
  void for_each(int64_t n, const F& f) {
    if (n == 0) return;
    const int blocks =
        static_cast<int>(std::min<int64_t>((n + kThreads - 1) / kThreads, max_blocks()));
    for_each_kernel<F><<<blocks, kThreads, 0, stream_>>>(n, f);
    check_launch("for_each_kernel");
  }

  template <typename Post>
  void sum_partials(const double* p, int64_t n, const Post& post) {
    max_blocks();
    sum_partials_kernel<Post><<<1, kThreads, 0, stream_>>>(p, n, post);
    check_launch("sum_partials_kernel");
  }

 private:
  cudaStream_t stream_;
  int target_;
  int device_ = -1;
  int sms_ = 0;
  void* scratch_ = nullptr;
};

inline int device_of(const ga_tensor* t) {
  return t != nullptr && t->device_type == kGaCUDA ? t->device_id : -1;
}
inline int device_of(const ga_tensor_list& l) { return l.size > 0 ? device_of(l.tensors) : -1; }

/// Run one pipeline with the backend for `stream`, on `device`; CUDA failures become statuses.
template <typename F>
ga_status run(int device, void* stream, F&& pipeline) {
  ga_status status = kGaOk;
  const ga_status outer = detail::guarded([&] {
    CudaBackend backend(static_cast<cudaStream_t>(stream), device);
    status = pipeline(backend);
  });
  return outer != kGaOk ? outer : status;
}

}  // namespace
}  // namespace cuda
}  // namespace ga

#endif  // GRADIENT_ACCUMULATOR_CUDA_LAUNCH_CUH_
