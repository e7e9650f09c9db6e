// Building blocks of the CUDA kernels, written once for the device and the host.
//
// Every kernel body in csrc/cuda is an ordinary function of (chunk, thread) marked GA_HD. nvcc
// compiles it for the GPU, wrapped in a __global__ kernel (launch.cuh); a plain C++ compiler
// compiles the same body for the host, where csrc/tests/cuda_emulated_test.cc runs it block by
// block and thread by thread against fp64 references. So the indexing, vectorisation, tails,
// dtype conversions and reduction orders of the GPU code are tested on machines without a GPU.
#ifndef GRADIENT_ACCUMULATOR_CUDA_DEVICE_COMMON_CUH_
#define GRADIENT_ACCUMULATOR_CUDA_DEVICE_COMMON_CUH_

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define GA_HD __host__ __device__ __forceinline__
#else
#define GA_HD inline
#endif
// Unrolling for the device pass only (the host compiler does not know the pragma).
#if defined(__CUDA_ARCH__)
#define GA_UNROLL _Pragma("unroll")
#else
#define GA_UNROLL
#endif

#include "../core/formulas.h"

namespace ga {
namespace cuda {

constexpr int kThreads = 256;  // threads per block of the chunked kernels
constexpr int kWarp = 32;
constexpr int kVec = 8;  // elements a thread handles per step: 16-byte loads
// Elements per chunk: one block's unit of work. GA_CUDA_CHUNK changes it for an experiment
// build only (tools/gpu_accumulate_variants.sh); the CPU core's chunks (core/internal.h) stay
// 16384.
#ifndef GA_CUDA_CHUNK
#define GA_CUDA_CHUNK 16384
#endif
constexpr int64_t kChunk = GA_CUDA_CHUNK;
static_assert(kChunk > 0 && kChunk % kVec == 0, "GA_CUDA_CHUNK must be a multiple of 8");
constexpr int kMaxTensors = 48;  // tensors per launch (the argument block stays < 4 KiB)

struct bf16 {
  uint16_t bits;
};
struct f16 {
  uint16_t bits;
};

// ---- bit casts and conversions (round to nearest even; identical on host and device) ----

using formulas::bits_to_float;
using formulas::float_to_bits;

GA_HD float to_f(float x) { return x; }
GA_HD float to_f(bf16 x) { return formulas::bf16_to_float(x.bits); }
GA_HD float to_f(f16 x) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(x.bits));
#else
  return formulas::half_to_float(x.bits);
#endif
}

template <typename T>
GA_HD T from_f(float x);
template <>
GA_HD float from_f<float>(float x) {
  return x;
}
template <>
GA_HD bf16 from_f<bf16>(float x) {
#if defined(__CUDA_ARCH__)
  return bf16{__bfloat16_as_ushort(__float2bfloat16_rn(x))};
#else
  return bf16{formulas::float_to_bf16(x)};
#endif
}
template <>
GA_HD f16 from_f<f16>(float x) {
#if defined(__CUDA_ARCH__)
  return f16{__half_as_ushort(__float2half_rn(x))};
#else
  return f16{formulas::float_to_half(x)};
#endif
}

GA_HD bool is_finite(float x) { return (float_to_bits(x) & 0x7f800000u) != 0x7f800000u; }

GA_HD float fma_f(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

GA_HD float sqrt_f(float x) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(x);
#else
  return std::sqrt(x);
#endif
}

