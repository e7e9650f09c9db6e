/* Shared types of the gradient-accumulator core: tensor descriptors, dtypes, status codes. */
#ifndef GRADIENT_ACCUMULATOR_COMMON_H_
#define GRADIENT_ACCUMULATOR_COMMON_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define GA_API __declspec(dllexport)
#else
#define GA_API __attribute__((visibility("default")))
#endif

/** \brief Element type of a tensor seen by the core. */
typedef enum ga_dtype {
  kGaFloat32 = 0,
  kGaFloat16 = 1,
  kGaBFloat16 = 2,
  kGaFloat64 = 3,
} ga_dtype;

/** \brief Where a tensor's memory lives. */
typedef enum ga_device_type {
  kGaCPU = 0,
  kGaCUDA = 1,
} ga_device_type;

/** \brief Result of every core entry point. */
typedef enum ga_status {
  kGaOk = 0,
  kGaInvalidArgument = 1, /**< a value is out of range or inconsistent (Python: ValueError) */
  kGaTypeError = 2,       /**< a dtype or device is not supported here (Python: TypeError) */
  kGaRuntimeError = 3,    /**< allocation or device failure (Python: RuntimeError) */
  kGaUnsupported = 4,     /**< the build lacks this feature, e.g. CUDA (Python: RuntimeError) */
} ga_status;

/**
 * \brief A non-owning view of a dense, contiguous tensor.
 *
 * The core never frees or reallocates `data`; the caller keeps it alive for the call.
 */
typedef struct ga_tensor {
  void* data;                 /**< first element (may be NULL when numel == 0) */
  int64_t numel;              /**< number of elements */
  ga_dtype dtype;             /**< element type */
  ga_device_type device_type; /**< memory location */
  int32_t device_id;          /**< device ordinal (0 for the CPU) */
} ga_tensor;

/**
 * \brief A list of tensors, as passed to multi-tensor ops.
 */
typedef struct ga_tensor_list {
  const ga_tensor* tensors; /**< `size` descriptors */
  int64_t size;             /**< number of descriptors */
} ga_tensor_list;

/** \brief Message of the last failed call on this thread ("" if none). */
GA_API const char* ga_last_error(void);

/** \brief Name of the argument the last failed call on this thread complained about ("" if none).
 */
GA_API const char* ga_last_error_argument(void);

/** \brief Size in bytes of one element of `dtype` (0 for an unknown value). */
GA_API size_t ga_dtype_size(ga_dtype dtype);

/** \brief Version string of the core library, e.g. "0.1.0". */
GA_API const char* ga_version(void);

/** \brief Instruction set the CPU kernels dispatched to: "avx512", "avx2" or "generic". */
GA_API const char* ga_cpu_isa(void);

/** \brief Number of threads the CPU kernels use (OpenMP), 1 without OpenMP. */
GA_API int ga_cpu_num_threads(void);

/** \brief Non-zero when the library was built with CUDA kernels. */
GA_API int ga_has_cuda(void);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* GRADIENT_ACCUMULATOR_COMMON_H_ */
