// CUDA entry points: the __global__ kernels around the bodies of device_common.cuh / ops.h, the
// backend that launches them on the caller's stream, and the extern "C" functions of cuda.h.
// Nothing here synchronises with the device.
#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "ops.h"

namespace ga {
namespace cuda {
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
static_assert(sizeof(Meta<5>) + sizeof(ApplyOp<Opt::kAdamW, false, true, true, float, float, float>) +
                  3 * sizeof(void*) <= 4096,
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
  for (int64_t task = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / kWarp;
       task < tasks; task += stride) {  // the same trip count for every lane of a warp
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

// ---- errors ----

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear a sticky launch error so that the next call starts clean
    detail::fail(kGaRuntimeError, "",
                 std::string("CUDA error in ") + what + ": " + cudaGetErrorString(e));
  }
}

void check_launch(const char* kernel) { check(cudaGetLastError(), kernel); }

int sm_count(int device) {
  static std::mutex mu;
  static std::map<int, int> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(device);
  if (it != cache.end()) return it->second;
  int sms = 0;
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
        "cudaDeviceGetAttribute");
  cache[device] = sms;
  return sms;
}

/// The memory pool of the library's scratch memory on `device`: stream-ordered allocations
/// (cudaMallocFromPoolAsync / cudaFreeAsync), so every call gets scratch of its own without a
/// synchronisation, from any thread, and inside CUDA graph capture. Up to 64 MiB stays reserved
/// between calls, so steady-state steps do not map memory.
cudaMemPool_t scratch_pool(int device) {
  static std::mutex mu;
  static std::map<int, cudaMemPool_t> pools;
  std::lock_guard<std::mutex> lock(mu);
  auto it = pools.find(device);
  if (it != pools.end()) return it->second;
  cudaMemPoolProps props{};
  props.allocType = cudaMemAllocationTypePinned;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = device;
  cudaMemPool_t pool;
  check(cudaMemPoolCreate(&pool, &props), "cudaMemPoolCreate");
  uint64_t keep = uint64_t(64) << 20;
  check(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep),
        "cudaMemPoolSetAttribute");
  pools[device] = pool;
  return pool;
}

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
    if (scratch_ != nullptr)
      detail::fail(kGaRuntimeError, "", "internal: one workspace per call");
    void* p = nullptr;
    check(cudaMallocFromPoolAsync(&p, std::max<size_t>(bytes, 256), scratch_pool(device_),
                                  stream_),
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
    const int blocks = static_cast<int>(std::min<int64_t>(n, max_blocks()));
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
    const int blocks = static_cast<int>(std::min<int64_t>((n + kThreads - 1) / kThreads, max_blocks()));
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

int device_of(const ga_tensor* t) {
  return t != nullptr && t->device_type == kGaCUDA ? t->device_id : -1;
}
int device_of(const ga_tensor_list& l) { return l.size > 0 ? device_of(l.tensors) : -1; }

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

using ga::cuda::CudaBackend;
using ga::cuda::device_of;
using ga::cuda::run;

extern "C" {

int ga_has_cuda(void) { return 1; }

int ga_cuda_device_count(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

ga_status ga_cuda_accumulate(ga_tensor_list accumulators, ga_tensor_list grads,
                             const ga_accumulate_options* options, float* nonfinite_flag,
                             double* sumsq, void* stream) {
  return run(device_of(accumulators), stream, [&](CudaBackend& b) {
    return ga::cuda::accumulate(b, accumulators, grads, options, nonfinite_flag, sumsq);
  });
}

ga_status ga_cuda_sum_of_squares(ga_tensor_list tensors, double* sumsq, void* stream) {
  return run(device_of(tensors), stream,
             [&](CudaBackend& b) { return ga::cuda::sum_of_squares(b, tensors, sumsq); });
}

ga_status ga_cuda_unitwise_norm(ga_tensor tensor, ga_units units, ga_tensor norms, void* stream) {
  return run(device_of(&tensor), stream,
             [&](CudaBackend& b) { return ga::cuda::unitwise_norm(b, tensor, units, norms); });
}

ga_status ga_cuda_adaptive_clip(ga_tensor_list params, ga_tensor_list grads, const ga_units* units,
                                double clip_factor, double eps, void* stream) {
  return run(device_of(grads), stream, [&](CudaBackend& b) {
    return ga::cuda::adaptive_clip(b, params, grads, units, clip_factor, eps);
  });
}

ga_status ga_cuda_apply(const ga_apply_tensors* tensors, const ga_apply_options* options,
                        const float* skip_flag, ga_cuda_apply_stats* stats, void* stream) {
  const int device = tensors != nullptr ? device_of(tensors->accumulators) : -1;
  return run(device, stream, [&](CudaBackend& b) {
    return ga::cuda::apply(b, tensors, options, skip_flag, stats, "accumulators", "params");
  });
}

ga_status ga_cuda_pack(ga_tensor_list src, ga_tensor flat, double scale, void* stream) {
  return run(device_of(&flat), stream,
             [&](CudaBackend& b) { return ga::cuda::copy_flat(b, src, flat, scale, true); });
}

ga_status ga_cuda_unpack(ga_tensor flat, ga_tensor_list dst, double scale, void* stream) {
  return run(device_of(&flat), stream,
             [&](CudaBackend& b) { return ga::cuda::copy_flat(b, dst, flat, scale, false); });
}

ga_status ga_cuda_zero(ga_tensor_list tensors, void* stream) {
  return run(device_of(tensors), stream,
             [&](CudaBackend& b) { return ga::cuda::zero(b, tensors); });
}

ga_status ga_cuda_bn_merge(double* count_a, ga_tensor mean_a, ga_tensor m2_a, double count_b,
                           ga_tensor mean_b, ga_tensor m2_b, void* stream) {
  return run(device_of(&mean_a), stream, [&](CudaBackend& b) {
    return ga::cuda::bn_merge(b, count_a, mean_a, m2_a, count_b, mean_b, m2_b);
  });
}

ga_status ga_cuda_bn_update_running(ga_tensor running_mean, ga_tensor running_var, ga_tensor mean,
                                    ga_tensor m2, double count, double new_weight, int unbiased,
                                    void* stream) {
  return run(device_of(&running_mean), stream, [&](CudaBackend& b) {
    return ga::cuda::bn_update_running(b, running_mean, running_var, mean, m2, count, new_weight,
                                       unbiased);
  });
}

}  // extern "C"