GA_HD float div_f(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// ---- N consecutive elements ↔ floats. N == kVec: 16-byte vector accesses (the pointer is
// 16-byte aligned, checked on the host); N == 1: one scalar access. On the device the 32-bit
// words of a vector are built and taken apart explicitly (no type punning through uint4). ----

GA_HD float lo_half(uint32_t w, bf16) { return to_f(bf16{static_cast<uint16_t>(w & 0xffffu)}); }
GA_HD float hi_half(uint32_t w, bf16) { return to_f(bf16{static_cast<uint16_t>(w >> 16)}); }
GA_HD float lo_half(uint32_t w, f16) { return to_f(f16{static_cast<uint16_t>(w & 0xffffu)}); }
GA_HD float hi_half(uint32_t w, f16) { return to_f(f16{static_cast<uint16_t>(w >> 16)}); }
template <typename T>
GA_HD uint32_t pack_halves(float lo, float hi) {
  return static_cast<uint32_t>(from_f<T>(lo).bits) |
         (static_cast<uint32_t>(from_f<T>(hi).bits) << 16);
}

#if defined(__CUDA_ARCH__)
__device__ __forceinline__ void words_to_floats(const uint4& w, float* v, float) {
  v[0] = __uint_as_float(w.x);
  v[1] = __uint_as_float(w.y);
  v[2] = __uint_as_float(w.z);
  v[3] = __uint_as_float(w.w);
}
template <typename T>
__device__ __forceinline__ void words_to_floats(const uint4& w, float* v, T tag) {
  const uint32_t x[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    v[2 * k] = lo_half(x[k], tag);
    v[2 * k + 1] = hi_half(x[k], tag);
  }
}
__device__ __forceinline__ uint4 floats_to_words(const float* v, float) {
  return make_uint4(__float_as_uint(v[0]), __float_as_uint(v[1]), __float_as_uint(v[2]),
                    __float_as_uint(v[3]));
}
template <typename T>
__device__ __forceinline__ uint4 floats_to_words(const float* v, T) {
  return make_uint4(pack_halves<T>(v[0], v[1]), pack_halves<T>(v[2], v[3]),
                    pack_halves<T>(v[4], v[5]), pack_halves<T>(v[6], v[7]));
}
#endif

// The 16-byte accesses go through the cache-streaming intrinsics (ld.global.cs.v4 /
// st.global.cs.v4): each one is a single 128-bit instruction whatever the optimiser does around
// it. A plain `*reinterpret_cast<const uint4*>(p)` was split into four 32-bit loads in the
// accumulate and apply kernels (scalarised after the loop was rotated), and every byte is read
// once per pass, so evict-first is the right cache policy.
template <int N, typename T>
GA_HD void load(const T* p, float* v) {
#if defined(__CUDA_ARCH__)
  if constexpr (N * sizeof(T) % 16 == 0) {
    constexpr int kPer = 16 / static_cast<int>(sizeof(T));  // elements per 16-byte word
#pragma unroll
    for (int k = 0; k < N / kPer; ++k)
      words_to_floats(__ldcs(reinterpret_cast<const uint4*>(p) + k), v + k * kPer, T{});
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] = to_f(p[k]);
  }
#else
  for (int k = 0; k < N; ++k) v[k] = to_f(p[k]);
#endif
}

template <int N, typename T>
GA_HD void store(T* p, const float* v) {
#if defined(__CUDA_ARCH__)
  if constexpr (N * sizeof(T) % 16 == 0) {
    constexpr int kPer = 16 / static_cast<int>(sizeof(T));
#pragma unroll
    for (int k = 0; k < N / kPer; ++k)
      __stcs(reinterpret_cast<uint4*>(p) + k, floats_to_words(v + k * kPer, T{}));
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) p[k] = from_f<T>(v[k]);
  }
#else
  for (int k = 0; k < N; ++k) p[k] = from_f<T>(v[k]);
#endif
}

/// A fragment: U runs of W consecutive elements, run k starting `k·stride` elements after `p`.
/// Every load of a fragment is issued before any of its values is used, so a thread has U
/// independent 16-byte loads per list in flight (W == kVec), not one.
template <int U, int W, typename T>
GA_HD void load_frag(const T* p, int64_t stride, float* v) {
  GA_UNROLL
  for (int k = 0; k < U; ++k) load<W>(p + k * stride, v + k * W);
}

template <int U, int W, typename T>
GA_HD void store_frag(T* p, int64_t stride, const float* v) {
  GA_UNROLL
  for (int k = 0; k < U; ++k) store<W>(p + k * stride, v + k * W);
}

