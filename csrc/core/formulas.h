// The arithmetic the CPU core and the CUDA kernels share, written once: the fp16/bf16 conversions,
// the global-norm and AGC clip coefficients, Chan's merge of batch moments, the running-statistics
// update and the fused apply's optimizer scalars. The CPU kernels (once per instruction set), the
// CUDA kernels and their host emulation all include this header, so each formula changes in one
// place and the emulated CUDA tests check the same code the CPU tests do.
//
// Functions are static: the CPU kernels are compiled once per instruction set (AVX-512, AVX2,
// baseline), and an external inline definition could be merged by the linker with the copy
// compiled for a wider ISA than the running machine has.
#ifndef GRADIENT_ACCUMULATOR_CORE_FORMULAS_H_
#define GRADIENT_ACCUMULATOR_CORE_FORMULAS_H_

#include <cmath>
#include <cstdint>
#include <cstring>

#include "gradient_accumulator/gradient_accumulator.h"

#if defined(__CUDACC__)
#define GA_FORMULA static __host__ __device__ __forceinline__
#else
#define GA_FORMULA static inline
#endif

namespace ga {
namespace formulas {

// ---- bit casts and 16-bit float conversions (round to nearest even, NaN kept quiet) ----

GA_FORMULA float bits_to_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

GA_FORMULA uint32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

/// bf16 → fp32 is exact: the bf16 bits are the upper half of the fp32 bits.
GA_FORMULA float bf16_to_float(uint16_t b) { return bits_to_float(static_cast<uint32_t>(b) << 16); }

/// fp16 → fp32, exact for normals, subnormals, zeros, Inf and NaN: the 15 magnitude bits are read
/// as an fp32 with a shifted exponent, then rescaled by 2^112.
GA_FORMULA float half_to_float(uint16_t h) {
  const uint32_t sign = (static_cast<uint32_t>(h) & 0x8000u) << 16;
  const uint32_t mag = h & 0x7fffu;
  const float f = mag >= 0x7c00u ? bits_to_float(0x7f800000u | ((mag & 0x3ffu) << 13))
                                 : bits_to_float(mag << 13) * 5.192296858534828e+33f;
  return bits_to_float(float_to_bits(f) | sign);
}

/// fp32 → bf16. Both results are computed and one selected (no branch), so loops vectorise.
GA_FORMULA uint16_t float_to_bf16(float x) {
  const uint32_t u = float_to_bits(x);
  const uint32_t quiet_nan = (u >> 16) | 0x40u;
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

/// fp32 → fp16; values from 65520 up round to Inf.
GA_FORMULA uint16_t float_to_half(float x) {
  const uint32_t u = float_to_bits(x);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t mag = u & 0x7fffffffu;
  uint32_t out;
  if (mag > 0x7f800000u) {
    out = 0x7e00u | ((mag >> 13) & 0x3ffu);  // NaN, quiet
  } else if (mag >= 0x477ff000u) {
    out = 0x7c00u;
  } else if (mag < 0x38800000u) {
    // Subnormal or zero in fp16: adding 0.5 (2^-1, whose ulp is 2^-24) lets the FPU round.
    out = float_to_bits(bits_to_float(mag) + 0.5f) - 0x3f000000u;
  } else {
    // Normal: rebias the exponent (127 → 15), round the mantissa to 10 bits, ties to even.
    out = (mag + 0xc8000fffu + ((mag >> 13) & 1u)) >> 13;
  }
  return static_cast<uint16_t>(out | sign);
}

// ---- clipping ----

/// Global-norm clip coefficient: min(1, max_norm / (‖g‖ + 1e-6)); a NaN norm gives 1.
GA_FORMULA double global_clip_coef(double norm, double max_norm) {
  const double c = max_norm / (norm + 1e-6);
  return c < 1.0 ? c : 1.0;
}

/// AGC coefficient of one unit: λ·max(‖w_u‖, ε) / max(‖g_u‖, 1e-6) where ‖g_u‖ exceeds
/// λ·max(‖w_u‖, ε), else 1.
GA_FORMULA double agc_unit_coef(double w_norm, double g_norm, double clip_factor, double eps) {
  const double max_norm = (w_norm < eps ? eps : w_norm) * clip_factor;
  return g_norm > max_norm ? max_norm / (g_norm < 1e-6 ? 1e-6 : g_norm) : 1.0;
}

// ---- batch-norm statistics ----

struct Moments {
  double mean, m2;
};

/// Chan et al.: (n_a, mean_a, M2_a) ⊕ (n_b, mean_b, M2_b) with n = n_a + n_b > 0:
/// mean = mean_a + δ·n_b/n, M2 = M2_a + M2_b + δ²·n_a·n_b/n, δ = mean_b − mean_a.
GA_FORMULA Moments chan_merge(double n_a, double mean_a, double m2_a, double n_b, double mean_b,
                              double m2_b) {
  const double n = n_a + n_b;
  const double delta = mean_b - mean_a;
  return {mean_a + delta * (n_b / n), m2_a + m2_b + delta * delta * (n_a * n_b / n)};
}

/// One step of a running statistic: (1 − w)·running + w·batch.
GA_FORMULA double running_update(double running, double batch, double w) {
  return (1 - w) * running + w * batch;
}

// ---- the fused apply's optimizer scalars ----

/// Per-call scalars of the optimizer update in the compute type C (float for fp32 accumulators,
/// double for fp64 ones), rounded once on the host so every backend uses identical values.
template <typename C>
struct OptimizerScalars {
  C lr, wd, momentum, one_minus_dampening, beta1c, beta2, one_minus_beta2, adam_eps, step_size,
      bc2_sqrt, adamw_decay;
  bool nesterov, maximize, first_momentum, reset, has_wd, has_momentum;
};

template <typename C>
static inline OptimizerScalars<C> optimizer_scalars(const ga_apply_options& o) {
  OptimizerScalars<C> k{};
  k.lr = static_cast<C>(o.lr);
  k.wd = static_cast<C>(o.weight_decay);
  k.has_wd = o.weight_decay != 0.0;
  k.maximize = o.maximize != 0;
  k.reset = o.reset != 0;
  k.momentum = static_cast<C>(o.momentum);
  k.has_momentum = o.momentum != 0.0;
  k.one_minus_dampening = static_cast<C>(1.0 - o.dampening);
  k.nesterov = o.nesterov != 0;
  k.first_momentum = o.momentum_initialized == 0;
  if (o.optimizer == kGaOptimizerAdam || o.optimizer == kGaOptimizerAdamW) {
    const double step = static_cast<double>(o.step);
    const double bc1 = 1.0 - std::pow(o.beta1, step);
    const double bc2 = 1.0 - std::pow(o.beta2, step);
    k.beta1c = static_cast<C>(1.0 - o.beta1);
    k.beta2 = static_cast<C>(o.beta2);
    k.one_minus_beta2 = static_cast<C>(1.0 - o.beta2);
    k.adam_eps = static_cast<C>(o.adam_eps);
    k.step_size = static_cast<C>(o.lr / bc1);
    k.bc2_sqrt = static_cast<C>(std::sqrt(bc2));
    k.adamw_decay = static_cast<C>(1.0 - o.lr * o.weight_decay);
  }
  return k;
}

}  // namespace formulas
}  // namespace ga

#endif  // GRADIENT_ACCUMULATOR_CORE_FORMULAS_H_
