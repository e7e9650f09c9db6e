/* Fused weight-gradient accumulation: a linear layer's weight gradient dyᵀx added straight into
 * its fp32 accumulator by one GEMM, so no gradient tensor is made and no second pass reads it.
 *
 * For y = x·Wᵀ (x: n×in, W and its accumulator: out×in, dy: n×out) the gradient of W is dyᵀx.
 * ga_wgrad_accumulate folds it in with the accumulate family's formula (accumulate.h):
 * acc ← a·acc + b·dyᵀx with (a, b) from the options — (1, w) for "sum", (0, w) on a cycle's
 * first micro-step, (W/(W+w), w/(W+w)) for a running mean. The GEMM writes the accumulator as
 * its output, scaled by a (the GEMM's beta: 1 for a sum, 0 on a first write, which never reads
 * the old values), with b as the scale of its product, in fp32 whatever the inputs' type.
 *
 * The CPU path calls oneDNN's matmul primitive; the library is loaded at run time
 * (ga_onednn_load), so the core builds and runs without it. The CUDA path calls cuBLASLt on the
 * caller's stream (cuda.h). Where neither can take a case, the call returns kGaUnsupported
 * with the reason and writes nothing: the caller computes the gradient and calls ga_accumulate.
 */
#ifndef GRADIENT_ACCUMULATOR_WGRAD_H_
#define GRADIENT_ACCUMULATOR_WGRAD_H_

#include "gradient_accumulator/accumulate.h"
#include "gradient_accumulator/common.h"

#ifdef __cplusplus
extern "C" {
#endif

/** \brief A strided matrix: `rows`×`cols` elements of `tensor`, element (r, c) at
 * data[r·row_stride + c·col_stride] (strides in elements, ≥ 0). */
typedef struct ga_matrix {
  ga_tensor tensor; /**< data, dtype and device; numel counts the span the strides reach */
  int64_t rows;
  int64_t cols;
  int64_t row_stride;
  int64_t col_stride;
} ga_matrix;

/**
 * \brief acc ← a·acc + b·dyᵀx in one GEMM (see the file comment for a and b).
 * \param[in,out] acc  fp32, out×in, row-major and dense (row_stride = in, col_stride = 1).
 * \param[in]     dy   n×out, fp32, bf16 or fp16, any strides.
 * \param[in]     x    n×in, the same dtype as `dy`, any strides.
 * \param[in]     options mode, weight, weight before, first-step overwrite (as ga_accumulate).
 * \return kGaOk; kGaUnsupported (nothing written) where oneDNN is not loaded or has no kernel
 *         for this dtype on this CPU; an argument error with nothing written.
 */
GA_API ga_status ga_wgrad_accumulate(const ga_matrix* acc, const ga_matrix* dy, const ga_matrix* x,
                                     const ga_accumulate_options* options);

/**
 * \brief The bias's share of a linear layer's fold: acc ← a·acc + b·Σᵣ dy[r, :], the column sums
 *        of `dy` taken in fp32 in row order (a and b as in ga_wgrad_accumulate).
 * \param[in,out] acc  fp32, `dy->cols` elements, dense.
 * \param[in]     dy   n×out, fp32, bf16 or fp16, any strides (CPU).
 */
GA_API ga_status ga_bias_accumulate(const ga_tensor* acc, const ga_matrix* dy,
                                    const ga_accumulate_options* options);

/** \brief Load oneDNN (3.x, its C API) from `path`, or by its soname libdnnl.so.3 when `path` is
 * NULL. Idempotent once it succeeded; kGaUnsupported with the reason when it fails. */
GA_API ga_status ga_onednn_load(const char* path);

/** \brief Which path a CPU fold of this shape and dtype takes: 1 fused (oneDNN), 0 not, with
 * the reason (or the kernel oneDNN chose) written to `what` (NUL-terminated, at most `len`). */
GA_API int ga_wgrad_cpu_path(ga_dtype dtype, int64_t n, int64_t out, int64_t in, char* what,
                             size_t len);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* GRADIENT_ACCUMULATOR_WGRAD_H_ */