// ---- launch metadata: up to kMaxTensors tensors of L parallel lists, cut into chunks ----

template <int L>
struct Meta {
  void* ptr[L][kMaxTensors];
  int64_t numel[kMaxTensors];
  int64_t fan_in[kMaxTensors];     // units: elements per unit
  int64_t num_units[kMaxTensors];  // units: units of the tensor
  int32_t start[kMaxTensors + 1];  // first work item (chunk or unit task) of each tensor
  int32_t out_base[kMaxTensors];   // first partial sum / unit of each tensor in the call's arrays
  int8_t head[kMaxTensors];        // elements before tensor t's first 16-byte-aligned vector
                                   // (the same offset in every list), or -1: scalar accesses only
  uint64_t trailing;               // bit t: tensor t's units are strided (kGaUnitsTrailing)
  int32_t num_tensors;
};

/// Tensor that work item `item` belongs to (a linear scan over at most kMaxTensors entries).
template <int L>
GA_HD int tensor_of(const Meta<L>& m, int64_t item) {
  int t = 0;
  while (t + 1 < m.num_tensors && m.start[t + 1] <= item) ++t;
  return t;
}

/// Per-thread state of the chunked kernels: did this thread see a non-finite value.
struct ThreadState {
  int bad = 0;
};

/// The first element index h in [0, kVec) at which every pointer `p[l] + h·size[l]` is 16-byte
/// aligned, or -1 when there is none (pointers whose misalignments disagree). Vectors start there
/// and repeat every kVec elements, so a tensor's chunks (kChunk is a multiple of kVec) share it.
GA_HD int vec_head(const void* const* p, const int* size, int n) {
  for (int h = 0; h < kVec; ++h) {
    bool ok = true;
    for (int l = 0; l < n && ok; ++l)
      ok =
          p[l] == nullptr || (reinterpret_cast<uintptr_t>(p[l]) + uintptr_t(h) * size[l]) % 16 == 0;
    if (ok) return h;
  }
  return -1;
}

/// The work of thread `tid` of `nthreads` on chunk `c`: the op's fragments of Op::kUnroll
/// vectors of kVec elements from the tensor's first aligned element (vector k at k·nthreads·kVec
/// after the first, so every load instruction is coalesced across the warp), single vectors for
/// the rest, then the scalar head before the first vector and the tail after the last. Returns the
/// sum of what the op returned (reductions), in an order fixed by (c, tid) alone.
template <int L, typename Op>
GA_HD double chunk_thread(const Meta<L>& m, const Op& op, int64_t c, int tid, int nthreads,
                          ThreadState& st) {
  constexpr int U = Op::kUnroll;
  const int t = tensor_of(m, c);
  const int64_t begin = (c - m.start[t]) * kChunk;
  const int64_t end = begin + kChunk < m.numel[t] ? begin + kChunk : m.numel[t];
  const int h = m.head[t];
  const int64_t vec_begin = h < 0 ? begin : (begin + h < end ? begin + h : end);
  const int64_t vec_end = h < 0 ? begin : vec_begin + (end - vec_begin) / kVec * kVec;
  const int64_t step = static_cast<int64_t>(nthreads) * kVec;
  double acc = 0.0;
  int64_t i = vec_begin + static_cast<int64_t>(tid) * kVec;
  if constexpr (U > 1)
    for (; i + (U - 1) * step < vec_end; i += U * step)
      acc += op.template run<U, kVec>(m, t, i, step, st);
  for (; i < vec_end; i += step) acc += op.template run<1, kVec>(m, t, i, step, st);
  // The scalar head and tail in one loop (one copy of the scalar body: compile time).
  const int64_t nhead = vec_begin - begin, nscalar = nhead + (end - vec_end);
  for (int64_t q = tid; q < nscalar; q += nthreads)
    acc += op.template run<1, 1>(m, t, q < nhead ? begin + q : vec_end + (q - nhead), 0, st);
  return acc;
}

