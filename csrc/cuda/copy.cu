// CUDA entry point of cuda.h for zero.
#include "launch.cuh"

using ga::cuda::CudaBackend;
using ga::cuda::device_of;
using ga::cuda::run;

extern "C" {

ga_status ga_cuda_zero(ga_tensor_list tensors, void* stream) {
  return run(device_of(tensors), stream,
             [&](CudaBackend& b) { return ga::cuda::zero(b, tensors); });
}

}  // extern "C"
