// CUDA entry points of cuda.h for batch-norm moment merge and running statistics.
#include "launch.cuh"

using ga::cuda::CudaBackend;
using ga::cuda::device_of;
using ga::cuda::run;

extern "C" {

ga_status ga_cuda_bn_merge(double* count_a, ga_tensor mean_a, ga_tensor m2_a, double count_b,
                           ga_tensor mean_b, ga_tensor m2_b, void* stream) {
  return run(device_of(&mean_a), stream, [&](CudaBackend& b) {
    return ga::cuda::bn_merge(b, count_a, mean_a, m2_a, count_b, mean_b, m2_b);
  });
}

ga_status ga_cuda_bn_update_running(ga_tensor running_mean, ga_tensor running_var, ga_tensor mean,
                                    ga_tensor m2, double count, double new_weight, int unbiased,
                                    void* stream) {
  return run(device_of(&running_mean), stream, [&](CudaBackend& b) {
    return ga::cuda::bn_update_running(b, running_mean, running_var, mean, m2, count, new_weight,
                                       unbiased);
  });
}

}  // extern "C"
