/* CUDA entry points of the core: the op families on device memory, on a caller-given stream.
 *
 * Every function validates its arguments on the host, then only enqueues work on `stream` (a
 * cudaStream_t; NULL is the legacy default stream): no call here synchronises with the device or
 * reads device memory on the host. Results that the CPU entry points return on the host (the
 * non-finite flag, sums of squares, the clip coefficient, whether an update was skipped) are
 * written to caller-given device memory instead, so a training step never waits for the GPU.
 * Accumulators and every list of one call must live on the same CUDA device, the current one.
 * Without the CUDA build each function returns kGaUnsupported. */
#ifndef GRADIENT_ACCUMULATOR_CUDA_H_
#define GRADIENT_ACCUMULATOR_CUDA_H_

#include "gradient_accumulator/accumulate.h"
#include "gradient_accumulator/apply.h"
#include "gradient_accumulator/common.h"
#include "gradient_accumulator/norms.h"
#include "gradient_accumulator/wgrad.h"

#ifdef __cplusplus
extern "C" {
#endif

/**
 * \brief ga_accumulate on CUDA tensors (fp32 accumulators; fp32, bf16 or fp16 gradients).
 *
 * \param[out] nonfinite_flag device float32, or NULL: set to 1 when a gradient element is NaN or
 *             ±Inf, left as it was otherwise (so one flag can collect a whole cycle).
 * \param[out] sumsq device float64, or NULL: Σ acc² after the update, summed in a fixed order.
 */
GA_API ga_status ga_cuda_accumulate(ga_tensor_list accumulators, ga_tensor_list grads,
                                    const ga_accumulate_options* options, float* nonfinite_flag,
                                    double* sumsq, void* stream);

/** \brief Σ x² over a list of CUDA tensors into device float64 `sumsq`, in a fixed order. */
GA_API ga_status ga_cuda_sum_of_squares(ga_tensor_list tensors, double* sumsq, void* stream);

/** \brief Per-unit L2 norms of a CUDA tensor into the CUDA float32/float64 tensor `norms`. */
GA_API ga_status ga_cuda_unitwise_norm(ga_tensor tensor, ga_units units, ga_tensor norms,
                                       void* stream);

/** \brief ga_adaptive_clip on CUDA tensors (fp32 gradients). */
GA_API ga_status ga_cuda_adaptive_clip(ga_tensor_list params, ga_tensor_list grads,
                                       const ga_units* units, double clip_factor, double eps,
                                       void* stream);

/** \brief Device-side outcome of ga_cuda_apply (float32 values). */
typedef struct ga_cuda_apply_stats {
  float grad_norm; /**< ‖scaled gradient‖₂ before clipping, −1 when not computed */
  float clip_coef; /**< global-norm coefficient used, 1 when not clipped */
  float skipped;   /**< 1 if the update was skipped, else 0 */
} ga_cuda_apply_stats;

/**
 * \brief ga_apply on CUDA tensors: norm pass (when clipping by global norm without a given
 *        coefficient, or when skip_nonfinite is set), then one fused pass per tensor.
 *
 * `options->clip_coef`, when set, points to device memory. The skip decision is taken on the
 * device: a non-finite gradient (skip_nonfinite) or a non-zero `*skip_flag` (device float32, may
 * be NULL — e.g. the non-finite flag that ga_cuda_accumulate collected) leaves params and state
 * untouched and only resets the accumulators when `reset` is set.
 *
 * \param[out] stats device memory, or NULL.
 */
GA_API ga_status ga_cuda_apply(const ga_apply_tensors* tensors, const ga_apply_options* options,
                               const float* skip_flag, ga_cuda_apply_stats* stats, void* stream);

/** \brief ga_zero on CUDA tensors. */
GA_API ga_status ga_cuda_zero(ga_tensor_list tensors, void* stream);

/** \brief ga_bn_merge with the statistics in CUDA memory; the counts stay on the host. */
GA_API ga_status ga_cuda_bn_merge(double* count_a, ga_tensor mean_a, ga_tensor m2_a, double count_b,
                                  ga_tensor mean_b, ga_tensor m2_b, void* stream);

/** \brief ga_bn_update_running with every tensor in CUDA memory. */
GA_API ga_status ga_cuda_bn_update_running(ga_tensor running_mean, ga_tensor running_var,
                                           ga_tensor mean, ga_tensor m2, double count,
                                           double new_weight, int unbiased, void* stream);

/** \brief Number of CUDA devices the runtime sees (0 without a driver or a device). */
GA_API int ga_cuda_device_count(void);

/**
 * \brief ga_wgrad_accumulate on CUDA tensors: acc ← a·acc + b·dyᵀx in one cuBLASLt matmul on
 *        `stream`, C = D = the fp32 accumulator, compute type fp32 (wgrad.h).
 *
 * `dy` and `x`: fp32, bf16 or fp16 (the same), each with one unit stride. Returns
 * kGaUnsupported (nothing enqueued) where cuBLASLt is not loaded (ga_cublaslt_load) or has no
 * algorithm for the case: the caller then computes the gradient and calls ga_cuda_accumulate.
 */
GA_API ga_status ga_cuda_wgrad_accumulate(const ga_matrix* acc, const ga_matrix* dy,
                                          const ga_matrix* x, const ga_accumulate_options* options,
                                          void* stream);

/** \brief Load cuBLASLt from `path`, or by its soname when `path` is NULL (the one the CUDA
 * runtime of this build pairs with). Idempotent once it succeeded. */
GA_API ga_status ga_cublaslt_load(const char* path);

/** \brief Whether the CUDA kernels can run on this machine (ga_cuda_probe_result.code). */
typedef enum ga_cuda_availability {
  kGaCudaAvailable = 0,    /**< kernels built, a driver that runs them, at least one device */
  kGaCudaNotBuilt = 1,     /**< this build has no CUDA kernels */
  kGaCudaNoDriver = 2,     /**< no NVIDIA driver (libcuda) could be loaded */
  kGaCudaDriverTooOld = 3, /**< the driver supports an older CUDA than the runtime linked here */
  kGaCudaNoDevice = 4,     /**< a driver, but no CUDA device visible to it */
  kGaCudaError = 5         /**< another error of the runtime's initialisation: see `reason` */
} ga_cuda_availability;

/** \brief What ga_cuda_probe found. Versions are 1000·major + 10·minor (12040 is CUDA 12.4). */
typedef struct ga_cuda_probe_result {
  int code;            /**< a ga_cuda_availability */
  int device_count;    /**< CUDA devices visible (0 unless code is kGaCudaAvailable) */
  int driver_version;  /**< the newest CUDA the driver supports; 0 without a driver */
  int runtime_version; /**< the CUDA runtime linked into the core; 0 without CUDA kernels */
  char reason[256];    /**< one line for people: "ok: …" or why the kernels cannot run */
} ga_cuda_probe_result;

/**
 * \brief Whether a usable driver and device are present, and why not. Never fails: the
 *        outcome, errors of the runtime included, is written to `*result` (ignored when NULL).
 *        Loads the driver (as any first CUDA call does) but creates no context on a device.
 */
GA_API void ga_cuda_probe(ga_cuda_probe_result* result);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* GRADIENT_ACCUMULATOR_CUDA_H_ */
