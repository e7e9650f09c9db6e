// Batch-norm moments, Chan's merge of (count, mean, M2), once-per-cycle running statistics.
#include <cmath>
#include <string>
#include <vector>

#include "formulas.h"
#include "internal.h"

using namespace ga::detail;

namespace {

double get(const ga_tensor& t, int64_t i) {
  return t.dtype == kGaFloat64 ? static_cast<const double*>(t.data)[i]
                               : static_cast<const float*>(t.data)[i];
}
void put(const ga_tensor& t, int64_t i, double v) {
  if (t.dtype == kGaFloat64)
    static_cast<double*>(t.data)[i] = v;
  else
    static_cast<float*>(t.data)[i] = static_cast<float>(v);
}

void check_stats(std::initializer_list<std::pair<const ga_tensor*, const char*>> ts, int64_t n,
                 ga_device_type device = kGaCPU) {
  int32_t id = -1;
  for (const auto& [t, name] : ts) {
    check_tensor(*t, name);
    check_dtype_in(*t, name, {kGaFloat32, kGaFloat64});
    if (device == kGaCUDA)
      check_cuda(*t, name, &id);
    else if (t->device_type != kGaCPU)
      fail(kGaTypeError, name, std::string(name) + " must be a CPU tensor");
    if (t->numel != n)
      fail(kGaInvalidArgument, name,
           std::string(name) + " has " + std::to_string(t->numel) + " elements, expected " +
               std::to_string(n));
  }
}

}  // namespace

extern "C" ga_status ga_bn_moments(ga_tensor x, int64_t outer, int64_t channels, int64_t inner,
                                   ga_tensor mean, ga_tensor m2) {
  return guarded([&] {
    check_tensor(x, "x");
    if (outer < 0 || channels < 1 || inner < 0)
      fail(kGaInvalidArgument, "channels",
           "outer, channels and inner must be >= 0 (channels >= 1)");
    const int64_t expected = checked_mul(checked_mul(outer, channels, "channels"), inner, "inner");
    if (expected != x.numel)
      fail(kGaInvalidArgument, "x",
           "x has " + std::to_string(x.numel) +
               " elements, not outer*channels*inner = " + std::to_string(expected));
    if (x.device_type != kGaCPU) fail(kGaTypeError, "x", "x must be a CPU tensor");
    check_stats({{&mean, "mean"}, {&m2, "m2"}}, channels);
    std::vector<Range> w, r;
    add_range(w, mean, "mean");
    add_range(w, m2, "m2");
    add_range(r, x, "x");
    check_disjoint(w, r);
    std::vector<double> mu(channels), q(channels);
    cpu_kernels().bn_moments(BnMomentsArgs{x, outer, channels, inner, mu.data(), q.data()});
    for (int64_t c = 0; c < channels; ++c) {
      put(mean, c, mu[c]);
      put(m2, c, q[c]);
    }
  });
}

namespace ga {
namespace detail {

void validate_bn_merge(const double* count_a, const ga_tensor& mean_a, const ga_tensor& m2_a,
                       double count_b, const ga_tensor& mean_b, const ga_tensor& m2_b,
                       ga_device_type device) {
  if (count_a == nullptr) fail(kGaInvalidArgument, "count_a", "count_a is null");
  if (!std::isfinite(*count_a) || *count_a < 0)
    fail(kGaInvalidArgument, "count_a", "count_a must be finite and >= 0");
  if (!std::isfinite(count_b) || count_b < 0)
    fail(kGaInvalidArgument, "count_b", "count_b must be finite and >= 0");
  const int64_t n = mean_a.numel;
  check_stats({{&mean_a, "mean_a"}, {&m2_a, "m2_a"}, {&mean_b, "mean_b"}, {&m2_b, "m2_b"}}, n,
              device);
  std::vector<Range> w, r;
  add_range(w, mean_a, "mean_a");
  add_range(w, m2_a, "m2_a");
  add_range(r, mean_b, "mean_b");
  add_range(r, m2_b, "m2_b");
  check_disjoint(w, r);
}

void validate_bn_update(const ga_tensor& running_mean, const ga_tensor& running_var,
                        const ga_tensor& mean, const ga_tensor& m2, double count, double new_weight,
                        int unbiased, ga_device_type device) {
  const int64_t n = running_mean.numel;
  check_stats({{&running_mean, "running_mean"},
               {&running_var, "running_var"},
               {&mean, "mean"},
               {&m2, "m2"}},
              n, device);
  if (!std::isfinite(count) || count <= 0 || (unbiased && count <= 1))
    fail(kGaInvalidArgument, "count",
         "count must be > 0 (> 1 for the unbiased variance), got " + std::to_string(count));
  if (!(new_weight >= 0 && new_weight <= 1))
    fail(kGaInvalidArgument, "momentum", "the momentum must be in [0, 1]");
  std::vector<Range> w, r;
  add_range(w, running_mean, "running_mean");
  add_range(w, running_var, "running_var");
  add_range(r, mean, "mean");
  add_range(r, m2, "m2");
  check_disjoint(w, r);
}

}  // namespace detail
}  // namespace ga

extern "C" ga_status ga_bn_merge(double* count_a, ga_tensor mean_a, ga_tensor m2_a, double count_b,
                                 ga_tensor mean_b, ga_tensor m2_b) {
  return guarded([&] {
    validate_bn_merge(count_a, mean_a, m2_a, count_b, mean_b, m2_b, kGaCPU);
    const int64_t n = mean_a.numel;
    const double na = *count_a, nb = count_b, nt = na + nb;
    if (nb == 0) return;
    for (int64_t c = 0; c < n; ++c) {
      const ga::formulas::Moments m = ga::formulas::chan_merge(na, get(mean_a, c), get(m2_a, c), nb,
                                                               get(mean_b, c), get(m2_b, c));
      put(mean_a, c, m.mean);
      put(m2_a, c, m.m2);
    }
    *count_a = nt;
  });
}

extern "C" ga_status ga_bn_update_running(ga_tensor running_mean, ga_tensor running_var,
                                          ga_tensor mean, ga_tensor m2, double count,
                                          double new_weight, int unbiased) {
  return guarded([&] {
    validate_bn_update(running_mean, running_var, mean, m2, count, new_weight, unbiased, kGaCPU);
    const int64_t n = running_mean.numel;
    const double div = unbiased ? count - 1 : count;
    for (int64_t c = 0; c < n; ++c) {
      const double var = get(m2, c) / div;
      put(running_mean, c,
          ga::formulas::running_update(get(running_mean, c), get(mean, c), new_weight));
      put(running_var, c, ga::formulas::running_update(get(running_var, c), var, new_weight));
    }
  });
}
