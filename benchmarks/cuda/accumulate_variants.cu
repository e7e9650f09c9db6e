// Where the chunked kernels lose against their floor, on the GPU alone (no Python, no torch):
// the library's kernels (launch.cuh's chunk_kernel over ops.h's functors, unchanged) launched as
// the library launches them and under other grids, beside hand-written kernels that move the
// accumulate's bytes in other ways, and beside the copies the floor is measured with. One
// compile per (chunk, accumulate unroll) pair, chosen with -DGA_CUDA_CHUNK and
// -DGA_CUDA_ACCUMULATE_UNROLL; tools/gpu_accumulate_variants.sh builds the pairs in parallel and
// runs them.
//
// Ops, over one flat tensor, with bytes per element as benchmarks/gpu_profile.py counts them:
//   accumulate  acc (fp32) += g (bf16): read g 2, read acc 4, write acc 4 — 10 B;
//   sumsq       Σ acc² (fp32), one fp64 partial per chunk: read 4 B;
//   adamw       the fused apply's pass (AdamW, reset): read acc, p, m, v, write p, m, v, acc — 32
//   B.
// Floor: bytes × n ÷ the device-to-device copy bandwidth (bytes read + written, a 1 GiB
// cudaMemcpyAsync), as there. Time: CUDA events around each launch, median of the repeats, after
// warm-up. The accumulate variants are checked against the exact answer before they are timed,
// and the sum-of-squares partials of every grid against those of the library's launch.
//
// Usage: accumulate_variants [--repeats R] [--ncu]
//   --ncu  run the library's accumulate launch once per shape and nothing else (Nsight Compute)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "../../csrc/cuda/launch.cuh"

// launch.cuh declares these; the library defines them in backend.cu. This program needs only
// the error check and the SM count.
namespace ga {
namespace cuda {
void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "CUDA error in %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}
int sm_count(int device) {
  int sms = 0;
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "sm count");
  return sms;
}
}  // namespace cuda
}  // namespace ga

namespace {

using ga::cuda::AccumulateOp;
using ga::cuda::bf16;
using ga::cuda::check;
using ga::cuda::chunk_kernel;
using ga::cuda::kChunk;
using ga::cuda::kThreads;
using ga::cuda::Meta;

using Op = AccumulateOp<bf16>;
using Sumsq = ga::cuda::SumsqOp<float>;
using AdamW = ga::cuda::ApplyOp<ga::cuda::Opt::kAdamW, false, true, false, float, float, float>;
constexpr auto kLibraryKernel = chunk_kernel<false, 2, Op>;

// ---- data ----

__device__ __forceinline__ uint32_t mix(uint64_t i) {
  uint64_t x = i * 0x9E3779B97F4A7C15ull;
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  return static_cast<uint32_t>(x);
}

/// g[i]: a bf16 in [-2, 2) that depends on i only (exact in fp32, so acc = 0 + g is exact).
__global__ void fill_grad(uint16_t* g, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float v = (static_cast<float>(mix(i) >> 8) / 16777216.0f) * 4.0f - 2.0f;
    g[i] = __bfloat16_as_ushort(__float2bfloat16_rn(v));
  }
}

/// Count of i with acc[i] != float(g[i]) · times (the answer after `times` accumulations into 0).
__global__ void count_wrong(const float* acc, const uint16_t* g, int64_t n, float times,
                            unsigned long long* wrong) {
  unsigned long long local = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    local += acc[i] != __bfloat162float(__ushort_as_bfloat16(g[i])) * times;
  if (local) atomicAdd(wrong, local);
}

// ---- hand-written kernels that move the same bytes ----

__device__ __forceinline__ void bf16x8_to_float(const uint4& w, float* v) {
  const uint32_t x[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    v[2 * k] = __uint_as_float(x[k] << 16);
    v[2 * k + 1] = __uint_as_float(x[k] & 0xffff0000u);
  }
}

/// One thread per 8 elements, one block per 256 × 8 elements, no loop: the textbook form.
/// Stream: cache-streaming loads and stores (__ldcs/__stcs, as the library), else plain ones.
template <bool Stream>
__global__ void __launch_bounds__(256)
    flat_accumulate(float* acc, const uint16_t* g, int64_t nvec) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= nvec) return;
  const uint4* gp = reinterpret_cast<const uint4*>(g) + i;
  float4* ap = reinterpret_cast<float4*>(acc) + 2 * i;
  const uint4 gw = Stream ? __ldcs(gp) : *gp;
  float4 a0 = Stream ? __ldcs(ap) : ap[0];
  float4 a1 = Stream ? __ldcs(ap + 1) : ap[1];
  float v[8];
  bf16x8_to_float(gw, v);
  a0.x += v[0], a0.y += v[1], a0.z += v[2], a0.w += v[3];
  a1.x += v[4], a1.y += v[5], a1.z += v[6], a1.w += v[7];
  if (Stream) {
    __stcs(ap, a0);
    __stcs(ap + 1, a1);
  } else {
    ap[0] = a0;
    ap[1] = a1;
  }
}

