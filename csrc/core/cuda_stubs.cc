// The CUDA entry points of a build without CUDA: each reports kGaUnsupported.
#include "internal.h"

#if !defined(GA_WITH_CUDA)

#include <cstdio>

#include "gradient_accumulator/cuda.h"

namespace {

ga_status unsupported() {
  ga::detail::set_last_error(kGaUnsupported, "",
                             "this build of gradient-accumulator has no CUDA kernels (rebuild "
                             "with a CUDA compiler, or -DGA_CUDA=ON)");
  return kGaUnsupported;
}

}  // namespace

extern "C" {

int ga_cuda_device_count(void) { return 0; }

void ga_cuda_probe(ga_cuda_probe_result* result) {
  if (result == nullptr) return;
  *result = ga_cuda_probe_result{};
  result->code = kGaCudaNotBuilt;
  std::snprintf(result->reason, sizeof(result->reason), "%s",
                "no CUDA kernels in this build (GA_CUDA=OFF)");
}

ga_status ga_cuda_accumulate(ga_tensor_list, ga_tensor_list, const ga_accumulate_options*, float*,
                             double*, void*) {
  return unsupported();
}
ga_status ga_cuda_sum_of_squares(ga_tensor_list, double*, void*) { return unsupported(); }
ga_status ga_cuda_unitwise_norm(ga_tensor, ga_units, ga_tensor, void*) { return unsupported(); }
ga_status ga_cuda_adaptive_clip(ga_tensor_list, ga_tensor_list, const ga_units*, double, double,
                                void*) {
  return unsupported();
}
ga_status ga_cuda_apply(const ga_apply_tensors*, const ga_apply_options*, const float*,
                        ga_cuda_apply_stats*, void*) {
  return unsupported();
}
ga_status ga_cuda_zero(ga_tensor_list, void*) { return unsupported(); }
ga_status ga_cuda_wgrad_accumulate(const ga_matrix*, const ga_matrix*, const ga_matrix*,
                                   const ga_accumulate_options*, void*) {
  return unsupported();
}
ga_status ga_cublaslt_load(const char*) { return unsupported(); }
ga_status ga_cuda_bn_merge(double*, ga_tensor, ga_tensor, double, ga_tensor, ga_tensor, void*) {
  return unsupported();
}
ga_status ga_cuda_bn_update_running(ga_tensor, ga_tensor, ga_tensor, ga_tensor, double, double, int,
                                    void*) {
  return unsupported();
}

}  // extern "C"

#endif  // !GA_WITH_CUDA
