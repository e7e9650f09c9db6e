// CUDA entry points of cuda.h for accumulate: fold gradients into fp32 accumulators, sums of
// squares.
#include "launch.cuh"

using ga::cuda::CudaBackend;
using ga::cuda::device_of;
using ga::cuda::run;

extern "C" {

ga_status ga_cuda_accumulate(ga_tensor_list accumulators, ga_tensor_list grads,
                             const ga_accumulate_options* options, float* nonfinite_flag,
                             double* sumsq, void* stream) {
  return run(device_of(accumulators), stream, [&](CudaBackend& b) {
    return ga::cuda::accumulate(b, accumulators, grads, options, nonfinite_flag, sumsq);
  });
}

ga_status ga_cuda_sum_of_squares(ga_tensor_list tensors, double* sumsq, void* stream) {
  return run(device_of(tensors), stream,
             [&](CudaBackend& b) { return ga::cuda::sum_of_squares(b, tensors, sumsq); });
}

}  // extern "C"
