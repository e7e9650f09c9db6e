/* Buffers op family: the accumulator arena's layout — one fp32 buffer per device (allocated by
 * the framework), tensors laid out in backward order and split into buckets — and ga_zero. */
#ifndef GRADIENT_ACCUMULATOR_BUFFERS_H_
#define GRADIENT_ACCUMULATOR_BUFFERS_H_

#include "gradient_accumulator/common.h"

#ifdef __cplusplus
extern "C" {
#endif

/** \brief Layout request for ga_arena_plan. */
typedef struct ga_arena_plan_options {
  int64_t alignment;    /**< start of every tensor, in elements (power of two, ≥ 1); 16 = 64 B */
  int64_t bucket_numel; /**< a bucket is closed once it holds at least this many elements (> 0) */
  int reverse;          /**< non-zero: lay tensors out last-first, the order backward makes them */
} ga_arena_plan_options;

/**
 * \brief Plan the arena: an offset for every tensor and bucket boundaries.
 *
 * \param[in]  numels       `n` element counts (≥ 0), in registration (forward) order.
 * \param[out] offsets      `n` offsets (elements) into the arena, indexed like `numels`.
 * \param[out] bucket_of    `n` bucket indices, indexed like `numels`.
 * \param[out] bucket_start `n + 1` entries; bucket b spans [bucket_start[b], bucket_start[b+1]).
 * \param[out] num_buckets  number of buckets.
 * \param[out] total_numel  arena size in elements (a multiple of the alignment).
 */
GA_API ga_status ga_arena_plan(const int64_t* numels, int64_t n,
                               const ga_arena_plan_options* options, int64_t* offsets,
                               int64_t* bucket_of, int64_t* bucket_start, int64_t* num_buckets,
                               int64_t* total_numel);

/** \brief Set `tensors` to zero (fp32, bf16, fp16, fp64). */
GA_API ga_status ga_zero(ga_tensor_list tensors);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* GRADIENT_ACCUMULATOR_BUFFERS_H_ */
