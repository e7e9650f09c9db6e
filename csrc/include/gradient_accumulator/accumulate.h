/* Accumulate op family: fold one micro-batch's gradients into fp32 accumulators. */
#ifndef GRADIENT_ACCUMULATOR_ACCUMULATE_H_
#define GRADIENT_ACCUMULATOR_ACCUMULATE_H_

#include "gradient_accumulator/common.h"

#ifdef __cplusplus
extern "C" {
#endif

/** \brief How successive micro-batches are combined in the accumulator. */
typedef enum ga_accumulate_mode {
  /** acc ← acc + w·g. The apply divides by the total weight ("mean") or not ("sum"). */
  kGaAccumulateSum = 0,
  /** acc ← acc·W/(W+w) + g·w/(W+w): the accumulator always holds the weighted mean so far. */
  kGaAccumulateRunningMean = 1,
} ga_accumulate_mode;

/** \brief Options of ga_accumulate. */
typedef struct ga_accumulate_options {
  ga_accumulate_mode mode;
  double weight;        /**< w: weight of this micro-batch (samples, tokens, or 1); finite, ≥ 0 */
  double weight_before; /**< W: total weight already in the accumulators (running mean only) */
  int overwrite;        /**< non-zero on a cycle's first micro-step: acc ← w·g, no read of acc */
} ga_accumulate_options;

/** \brief What ga_accumulate observed in the same pass. */
typedef struct ga_accumulate_result {
  int nonfinite; /**< non-zero if any gradient element was NaN or ±Inf */
  double sumsq;  /**< Σ acc² after the update (when requested), deterministic order */
} ga_accumulate_result;

/**
 * \brief acc[i] ← combine(acc[i], grads[i]) for every pair of the two lists, in one pass.
 *
 * \param[in,out] accumulators fp32 tensors, pairwise disjoint and disjoint from `grads`.
 * \param[in]     grads        fp32, bf16 or fp16 tensors, same element counts as `accumulators`.
 * \param[in]     options      mode, weight, first-step overwrite.
 * \param[in]     want_sumsq   non-zero to compute Σ acc² of the result in the same pass.
 * \param[out]    result       may be NULL.
 * \return kGaOk, or an error with nothing written.
 */
GA_API ga_status ga_accumulate(ga_tensor_list accumulators, ga_tensor_list grads,
                               const ga_accumulate_options* options, int want_sumsq,
                               ga_accumulate_result* result);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* GRADIENT_ACCUMULATOR_ACCUMULATE_H_ */
