// ga_accumulate: validation, then one chunked pass on the CPU kernels.
#include <cmath>
#include <string>
#include <vector>

#include "internal.h"

using namespace ga::detail;

namespace ga {
namespace detail {

void accumulate_coefficients(const ga_accumulate_options& options, bool fp32, double* alpha_out,
                             double* beta_out) {
  const double w = options.weight;
  if (!std::isfinite(w) || w < 0)
    fail(kGaInvalidArgument, "weight", "weight must be finite and >= 0, got " + std::to_string(w));
  double alpha = 1.0, beta = w;
  switch (raw_enum(options.mode)) {  // any int may arrive from C: validate it as one
    case kGaAccumulateSum:
      break;
    case kGaAccumulateRunningMean: {
      const double before = options.overwrite ? 0.0 : options.weight_before;
      if (!std::isfinite(before) || before < 0)
        fail(kGaInvalidArgument, "weight_before", "weight_before must be finite and >= 0");
      const double total = before + w;
      if (total <= 0)
        fail(kGaInvalidArgument, "weight", "running mean needs a positive total weight");
      alpha = before / total;
      beta = w / total;
      break;
    }
    default:
      fail(kGaInvalidArgument, "mode", "unknown accumulate mode");
  }
  // float32 accumulators are updated with alpha and beta rounded to float32: a weight that
  // rounds to ±inf or flushes towards 0 there would corrupt them silently.
  if (fp32) {
    check_fits_float32(beta, "weight",
                       "by float32 accumulators (pass float64 accumulators for "
                       "wider weights)");
    check_fits_float32(alpha, "weight_before", "by float32 accumulators");
  }
  *alpha_out = alpha;
  *beta_out = beta;
}

void validate_accumulate(const ga_tensor_list& accumulators, const ga_tensor_list& grads,
                         const ga_accumulate_options* options, ga_device_type device,
                         double* alpha_out, double* beta_out) {
  if (options == nullptr) fail(kGaInvalidArgument, "options", "options is null");
  check_list(accumulators, "accumulators");
  check_list(grads, "grads");
  check_same_sizes(accumulators, "accumulators", grads, "grads");
  if (device == kGaCUDA) {
    check_list_dtype_in(accumulators, "accumulators", {kGaFloat32});
    check_list_dtype_in(grads, "grads", {kGaFloat32, kGaBFloat16, kGaFloat16});
    int32_t id = -1;
    check_all_cuda({{&accumulators, "accumulators"}, {&grads, "grads"}}, &id);
  } else {
    check_list_dtype_in(accumulators, "accumulators", {kGaFloat32, kGaFloat64});
    check_list_dtype_in(grads, "grads", {kGaFloat32, kGaBFloat16, kGaFloat16, kGaFloat64});
    check_all_cpu({{&accumulators, "accumulators"}, {&grads, "grads"}});
  }
  bool any_fp32 = false;
  for (int64_t i = 0; i < accumulators.size; ++i)
    any_fp32 = any_fp32 || accumulators.tensors[i].dtype == kGaFloat32;
  double alpha = 1.0, beta = 1.0;
  accumulate_coefficients(*options, any_fp32, &alpha, &beta);
  std::vector<Range> written, read;
  add_ranges(written, accumulators, "accumulators");
  add_ranges(read, grads, "grads");
  check_disjoint(written, read);
  *alpha_out = alpha;
  *beta_out = beta;
}

}  // namespace detail
}  // namespace ga

extern "C" ga_status ga_accumulate(ga_tensor_list accumulators, ga_tensor_list grads,
                                   const ga_accumulate_options* options, int want_sumsq,
                                   ga_accumulate_result* result) {
  return guarded([&] {
    double alpha = 1.0, beta = 1.0;
    validate_accumulate(accumulators, grads, options, kGaCPU, &alpha, &beta);
    static thread_local std::vector<Chunk> chunks;
    static thread_local std::vector<uint8_t> bad;
    static thread_local std::vector<double> part;
    make_chunks(accumulators, chunks);
    bad.assign(chunks.size(), 0);
    if (want_sumsq) part.assign(chunks.size(), 0.0);
    AccumulateArgs a{accumulators.tensors,
                     grads.tensors,
                     static_cast<float>(alpha),
                     static_cast<float>(beta),
                     options->overwrite != 0,
                     want_sumsq != 0,
                     chunks.data(),
                     static_cast<int64_t>(chunks.size()),
                     bad.data(),
                     part.data()};
    a.alpha64 = alpha;
    a.beta64 = beta;
    if (!chunks.empty()) cpu_kernels().accumulate(a);
    if (result) {
      result->nonfinite = 0;
      for (uint8_t b : bad) result->nonfinite |= b;
      double s = 0.0;
      if (want_sumsq)
        for (double p : part) s += p;
      result->sumsq = want_sumsq ? s : -1.0;
    }
  });
}
