// Global sum of squares, unit-wise norms and adaptive gradient clipping.
#include <cmath>
#include <string>
#include <vector>

#include "internal.h"

using namespace ga::detail;

namespace ga {
namespace detail {

void check_units(const ga_tensor& t, const ga_units& u, const std::string& name) {
  if (u.num_units < 1) fail(kGaInvalidArgument, name, name + ": num_units must be >= 1");
  const int64_t layout = raw_enum(u.layout);  // any int may arrive from C
  if (layout != kGaUnitsLeading && layout != kGaUnitsTrailing)
    fail(kGaInvalidArgument, name, name + ": unknown unit layout");
  if (t.numel % u.num_units != 0)
    fail(kGaInvalidArgument, name,
         name + ": " + std::to_string(u.num_units) + " units do not divide " +
             std::to_string(t.numel) + " elements");
}

ga_status run_apply(const ga_apply_tensors* tp, const ga_apply_options* op, ga_apply_result* result,
                    const char* acc_name, const char* param_name);

double list_sumsq(const ga_tensor_list& tensors) {
  static thread_local std::vector<Chunk> chunks;
  static thread_local std::vector<double> part;
  make_chunks(tensors, chunks);
  part.assign(chunks.size(), 0.0);
  SumsqArgs a{tensors.tensors, chunks.data(), static_cast<int64_t>(chunks.size()), part.data()};
  if (!chunks.empty()) cpu_kernels().sumsq(a);
  double s = 0.0;
  for (double p : part) s += p;
  return s;
}

}  // namespace detail
}  // namespace ga

extern "C" ga_status ga_sum_of_squares(ga_tensor_list tensors, double* sumsq) {
  return guarded([&] {
    if (sumsq == nullptr) fail(kGaInvalidArgument, "sumsq", "sumsq is null");
    check_list(tensors, "tensors");
    check_all_cpu({{&tensors, "tensors"}});
    *sumsq = list_sumsq(tensors);
  });
}

namespace ga {
namespace detail {

void validate_unitwise_norm(const ga_tensor& tensor, const ga_units& units, const ga_tensor& norms,
                            ga_device_type device) {
  check_tensor(tensor, "tensor");
  check_tensor(norms, "norms");
  check_units(tensor, units, "units");
  check_dtype_in(norms, "norms", {kGaFloat32, kGaFloat64});
  if (norms.numel != units.num_units)
    fail(kGaInvalidArgument, "norms",
         "norms has " + std::to_string(norms.numel) + " elements, expected " +
             std::to_string(units.num_units));
  if (device == kGaCUDA) {
    int32_t id = -1;
    check_cuda(tensor, "tensor", &id);
    check_cuda(norms, "norms", &id);
  } else {
    check_cpu(tensor, "tensor");
    check_cpu(norms, "norms");
  }
  std::vector<Range> w, r;
  add_range(w, norms, "norms");
  add_range(r, tensor, "tensor");
  check_disjoint(w, r);
}

}  // namespace detail
}  // namespace ga

extern "C" ga_status ga_unitwise_norm(ga_tensor tensor, ga_units units, ga_tensor norms) {
  return guarded([&] {
    validate_unitwise_norm(tensor, units, norms, kGaCPU);
    std::vector<double> s(static_cast<size_t>(units.num_units));
    cpu_kernels().unit_sumsq(UnitSumsqArgs{tensor, units, s.data()});
    for (int64_t u = 0; u < units.num_units; ++u) {
      if (norms.dtype == kGaFloat32)
        static_cast<float*>(norms.data)[u] = static_cast<float>(std::sqrt(s[u]));
      else
        static_cast<double*>(norms.data)[u] = std::sqrt(s[u]);
    }
  });
}

extern "C" ga_status ga_adaptive_clip(ga_tensor_list params, ga_tensor_list grads,
                                      const ga_units* units, double clip_factor, double eps) {
  ga_apply_tensors t;
  ga_apply_options o;
  ga::detail::agc_as_apply(params, grads, units, clip_factor, eps, &t, &o);
  return ga::detail::run_apply(&t, &o, nullptr, "grads", "params");
}