/// The same bytes, written to another array (out = acc + g): is read-modify-write in place the
/// cost?
__global__ void __launch_bounds__(256)
    flat_triad(float* out, const float* acc, const uint16_t* g, int64_t nvec) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= nvec) return;
  const uint4 gw = reinterpret_cast<const uint4*>(g)[i];
  float4 a0 = reinterpret_cast<const float4*>(acc)[2 * i];
  float4 a1 = reinterpret_cast<const float4*>(acc)[2 * i + 1];
  float v[8];
  bf16x8_to_float(gw, v);
  a0.x += v[0], a0.y += v[1], a0.z += v[2], a0.w += v[3];
  a1.x += v[4], a1.y += v[5], a1.z += v[6], a1.w += v[7];
  reinterpret_cast<float4*>(out)[2 * i] = a0;
  reinterpret_cast<float4*>(out)[2 * i + 1] = a1;
}

/// 16-byte copy, one thread per vector.
__global__ void __launch_bounds__(256) copy16(uint4* dst, const uint4* src, int64_t nvec) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i < nvec) dst[i] = src[i];
}

// ---- timing ----

float median_ms(const std::function<void()>& launch, int repeats) {
  for (int w = 0; w < 3; ++w) launch();
  std::vector<cudaEvent_t> ev(2 * repeats);
  for (auto& e : ev) check(cudaEventCreate(&e), "event");
  for (int r = 0; r < repeats; ++r) {
    check(cudaEventRecord(ev[2 * r]), "record");
    launch();
    check(cudaEventRecord(ev[2 * r + 1]), "record");
  }
  check(cudaEventSynchronize(ev.back()), "sync");
  check(cudaGetLastError(), "launch");
  std::vector<float> ms(repeats);
  for (int r = 0; r < repeats; ++r)
    check(cudaEventElapsedTime(&ms[r], ev[2 * r], ev[2 * r + 1]), "elapsed");
  for (auto& e : ev) cudaEventDestroy(e);
  std::sort(ms.begin(), ms.end());
  return ms[repeats / 2];
}

/// Launch metadata of one flat tensor of n elements in L lists (`size`: bytes per element).
template <int L>
Meta<L> flat_meta(void* const (&ptr)[L], const int (&size)[L], int64_t n, int64_t* chunks) {
  Meta<L> m{};
  m.num_tensors = 1;
  const void* p[L];
  for (int l = 0; l < L; ++l) {
    m.ptr[l][0] = ptr[l];
    p[l] = ptr[l];
  }
  m.numel[0] = n;
  m.head[0] = static_cast<int8_t>(ga::cuda::vec_head(p, size, L));
  *chunks = (n + kChunk - 1) / kChunk;
  m.start[0] = 0;
  m.start[1] = static_cast<int32_t>(*chunks);
  return m;
}

template <bool Reduce, int L, typename F>
int resident_per_sm() {
  int per_sm = 0;
  check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, chunk_kernel<Reduce, L, F>, kThreads,
                                                      0),
        "occupancy");
  return std::max(per_sm, 1);
}

/// The grids a chunked kernel is timed under: the library's (chunk_blocks), then the others.
template <bool Reduce, int L, typename F>
std::vector<std::pair<std::string, int>> grids(int64_t chunks, int sms) {
  const int per_sm = resident_per_sm<Reduce, L, F>();
  const char* const policy[] = {"resident grid", "one block per chunk", "two blocks per SM"};
  const auto n = static_cast<int>(chunks);
  return {
      {std::string("library's launch (") + policy[static_cast<int>(ga::cuda::grid_of<F>::value)] +
           ")",
       ga::cuda::chunk_blocks<F>(chunks, sms, per_sm)},
      {"resident grid (" + std::to_string(per_sm) + " blocks/SM)", std::min(n, sms * per_sm)},
      {"one block per chunk", n},
      {"1 block per SM", std::min(n, sms)},
      {"2 blocks per SM", std::min(n, 2 * sms)},
  };
}

}  // namespace

