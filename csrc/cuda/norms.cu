// CUDA entry points of cuda.h for unit-wise norms and adaptive gradient clipping.
#include "launch.cuh"

using ga::cuda::CudaBackend;
using ga::cuda::device_of;
using ga::cuda::run;

extern "C" {

ga_status ga_cuda_unitwise_norm(ga_tensor tensor, ga_units units, ga_tensor norms, void* stream) {
  return run(device_of(&tensor), stream,
             [&](CudaBackend& b) { return ga::cuda::unitwise_norm(b, tensor, units, norms); });
}

ga_status ga_cuda_adaptive_clip(ga_tensor_list params, ga_tensor_list grads, const ga_units* units,
                                double clip_factor, double eps, void* stream) {
  return run(device_of(grads), stream, [&](CudaBackend& b) {
    return ga::cuda::adaptive_clip(b, params, grads, units, clip_factor, eps);
  });
}

}  // extern "C"
