/* Apply op family: one fused pass per tensor at the end of a cycle —
 * scale → clip (global norm or AGC) → optimizer update → reset of the accumulator. */
#ifndef GRADIENT_ACCUMULATOR_APPLY_H_
#define GRADIENT_ACCUMULATOR_APPLY_H_

#include "gradient_accumulator/common.h"
#include "gradient_accumulator/norms.h"

#ifdef __cplusplus
extern "C" {
#endif

/** \brief Update rule of the fused apply. */
typedef enum ga_optimizer {
  /** No update: the final (scaled, clipped) gradient is written to `grads_out`, or in place. */
  kGaOptimizerNone = 0,
  /** torch.optim.SGD: momentum, dampening, Nesterov, L2 weight decay, maximize. */
  kGaOptimizerSGD = 1,
  /** torch.optim.Adam (amsgrad=False): L2 weight decay added to the gradient. */
  kGaOptimizerAdam = 2,
  /** torch.optim.AdamW (amsgrad=False): decoupled weight decay p ← p·(1 − lr·wd). */
  kGaOptimizerAdamW = 3,
} ga_optimizer;

/** \brief Clipping applied to the scaled gradient before the update. */
typedef enum ga_clip_mode {
  kGaClipNone = 0,
  /** g ← g · min(1, max_norm / (‖g‖₂ + 1e-6)) over all tensors of the call. */
  kGaClipGlobalNorm = 1,
  /** Adaptive gradient clipping per unit (see ga_adaptive_clip). */
  kGaClipAgc = 2,
} ga_clip_mode;

/** \brief Options of ga_apply. Zero-initialise, then set what is used. */
typedef struct ga_apply_options {
  double grad_scale; /**< gradient = accumulator · grad_scale (1/total weight · 1/loss scale) */
  ga_clip_mode clip;
  double max_norm;        /**< kGaClipGlobalNorm: > 0 */
  const float* clip_coef; /**< kGaClipGlobalNorm: precomputed coefficient in memory (overrides
                              max_norm; never read on the host for CUDA tensors) */
  double clip_factor;     /**< kGaClipAgc: λ > 0 */
  double agc_eps;         /**< kGaClipAgc: ε ≥ 0 */
  const ga_units*
      units;          /**< kGaClipAgc: one entry per tensor, or NULL for "every tensor is
                           kGaUnitsLeading with shape[0] units" — then `agc_num_units` holds them */
  int skip_nonfinite; /**< check the gradient first; if any element is NaN/Inf, update nothing */
  int reset;          /**< zero the accumulators in the same pass (also when skipped) */
  ga_optimizer optimizer;
  double lr;
  double weight_decay;
  int maximize; /**< descend on −gradient (torch's maximize=True) */
  /* SGD */
  double momentum;
  double dampening;
  int nesterov;
  int momentum_initialized; /**< 0 on the first step: buffer ← gradient (torch's convention) */
  /* Adam, AdamW */
  double beta1;
  double beta2;
  double adam_eps;
  int64_t step;                /**< optimizer step this update makes, ≥ 1 (bias correction) */
  float* const* step_counters; /**< Adam, AdamW: NULL, or one float32 per tensor holding the
                                    optimizer steps that tensor has made (torch's `step`), in the
                                    tensors' memory (device memory for ga_cuda_apply). `step` is
                                    then not read: tensor i's update makes step
                                    *step_counters[i] + 1, and its counter is advanced to it only
                                    when the update is applied (a skipped call leaves them all).
                                    Integral values in [0, 2^24), no two the same counter. */
  const float* skip_flag;      /**< NULL, or a float32 in the tensors' memory (device memory for
                                    ga_cuda_apply, read there): non-zero skips the update as a
                                    non-finite gradient would (nothing written but the reset of
                                    `reset`). ga_cuda_apply's own `skip_flag` may not be given too. */
} ga_apply_options;

/** \brief Tensors of ga_apply; lists that an optimizer does not use may be empty. */
typedef struct ga_apply_tensors {
  ga_tensor_list params;       /**< updated in place: fp32, bf16 or fp16 */
  ga_tensor_list accumulators; /**< fp32 accumulated gradients, one per param */
  ga_tensor_list state1;       /**< SGD momentum_buffer / Adam exp_avg: param dtype or fp32 */
  ga_tensor_list state2;       /**< Adam exp_avg_sq: param dtype or fp32 */
  ga_tensor_list grads_out;    /**< kGaOptimizerNone: destination of the final gradient (any
                                    float dtype); empty: written back into the accumulators */
} ga_apply_tensors;

/** \brief What ga_apply did. */
typedef struct ga_apply_result {
  int skipped;      /**< non-zero if a non-finite gradient stopped the update */
  double grad_norm; /**< ‖scaled gradient‖₂ before clipping, when it was computed; else −1 */
  double clip_coef; /**< global-norm coefficient used (1 when not clipped), −1 if not computed */
} ga_apply_result;

/**
 * \brief The end-of-cycle update, validated entirely before any write.
 *
 * Passes over memory: one fused pass per tensor, plus one read-only norm pass when global-norm
 * clipping computes its own coefficient or skip_nonfinite is set.
 */
GA_API ga_status ga_apply(const ga_apply_tensors* tensors, const ga_apply_options* options,
                          ga_apply_result* result);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* GRADIENT_ACCUMULATOR_APPLY_H_ */