int main(int argc, char** argv) {
  int repeats = 30;
  bool ncu = false;
  for (int a = 1; a < argc; ++a) {
    if (!std::strcmp(argv[a], "--repeats") && a + 1 < argc) {
      repeats = std::atoi(argv[++a]);
    } else if (!std::strcmp(argv[a], "--ncu")) {
      ncu = true;
    } else {
      std::fprintf(stderr, "usage: %s [--repeats R] [--ncu]\n", argv[0]);
      return 2;
    }
  }
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "properties");
  const int sms = prop.multiProcessorCount;
  cudaFuncAttributes attr{};
  check(cudaFuncGetAttributes(&attr, kLibraryKernel), "attributes");
  const int per_sm = resident_per_sm<false, 2, Op>();  // kLibraryKernel's
  std::printf("%s, %d SMs; library kernel: chunk %lld, unroll %d, %d registers, %d blocks/SM\n",
              prop.name, sms, static_cast<long long>(kChunk), Op::kUnroll, attr.numRegs, per_sm);

  const int64_t shapes[2] = {124439808, 1019137280};  // gpu_profile.py's 124M and 1B totals
  const int64_t n_max = shapes[1];
  float *acc = nullptr, *out = nullptr, *p = nullptr, *m1 = nullptr, *m2 = nullptr;
  double* partials = nullptr;
  double* partials_ref = nullptr;
  uint16_t* g = nullptr;
  unsigned long long* wrong = nullptr;
  float* flag = nullptr;
  const int64_t max_chunks = (n_max + kChunk - 1) / kChunk;
  check(cudaMalloc(&acc, n_max * 4), "malloc acc");
  check(cudaMalloc(&g, n_max * 2), "malloc g");
  check(cudaMalloc(&wrong, sizeof(*wrong)), "malloc wrong");
  check(cudaMalloc(&flag, sizeof(float)), "malloc flag");
  if (!ncu) {
    check(cudaMalloc(&out, n_max * 4), "malloc out");
    check(cudaMalloc(&p, n_max * 4), "malloc p");
    check(cudaMalloc(&m1, n_max * 4), "malloc m");
    check(cudaMalloc(&m2, n_max * 4), "malloc v");
    check(cudaMalloc(&partials, max_chunks * 8), "malloc partials");
    check(cudaMalloc(&partials_ref, max_chunks * 8), "malloc partials");
    check(cudaMemset(p, 0, n_max * 4), "memset");
    check(cudaMemset(m1, 0, n_max * 4), "memset");
    check(cudaMemset(m2, 0, n_max * 4), "memset");
  }
  fill_grad<<<sms * 8, 256>>>(g, n_max);
  check(cudaMemset(flag, 0, sizeof(float)), "memset");
  const Op op{1.0f, 1.0f, 0, 0};
  AdamW adamw{};
  adamw.k.lr = 1e-4f;
  adamw.k.beta1c = 0.1f;
  adamw.k.beta2 = 0.999f;
  adamw.k.one_minus_beta2 = 0.001f;
  adamw.k.adam_eps = 1e-8f;
  adamw.k.step_size = 1e-4f;
  adamw.k.bc2_sqrt = 1.0f;
  adamw.k.adamw_decay = 1.0f;
  adamw.k.grad_scale = 0.125;

  double bw = 0.0;
  if (!ncu) {  // the floor's copy: 1 GiB device to device, as gpu_profile.py
    const size_t copy_bytes = size_t(1) << 30;
    const float copy_ms = median_ms(
        [&] { check(cudaMemcpyAsync(out, acc, copy_bytes, cudaMemcpyDeviceToDevice), "copy"); },
        repeats);
    bw = 2.0 * copy_bytes / (copy_ms * 1e-3);
    std::printf("copy bandwidth (read + write, cudaMemcpyAsync 1 GiB): %.2f TB/s\n", bw / 1e12);
  }
  auto row = [&](const std::string& op_name, const std::string& name, double bytes, int64_t n,
                 const std::function<void()>& launch) {
    const float ms = median_ms(launch, repeats);
    const double floor_ms = bytes * n / bw * 1e3;
    std::printf("%-11s %-58s %9.3f %8.2f %8.2f\n", op_name.c_str(), name.c_str(), ms, ms / floor_ms,
                bytes * n / (ms * 1e-3) / 1e12);
  };

  for (int64_t n : shapes) {
    int64_t chunks = 0;
    void* const acc_lists[2] = {acc, g};
    const Meta<2> m = flat_meta<2>(acc_lists, {4, 2}, n, &chunks);
    const int64_t nvec = n / 8;  // both shapes are multiples of 8
    const int flat_blocks = static_cast<int>((nvec + 255) / 256);
    if (ncu) {
      const int blocks = ga::cuda::chunk_blocks<Op>(chunks, sms, resident_per_sm<false, 2, Op>());
      kLibraryKernel<<<blocks, kThreads>>>(m, op, chunks, nullptr, flag);
      check(cudaDeviceSynchronize(), "sync");
      continue;
    }
    std::printf("\n== %lld elements, %lld chunks ==\n%-11s %-58s %9s %8s %8s\n",
                static_cast<long long>(n), static_cast<long long>(chunks), "op", "variant", "ms",
                "x floor", "TB/s");
    // accumulate: the library kernel under each grid, checked (two accumulations into zeros give
    // 2·g exactly), then the hand-written references
    for (const auto& [name, blocks] : grids<false, 2, Op>(chunks, sms)) {
      const auto launch = [&, b = blocks] {
        kLibraryKernel<<<b, kThreads>>>(m, op, chunks, nullptr, flag);
      };
      check(cudaMemset(acc, 0, n * 4), "memset");
      launch();
      launch();
      check(cudaMemset(wrong, 0, sizeof(*wrong)), "memset");
      count_wrong<<<sms * 8, 256>>>(acc, g, n, 2.0f, wrong);
      unsigned long long bad = 0;
      check(cudaMemcpy(&bad, wrong, sizeof(bad), cudaMemcpyDeviceToHost), "copy back");
      if (bad != 0) {
        std::printf("accumulate  %-58s WRONG: %llu elements differ\n", name.c_str(), bad);
        return 1;
      }
      row("accumulate", name, 10.0, n, launch);
    }
    row("accumulate", "flat kernel, one thread per 8, streaming (.cs) loads/stores", 10.0, n,
        [&] { flat_accumulate<true><<<flat_blocks, 256>>>(acc, g, nvec); });
    row("accumulate", "flat kernel, one thread per 8, plain loads/stores", 10.0, n,
        [&] { flat_accumulate<false><<<flat_blocks, 256>>>(acc, g, nvec); });
    row("accumulate", "flat triad out = acc + g (same bytes, not in place)", 10.0, n,
        [&] { flat_triad<<<flat_blocks, 256>>>(out, acc, g, nvec); });
    const int64_t cvec = n * 4 / 16;  // copy acc to out: 4 bytes read, 4 written per element
    row("copy", "copy kernel, 16 B per thread (8 B/element)", 8.0, n, [&] {
      copy16<<<(cvec + 255) / 256, 256>>>(reinterpret_cast<uint4*>(out),
                                          reinterpret_cast<const uint4*>(acc), cvec);
    });
    // sum of squares of the fp32 accumulators; every grid's partials equal the library's
    void* const sq_lists[1] = {acc};
    const Meta<1> ms = flat_meta<1>(sq_lists, {4}, n, &chunks);
    bool first = true;
    for (const auto& [name, blocks] : grids<true, 1, Sumsq>(chunks, sms)) {
      const auto launch = [&, b = blocks] {
        chunk_kernel<true, 1, Sumsq><<<b, kThreads>>>(ms, Sumsq{}, chunks, partials, nullptr);
      };
      launch();
      check(cudaDeviceSynchronize(), "sync");
      if (first) {
        check(cudaMemcpy(partials_ref, partials, chunks * 8, cudaMemcpyDeviceToDevice), "copy");
        first = false;
      } else {
        std::vector<double> a(chunks), b(chunks);
        check(cudaMemcpy(a.data(), partials, chunks * 8, cudaMemcpyDeviceToHost), "copy back");
        check(cudaMemcpy(b.data(), partials_ref, chunks * 8, cudaMemcpyDeviceToHost), "copy back");
        if (std::memcmp(a.data(), b.data(), chunks * 8) != 0) {
          std::printf("sumsq       %-58s WRONG: partials differ\n", name.c_str());
          return 1;
        }
      }
      row("sumsq", name, 4.0, n, launch);
    }
    // the fused AdamW pass (clip coefficient and skip flags absent: scale by grad_scale only)
    void* const ap_lists[5] = {p, acc, m1, m2, nullptr};
    const Meta<5> ma = flat_meta<5>(ap_lists, {4, 4, 4, 4, 4}, n, &chunks);
    for (const auto& [name, blocks] : grids<false, 5, AdamW>(chunks, sms))
      row("adamw", name, 32.0, n, [&, b = blocks] {
        chunk_kernel<false, 5, AdamW><<<b, kThreads>>>(ma, adamw, chunks, nullptr, nullptr);
      });
  }
  check(cudaDeviceSynchronize(), "sync");
  return 0;
}
