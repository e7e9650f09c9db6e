/* Reduce op family: pack accumulators into one flat bucket for a single collective, and back. */
#ifndef GRADIENT_ACCUMULATOR_REDUCE_H_
#define GRADIENT_ACCUMULATOR_REDUCE_H_

#include "gradient_accumulator/common.h"

#ifdef __cplusplus
extern "C" {
#endif

/**
 * \brief flat[o_i : o_i + n_i] ← scale · src_i, tensors laid end to end (o_0 = 0).
 *
 * \param[in]  src   fp32, bf16, fp16 or fp64 tensors.
 * \param[out] flat  fp32, bf16, fp16 or fp64; numel ≥ Σ n_i; disjoint from `src`.
 */
GA_API ga_status ga_pack(ga_tensor_list src, ga_tensor flat, double scale);

/** \brief dst_i ← scale · flat[o_i : o_i + n_i], the inverse of ga_pack. */
GA_API ga_status ga_unpack(ga_tensor flat, ga_tensor_list dst, double scale);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* GRADIENT_ACCUMULATOR_REDUCE_H_ */
