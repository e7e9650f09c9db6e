// ga_apply: validate everything, compute the clip coefficient (global norm or per unit), then
// one fused pass per tensor on the CPU kernels.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "formulas.h"
#include "internal.h"
#include "lists_checked.h"

using namespace ga::detail;

namespace ga {
namespace detail {
void check_units(const ga_tensor& t, const ga_units& u, const std::string& name);
double list_sumsq(const ga_tensor_list& tensors);
}  // namespace detail
}  // namespace ga

namespace {

void check_finite(double v, const char* name, double lo, bool lo_inclusive) {
  if (!std::isfinite(v) || v < lo || (!lo_inclusive && v == lo)) {
    fail(kGaInvalidArgument, name,
         std::string(name) + " must be finite and " + (lo_inclusive ? ">= " : "> ") +
             std::to_string(lo) + ", got " + std::to_string(v));
  }
}

void validate_options(const ga_apply_options& o, bool has_coef_ptr, int64_t num_tensors) {
  if (!std::isfinite(o.grad_scale))
    fail(kGaInvalidArgument, "grad_scale", "grad_scale must be finite");
  switch (raw_enum(o.clip)) {  // any int may arrive from C: validate it as one
    case kGaClipNone:
      break;
    case kGaClipGlobalNorm:
      if (!has_coef_ptr) check_finite(o.max_norm, "max_norm", 0.0, false);
      break;
    case kGaClipAgc:
      check_finite(o.clip_factor, "clip_factor", 0.0, false);
      check_finite(o.agc_eps, "eps", 0.0, true);
      if (o.units == nullptr && num_tensors != 0)
        fail(kGaInvalidArgument, "units", "AGC needs the unit layout of every tensor");
      break;
    default:
      fail(kGaInvalidArgument, "clip", "unknown clip mode");
  }
  switch (raw_enum(o.optimizer)) {
    case kGaOptimizerNone:
      return;
    case kGaOptimizerSGD:
      check_finite(o.momentum, "momentum", 0.0, true);
      check_finite(o.dampening, "dampening", -1e300, true);
      if (o.nesterov && (o.momentum <= 0 || o.dampening != 0))
        fail(kGaInvalidArgument, "nesterov",
             "Nesterov momentum requires a momentum and zero dampening");
      break;
    case kGaOptimizerAdam:
    case kGaOptimizerAdamW:
      if (!(o.beta1 >= 0 && o.beta1 < 1))
        fail(kGaInvalidArgument, "beta1", "beta1 must be in [0, 1)");
      if (!(o.beta2 >= 0 && o.beta2 < 1))
        fail(kGaInvalidArgument, "beta2", "beta2 must be in [0, 1)");
      check_finite(o.adam_eps, "eps", 0.0, true);
      if (o.step < 1 && o.step_counters == nullptr)
        fail(kGaInvalidArgument, "step", "step must be >= 1 (the step this update makes)");
      break;
    default:
      fail(kGaInvalidArgument, "optimizer", "unknown optimizer");
  }
  if (o.step_counters != nullptr && o.optimizer != kGaOptimizerAdam &&
      o.optimizer != kGaOptimizerAdamW)
    fail(kGaInvalidArgument, "step_counters", "step_counters is for adam and adamw only");
  check_finite(o.lr, "lr", 0.0, true);
  check_finite(o.weight_decay, "weight_decay", 0.0, true);
}

}  // namespace

