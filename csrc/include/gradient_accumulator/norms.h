/* Norms op family: global L2 norm of a tensor list, unit-wise norms, adaptive gradient clipping. */
#ifndef GRADIENT_ACCUMULATOR_NORMS_H_
#define GRADIENT_ACCUMULATOR_NORMS_H_

#include "gradient_accumulator/common.h"

#ifdef __cplusplus
extern "C" {
#endif

/**
 * \brief How a tensor splits into the units AGC clips separately.
 *
 * A tensor of `numel` elements holds `num_units` units of `numel / num_units` elements each.
 * kGaUnitsLeading: unit u is the contiguous run [u·fan_in, (u+1)·fan_in) — PyTorch's
 * (out, in, kh, kw) weights. kGaUnitsTrailing: unit u is the strided set {j·num_units + u} —
 * Keras's (kh, kw, in, out) weights. A tensor with num_units == 1 is one unit (biases, gains).
 */
typedef enum ga_unit_layout {
  kGaUnitsLeading = 0,
  kGaUnitsTrailing = 1,
} ga_unit_layout;

/** \brief Unit structure of one tensor. */
typedef struct ga_units {
  int64_t num_units; /**< ≥ 1 and divides the tensor's numel (any value for an empty tensor) */
  ga_unit_layout layout;
} ga_units;

/**
 * \brief Σ x² over every element of every tensor, accumulated in fp64 in a fixed order
 *        (independent of the thread count), optionally times scale².
 *
 * \param[in]  tensors fp32, bf16, fp16 or fp64 tensors.
 * \param[out] sumsq   the sum of squares; NaN/Inf if any element is not finite.
 */
GA_API ga_status ga_sum_of_squares(ga_tensor_list tensors, double* sumsq);

/**
 * \brief Per-unit L2 norms of one tensor.
 *
 * \param[in]  tensor fp32, bf16, fp16 or fp64.
 * \param[in]  units  its unit structure.
 * \param[out] norms  fp32 CPU tensor of `units.num_units` elements.
 */
GA_API ga_status ga_unitwise_norm(ga_tensor tensor, ga_units units, ga_tensor norms);

/**
 * \brief Adaptive gradient clipping (NFNets) in place:
 *        g_u ← g_u · min(1, λ·max(‖w_u‖, ε) / max(‖g_u‖, 1e-6)) for every unit u.
 *
 * \param[in]     params   parameters (fp32, bf16 or fp16).
 * \param[in,out] grads    gradients (fp32), same numels as `params`, disjoint from them.
 * \param[in]     units    one entry per tensor.
 * \param[in]     clip_factor λ > 0.
 * \param[in]     eps      ε ≥ 0.
 */
GA_API ga_status ga_adaptive_clip(ga_tensor_list params, ga_tensor_list grads,
                                  const ga_units* units, double clip_factor, double eps);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* GRADIENT_ACCUMULATOR_NORMS_H_ */
