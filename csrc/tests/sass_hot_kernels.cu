// The hot kernels of the CUDA build, instantiated alone for tests/test_cuda_sass.py: that test
// compiles this file for sm_90 (`nvcc -cubin`, seconds instead of the minutes of the whole
// build), reads the machine code back and checks that the kernels use 128-bit global loads and
// stores and spill no registers. The instantiations are those the library launches (launch.cuh
// and ops.h, unchanged), so what is checked here is what ships.
#include "../cuda/launch.cuh"

namespace ga {
namespace cuda {
namespace {

// accumulate: bf16 → fp32 and fp32 → fp32 (sums of squares off and on)
template __global__ void chunk_kernel<false, 2, AccumulateOp<bf16>>(const Meta<2>,
                                                                    const AccumulateOp<bf16>,
                                                                    int64_t, double*, float*);
template __global__ void chunk_kernel<false, 2, AccumulateOp<float>>(const Meta<2>,
                                                                     const AccumulateOp<float>,
                                                                     int64_t, double*, float*);
template __global__ void chunk_kernel<true, 2, AccumulateOp<bf16>>(const Meta<2>,
                                                                   const AccumulateOp<bf16>,
                                                                   int64_t, double*, float*);
// global norm: Σ x² of fp32 accumulators
template __global__ void chunk_kernel<true, 1, SumsqOp<float>>(const Meta<1>, const SumsqOp<float>,
                                                               int64_t, double*, float*);
// fused apply: ÷k + clip + optimizer + zero, fp32 parameters and state
using SgdMomentum = ApplyOp<Opt::kSGD, true, true, false, float, float, float>;
using AdamFp32 = ApplyOp<Opt::kAdam, false, true, false, float, float, float>;
using AdamWFp32 = ApplyOp<Opt::kAdamW, false, true, false, float, float, float>;
using AdamWBf16 = ApplyOp<Opt::kAdamW, false, true, false, bf16, float, float>;
template __global__ void chunk_kernel<false, 5, SgdMomentum>(const Meta<5>, const SgdMomentum,
                                                             int64_t, double*, float*);
template __global__ void chunk_kernel<false, 5, AdamFp32>(const Meta<5>, const AdamFp32, int64_t,
                                                          double*, float*);
template __global__ void chunk_kernel<false, 5, AdamWFp32>(const Meta<5>, const AdamWFp32, int64_t,
                                                           double*, float*);
template __global__ void chunk_kernel<false, 5, AdamWBf16>(const Meta<5>, const AdamWBf16, int64_t,
                                                           double*, float*);
// AGC (adaptive_clip): unit sums of parameters and gradients, then the in-place clip
using AgcClip = ApplyOp<Opt::kNone, false, false, true, float, float, float>;
template __global__ void unit_kernel<2, float, float>(const Meta<2>, int64_t, double*, double*);
template __global__ void chunk_kernel<false, 5, AgcClip>(const Meta<5>, const AgcClip, int64_t,
                                                         double*, float*);

}  // namespace
}  // namespace cuda
}  // namespace ga
