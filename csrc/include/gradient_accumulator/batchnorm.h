/* Batch-norm op family: per-channel moments, Chan's merge, once-per-cycle running statistics. */
#ifndef GRADIENT_ACCUMULATOR_BATCHNORM_H_
#define GRADIENT_ACCUMULATOR_BATCHNORM_H_

#include "gradient_accumulator/common.h"

#ifdef __cplusplus
extern "C" {
#endif

/**
 * \brief Per-channel mean and M2 = Σ(x − mean)² of x viewed as [outer, channels, inner]
 *        (NCHW: outer = N, inner = H·W; channels-last: outer = N·H·W, inner = 1).
 *
 * \param[in]  x      fp32, bf16, fp16 or fp64.
 * \param[out] mean   fp32 or fp64, `channels` elements.
 * \param[out] m2     same dtype as `mean`.
 */
GA_API ga_status ga_bn_moments(ga_tensor x, int64_t outer, int64_t channels, int64_t inner,
                               ga_tensor mean, ga_tensor m2);

/**
 * \brief (n_a, mean_a, M2_a) ← (n_a, mean_a, M2_a) ⊕ (n_b, mean_b, M2_b), Chan et al.'s
 *        parallel formula, per channel.
 *
 * \param[in,out] count_a  scalar count of the left side (≥ 0).
 * \param[in,out] mean_a, m2_a  fp32 or fp64, one value per channel.
 * \param[in]     count_b  count of the right side (≥ 0).
 * \param[in]     mean_b, m2_b  same shape and dtype as the left side.
 */
GA_API ga_status ga_bn_merge(double* count_a, ga_tensor mean_a, ga_tensor m2_a, double count_b,
                             ga_tensor mean_b, ga_tensor m2_b);

/**
 * \brief running ← (1 − new_weight)·running + new_weight·batch, with batch variance
 *        M2/(n − 1) if `unbiased` (PyTorch) or M2/n (Keras).
 *
 * PyTorch's `momentum` is `new_weight`; Keras's `momentum` is 1 − `new_weight`.
 */
GA_API ga_status ga_bn_update_running(ga_tensor running_mean, ga_tensor running_var, ga_tensor mean,
                                      ga_tensor m2, double count, double new_weight, int unbiased);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* GRADIENT_ACCUMULATOR_BATCHNORM_H_ */