namespace ga {
namespace detail {

void validate_apply(const ga_apply_tensors& t, const ga_apply_options& o, const char* acc_name,
                    const char* param_name, ga_device_type device, bool lists_checked) {
  validate_options(o, o.clip_coef != nullptr, t.accumulators.size);
  const bool update = o.optimizer != kGaOptimizerNone;
  const bool adam = o.optimizer == kGaOptimizerAdam || o.optimizer == kGaOptimizerAdamW;
  const bool momentum = o.optimizer == kGaOptimizerSGD && o.momentum != 0.0;
  const bool agc = o.clip == kGaClipAgc;

  const ga_tensor_list empty{nullptr, 0};
  const ga_tensor_list& params = (update || agc) ? t.params : empty;
  const ga_tensor_list& s1 = (momentum || adam) ? t.state1 : empty;
  const ga_tensor_list& s2 = adam ? t.state2 : empty;
  const ga_tensor_list& out = (!update) ? t.grads_out : empty;
  if (!update && o.reset && t.grads_out.size == 0)
    fail(kGaInvalidArgument, "reset",
         "reset would erase the gradient written in place; give grads_out or reset=0");
  // The lists themselves (lengths, dtypes, devices; below, overlaps): unchanged since a call
  // with the same registered lists and the same list rules passed them (lists_checked).
  if (!lists_checked) {
    check_list(t.accumulators, acc_name);
    if (device == kGaCUDA)
      check_list_dtype_in(t.accumulators, acc_name, {kGaFloat32});
    else
      check_list_dtype_in(t.accumulators, acc_name, {kGaFloat32, kGaFloat64});
    if (update || agc) {
      check_list(t.params, param_name);
      check_same_sizes(t.accumulators, acc_name, t.params, param_name);
      check_list_dtype_in(t.params, param_name, {kGaFloat32, kGaBFloat16, kGaFloat16});
    }
    auto check_state = [&](const ga_tensor_list& s, const char* name) {
      check_list(s, name);
      check_same_sizes(t.params, param_name, s, name);
      for (int64_t i = 0; i < s.size; ++i) {
        if (s.tensors[i].dtype != t.params.tensors[i].dtype && s.tensors[i].dtype != kGaFloat32) {
          fail(kGaTypeError, item(name, i),
               item(name, i) + " has dtype " + dtype_name(s.tensors[i].dtype) +
                   "; optimizer state must have the parameter's dtype (" +
                   dtype_name(t.params.tensors[i].dtype) + ") or float32");
        }
        if (i > 0 && (s.tensors[i].dtype == kGaFloat32) != (s.tensors[0].dtype == kGaFloat32) &&
            t.params.tensors[i].dtype != kGaFloat32)
          fail(kGaTypeError, item(name, i), item(name, i) + ": mixed state dtypes in one call");
      }
    };
    if (momentum || adam) check_state(t.state1, "state1");
    if (adam) {
      check_state(t.state2, "state2");
      for (int64_t i = 0; i < t.state2.size; ++i)
        if (t.state2.tensors[i].dtype != t.state1.tensors[i].dtype)
          fail(kGaTypeError, item("state2", i), item("state2", i) + " and state1 differ in dtype");
    }
    if (!update && t.grads_out.size > 0) {
      check_list(t.grads_out, "grads_out");
      check_same_sizes(t.accumulators, acc_name, t.grads_out, "grads_out");
      if (device == kGaCUDA)
        check_list_dtype_in(t.grads_out, "grads_out", {kGaFloat32, kGaBFloat16, kGaFloat16});
    }
    if (device == kGaCUDA) {
      int32_t id = -1;
      check_all_cuda({{&t.accumulators, acc_name},
                      {&params, param_name},
                      {&s1, "state1"},
                      {&s2, "state2"},
                      {&out, "grads_out"}},
                     &id);
    } else {
      check_all_cpu({{&t.accumulators, acc_name},
                     {&params, param_name},
                     {&s1, "state1"},
                     {&s2, "state2"},
                     {&out, "grads_out"}});
    }
  }
  if (agc) {
    for (int64_t i = 0; i < t.accumulators.size; ++i)
      if (o.units[i].num_units < 1 || t.accumulators.tensors[i].numel % o.units[i].num_units != 0 ||
          (raw_enum(o.units[i].layout) != kGaUnitsLeading &&
           raw_enum(o.units[i].layout) != kGaUnitsTrailing))
        check_units(t.accumulators.tensors[i], o.units[i], item("units", i));
  }
  // float32 accumulators are applied in float32 (float64 ones in double): every scalar that
  // float kernel multiplies with must keep its value there, or the update would silently use
  // 0 or ±inf in its place.
  bool any_fp32 = false;
  for (int64_t i = 0; i < t.accumulators.size; ++i)
    any_fp32 = any_fp32 || t.accumulators.tensors[i].dtype == kGaFloat32;
  if (any_fp32) {
    const char* why = "by the float32 update of float32 accumulators";
    check_fits_float32(o.grad_scale, "grad_scale", why);
    if (update) {
      check_fits_float32(o.lr, "lr", why);
      check_fits_float32(o.weight_decay, "weight_decay", why);
    }
    if (o.optimizer == kGaOptimizerSGD) {
      check_fits_float32(o.momentum, "momentum", why);
      check_fits_float32(1.0 - o.dampening, "dampening", why);
    }
    if (adam) check_fits_float32(o.adam_eps, "eps", why);
  }
  if (o.step_counters != nullptr) {
    for (int64_t i = 0; i < t.accumulators.size; ++i) {
      const float* c = o.step_counters[i];
      if (c == nullptr)
        fail(kGaInvalidArgument, item("step_counters", i), "a step counter is null");
      // Device memory is not read on the host: a CUDA counter is trusted as torch's own step.
      if (device == kGaCPU && !(*c >= 0.0f && *c < 16777216.0f && *c == std::floor(*c)))
        fail(kGaInvalidArgument, item("step_counters", i),
             item("step_counters", i) + " must hold a whole number of steps in [0, 2^24), got " +
                 std::to_string(*c));
    }
  }
  if (lists_checked && o.step_counters == nullptr) return;
  std::vector<Range> written, read;
  add_ranges(written, t.accumulators, acc_name);
  add_ranges(update ? written : read, params, param_name);
  add_ranges(written, s1, "state1");
  add_ranges(written, s2, "state2");
  add_ranges(written, out, "grads_out");
  if (o.step_counters != nullptr)
    for (int64_t i = 0; i < t.accumulators.size; ++i) {
      const uintptr_t b = reinterpret_cast<uintptr_t>(o.step_counters[i]);
      written.push_back(Range{b, b + sizeof(float), "step_counters", i});
    }
  check_disjoint(written, read);
}

namespace {

/// Chunks of one step (`chunks` empty: all of the call's).
struct StepRun {
  int64_t step;
  std::vector<Chunk> chunks;
};

void step_runs(const ga_apply_options& o, const std::vector<Chunk>& all,
               std::vector<StepRun>& runs) {
  if (o.step_counters == nullptr) {
    runs.resize(1);
    runs[0].step = o.step;
    runs[0].chunks.clear();
    return;
  }
  runs.clear();
  for (const Chunk& c : all) {
    const int64_t step = static_cast<int64_t>(*o.step_counters[c.tensor]) + 1;
    auto it =
        std::find_if(runs.begin(), runs.end(), [&](const StepRun& r) { return r.step == step; });
    if (it == runs.end()) it = runs.insert(runs.end(), StepRun{step, {}});
    it->chunks.push_back(c);
  }
  if (runs.empty()) runs.push_back(StepRun{1, {}});
  if (runs.size() == 1) runs[0].chunks.clear();  // every chunk: the call's own array
}

}  // namespace

ga_status run_apply(const ga_apply_tensors* tp, const ga_apply_options* op, ga_apply_result* result,
                    const char* acc_name, const char* param_name) {
  return run_apply_lists_checked(tp, op, result, acc_name, param_name, false);
}

ga_status run_apply_lists_checked(const ga_apply_tensors* tp, const ga_apply_options* op,
                                  ga_apply_result* result, const char* acc_name,
                                  const char* param_name, bool lists_checked) {
  return guarded([&] {
    if (tp == nullptr) fail(kGaInvalidArgument, "tensors", "tensors is null");
    if (op == nullptr) fail(kGaInvalidArgument, "options", "options is null");
    const ga_apply_tensors& t = *tp;
    const ga_apply_options& o = *op;
    validate_apply(t, o, acc_name, param_name, kGaCPU, lists_checked);
    const bool agc = o.clip == kGaClipAgc;

    // ---- everything is valid: from here on the call either completes or skips as a whole ----
    double grad_norm = -1.0, coef = 1.0;
    const double scale = o.grad_scale;
    bool skip = o.skip_flag != nullptr && *o.skip_flag != 0.0f;
    if ((o.clip == kGaClipGlobalNorm && o.clip_coef == nullptr) || o.skip_nonfinite) {
      const double s = list_sumsq(t.accumulators);
      grad_norm = std::sqrt(s) * std::fabs(scale);
      if (o.skip_nonfinite && !std::isfinite(grad_norm)) skip = true;
    }
    if (o.clip == kGaClipGlobalNorm) {
      coef = o.clip_coef ? static_cast<double>(*o.clip_coef)
                         : formulas::global_clip_coef(grad_norm, o.max_norm);
    }
    std::vector<float> unit_scale;
    std::vector<double> unit_scale64;
    std::vector<int64_t> unit_offset;
    // An empty tensor may declare any number of units; it has nothing to scale.
    auto units_of = [&](int64_t i) {
      return t.accumulators.tensors[i].numel == 0 ? int64_t{0} : o.units[i].num_units;
    };
    if (agc && !skip) {
      int64_t total = 0;
      unit_offset.resize(static_cast<size_t>(t.accumulators.size));
      for (int64_t i = 0; i < t.accumulators.size; ++i) {
        unit_offset[i] = total;
        const int64_t n = units_of(i);
        total = n <= INT64_MAX - total ? total + n : checked_add(total, n, item("units", i));
      }
      unit_scale.resize(static_cast<size_t>(total));
      unit_scale64.resize(static_cast<size_t>(total));
      std::vector<double> ps, gs;
      for (int64_t i = 0; i < t.accumulators.size; ++i) {
        const int64_t nu = units_of(i);
        if (nu == 0) continue;
        ps.assign(nu, 0.0);
        gs.assign(nu, 0.0);
        cpu_kernels().unit_sumsq(UnitSumsqArgs{t.params.tensors[i], o.units[i], ps.data()});
        cpu_kernels().unit_sumsq(UnitSumsqArgs{t.accumulators.tensors[i], o.units[i], gs.data()});
        for (int64_t u = 0; u < nu; ++u) {
          const double gn = std::sqrt(gs[u]) * std::fabs(scale);
          if (o.skip_nonfinite && !std::isfinite(gn)) skip = true;
          const double c = formulas::agc_unit_coef(std::sqrt(ps[u]), gn, o.clip_factor, o.agc_eps);
          unit_scale[unit_offset[i] + u] = static_cast<float>(scale * c);
          unit_scale64[unit_offset[i] + u] = scale * c;
        }
      }
    }
    static thread_local std::vector<Chunk> chunks;
    make_chunks(t.accumulators, chunks);
    ApplyArgs a{&t,
                &o,
                static_cast<float>(scale * coef),
                agc ? unit_scale.data() : nullptr,
                agc ? unit_offset.data() : nullptr,
                chunks.data(),
                static_cast<int64_t>(chunks.size())};
    a.grad_scale64 = scale * coef;
    a.unit_scale64 = agc ? unit_scale64.data() : nullptr;
    // With a step counter per tensor, the chunks go in runs of one step (Adam's bias
    // corrections are the kernels' only per-step scalars); otherwise one run of `o.step`.
    static thread_local std::vector<StepRun> runs;
    step_runs(o, chunks, runs);
    auto each_run = [&](auto&& fn) {
      for (StepRun& r : runs) {
        ga_apply_options run_o = o;
        run_o.step = r.step;
        a.o = &run_o;
        a.chunks = r.chunks.empty() ? chunks.data() : r.chunks.data();
        a.num_chunks = r.chunks.empty() ? static_cast<int64_t>(chunks.size())
                                        : static_cast<int64_t>(r.chunks.size());
        fn();
      }
      a.o = &o;
    };
    if (o.skip_nonfinite && !skip && !chunks.empty()) {
      // A finite gradient can still give a non-finite result (an overflowing product, Adam's
      // g², a float16 state out of range): compute every value the update would store, store
      // none, and skip the whole call if one is not finite.
      static thread_local std::vector<uint8_t> bad;
      each_run([&] {
        bad.assign(static_cast<size_t>(a.num_chunks), 0);
        a.chunk_nonfinite = bad.data();
        cpu_kernels().apply(a);
        a.chunk_nonfinite = nullptr;
        for (uint8_t b : bad) skip = skip || b != 0;
      });
    }
    if (result) {
      result->skipped = skip ? 1 : 0;
      result->grad_norm = grad_norm;
      result->clip_coef = o.clip == kGaClipGlobalNorm ? coef : (grad_norm >= 0 ? 1.0 : -1.0);
    }
    if (skip) {
      if (o.reset)
        for (int64_t i = 0; i < t.accumulators.size; ++i)
          cpu_kernels().zero(t.accumulators.tensors[i]);
      return;
    }
    if (!chunks.empty()) each_run([&] { cpu_kernels().apply(a); });
    if (o.step_counters != nullptr)
      for (int64_t i = 0; i < t.accumulators.size; ++i) *o.step_counters[i] += 1.0f;
  });
}

}  // namespace detail
}  // namespace ga

extern "C" ga_status ga_apply(const ga_apply_tensors* tensors, const ga_apply_options* options,
                              ga_apply_result* result) {
  return run_apply(tensors, options, result, "accumulators", "params");
}

namespace ga {

ga_status apply_lists_checked(const ga_apply_tensors* tensors, const ga_apply_options* options,
                              ga_apply_result* result) {
  return detail::run_apply_lists_checked(tensors, options, result, "accumulators", "params", true);
}

}  // namespace ga
