// The fused apply's AdamW kernels, compiled apart from apply.cu (none, SGD) and apply_adam.cu
// so that the largest sets of kernel instantiations build in parallel.
#include "launch.cuh"

namespace ga {
namespace cuda {

ga_status apply_adamw(const ga_apply_tensors* tensors, const ga_apply_options* options,
                      const float* skip_flag, ga_cuda_apply_stats* stats, void* stream) {
  const int device = tensors != nullptr ? device_of(tensors->accumulators) : -1;
  return run(device, stream, [&](CudaBackend& b) {
    return apply<CudaBackend, kSetAdamW>(b, tensors, options, skip_flag, stats, "accumulators",
                                         "params");
  });
}

}  // namespace cuda
}  // namespace ga