/// Σ of 32 lane values in the order of a __shfl_down_sync tree (lane 0's result), for the host.
inline double host_warp_tree(double* v) {
  for (int off = kWarp / 2; off > 0; off /= 2)
    for (int lane = 0; lane < off; ++lane) v[lane] += v[lane + off];
  return v[0];
}

/// Σ of kThreads thread values in the order of the device block reduction, for the host.
inline double host_block_tree(double* v) {
  double w[kWarp] = {};
  for (int k = 0; k < kThreads / kWarp; ++k) w[k] = host_warp_tree(v + k * kWarp);
  return host_warp_tree(w);
}

// ---- unit-wise sums of squares (AGC): one warp per task ----
//
// A task is one unit of a tensor with contiguous units (leading layout or one unit), the lanes
// striding over its elements; or 32 consecutive units of a tensor with strided (trailing) units,
// one lane per unit walking its elements in order.

/// Lane `lane`'s partial sums for task `task`: Σ x² of list 0 into s0 and of list 1 into s1
/// (when L == 2). For strided units the lane's values are the complete sums of its own unit.
template <int L, typename T0, typename T1>
GA_HD void unit_task_lane(const Meta<L>& m, int64_t task, int lane, double& s0, double& s1,
                          int& unit_out) {
  const int t = tensor_of(m, task);
  const int64_t local = task - m.start[t];
  const int64_t fan = m.fan_in[t];
  const T0* x0 = static_cast<const T0*>(m.ptr[0][t]);
  const T1* x1 = L > 1 ? static_cast<const T1*>(m.ptr[L > 1 ? 1 : 0][t]) : nullptr;
  s0 = 0.0;
  s1 = 0.0;
  if (!((m.trailing >> t) & 1u)) {
    const int64_t base = local * fan;
    unit_out = m.out_base[t] + static_cast<int>(local);
    // The unit's first aligned vector: the tensor's head moved to the unit's start.
    const int h = m.head[t] < 0 ? -1 : static_cast<int>(((m.head[t] - base) % kVec + kVec) % kVec);
    const int64_t vec_begin = h < 0 ? 0 : (h < fan ? h : fan);
    const int64_t vec_end = h < 0 ? 0 : vec_begin + (fan - vec_begin) / kVec * kVec;
    for (int64_t j = lane; j < vec_begin; j += kWarp) {
      const double u = to_f(x0[base + j]);
      s0 += u * u;
      if (L > 1) {
        const double v = to_f(x1[base + j]);
        s1 += v * v;
      }
    }
    float a[kVec], b[kVec];
    for (int64_t j = vec_begin + static_cast<int64_t>(lane) * kVec; j < vec_end;
         j += kWarp * kVec) {
      load<kVec>(x0 + base + j, a);
      if (L > 1) load<kVec>(x1 + base + j, b);
      for (int k = 0; k < kVec; ++k) {
        s0 += static_cast<double>(a[k]) * a[k];
        if (L > 1) s1 += static_cast<double>(b[k]) * b[k];
      }
    }
    for (int64_t j = vec_end + lane; j < fan; j += kWarp) {
      const double u = to_f(x0[base + j]);
      s0 += u * u;
      if (L > 1) {
        const double v = to_f(x1[base + j]);
        s1 += v * v;
      }
    }
  } else {
    const int64_t nu = m.num_units[t];
    const int64_t u = local * kWarp + lane;
    unit_out = u < nu ? m.out_base[t] + static_cast<int>(u) : -1;
    if (u >= nu) return;
    for (int64_t j = 0; j < fan; ++j) {
      const double a = to_f(x0[j * nu + u]);
      s0 += a * a;
      if (L > 1) {
        const double b = to_f(x1[j * nu + u]);
        s1 += b * b;
      }
    }
  }
}

}  // namespace cuda
}  // namespace ga

#endif  // GRADIENT_ACCUMULATOR_CUDA_DEVICE_COMMON_CUH_
