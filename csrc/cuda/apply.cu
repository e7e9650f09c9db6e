// CUDA entry point of cuda.h for the fused apply (scale, clip or AGC, optimizer update, reset).
// This translation unit compiles the kernels of optimizer="none" and SGD; Adam's and AdamW's are
// compiled in apply_adam.cu and apply_adamw.cu, in parallel.
#include "launch.cuh"

using ga::cuda::CudaBackend;
using ga::cuda::device_of;
using ga::cuda::run;

extern "C" {

ga_status ga_cuda_apply(const ga_apply_tensors* tensors, const ga_apply_options* options,
                        const float* skip_flag, ga_cuda_apply_stats* stats, void* stream) {
  if (options != nullptr) {
    const int64_t optimizer = ga::detail::raw_enum(options->optimizer);
    if (optimizer == kGaOptimizerAdam)
      return ga::cuda::apply_adam(tensors, options, skip_flag, stats, stream);
    if (optimizer == kGaOptimizerAdamW)
      return ga::cuda::apply_adamw(tensors, options, skip_flag, stats, stream);
  }
  // Everything else, invalid options included (validated and reported there).
  const int device = tensors != nullptr ? device_of(tensors->accumulators) : -1;
  constexpr unsigned kNoneOrSGD = ga::cuda::kSetNone | ga::cuda::kSetSGD;
  return run(device, stream, [&](CudaBackend& b) {
    return ga::cuda::apply<CudaBackend, kNoneOrSGD>(b, tensors, options, skip_flag, stats,
                                                    "accumulators", "params");
  });
}

}  // extern "C"
