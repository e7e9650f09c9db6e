// CUDA entry points of cuda.h for pack, unpack and zero.
#include "launch.cuh"

using ga::cuda::CudaBackend;
using ga::cuda::device_of;
using ga::cuda::run;

extern "C" {

ga_status ga_cuda_pack(ga_tensor_list src, ga_tensor flat, double scale, void* stream) {
  return run(device_of(&flat), stream,
             [&](CudaBackend& b) { return ga::cuda::copy_flat(b, src, flat, scale, true); });
}

ga_status ga_cuda_unpack(ga_tensor flat, ga_tensor_list dst, double scale, void* stream) {
  return run(device_of(&flat), stream,
             [&](CudaBackend& b) { return ga::cuda::copy_flat(b, dst, flat, scale, false); });
}

ga_status ga_cuda_zero(ga_tensor_list tensors, void* stream) {
  return run(device_of(tensors), stream,
             [&](CudaBackend& b) { return ga::cuda::zero(b, tensors); });
}

}  // extern "C"
