// The CUDA op families: the functors each kernel applies, and the host pipelines that validate,
// group tensors into launches and enqueue them. The pipelines are templates over a Backend —
// CudaBackend (launch.cuh) launches real kernels on a stream; the test suite's HostBackend runs
// the same functors on the host — so everything here but the launch itself is tested without a
// GPU.
//
// A Backend provides:
//   int max_blocks()                                   grid cap of the chunked kernels
//   char* workspace(size_t bytes)                      scratch device memory for this call
//   void zero_bytes(void* p, size_t bytes)             asynchronous memset
//   chunks<Reduce>(meta, op, num_chunks, partials, flag)
//                                                      op.run over every chunk; with Reduce, one
//                                                      fp64 partial per chunk at
//                                                      partials[out_base[t] + chunk of t]; a thread
//                                                      that saw a non-finite value sets *flag = 1
//   unit_sums<T0, T1>(meta, num_tasks, out0, out1)     per-unit Σx² (device_common.cuh)
//   for_each(n, f)                                     f(i) for i in [0, n)
//   sum_partials(partials, n, post)                    post(Σ partials), summed in a fixed order
#ifndef GRADIENT_ACCUMULATOR_CUDA_OPS_H_
#define GRADIENT_ACCUMULATOR_CUDA_OPS_H_

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "../core/internal.h"
#include "device_common.cuh"
#include "gradient_accumulator/cuda.h"

namespace ga {
namespace cuda {

// ======================= functors (run on the device, or on the host in tests) ==============

/// How the chunked kernels' grid is sized (an op's kGrid, else kResident):
///   kResident — as many blocks as the SMs can hold at once, each walking chunks grid-stride;
///   kPerChunk — one block per chunk: blocks start in chunk order, so the chunks in flight stay
///               a narrow window of memory;
///   kTwoPerSm — two blocks per SM (at most the resident count), walking chunks grid-stride: for
///               kernels whose many lists put more bytes in flight than DRAM serves best.
/// Results do not depend on it: a chunk's work and its partial sum are fixed by the chunk alone.
/// The choices are measurements (benchmarks/cuda/accumulate_variants.cu on an H200,
/// benchmarks/README.md), not derivations.
enum class Grid { kResident, kPerChunk, kTwoPerSm };

template <typename Op, typename = void>
struct grid_of {
  static constexpr Grid value = Grid::kResident;
};
template <typename Op>
struct grid_of<Op, std::void_t<decltype(Op::kGrid)>> {
  static constexpr Grid value = Op::kGrid;
};

// Each functor's run<U, W>(meta, tensor, i, stride, state) handles a fragment (device_common.cuh):
// U runs of W elements, run k at i + k·stride. It loads every list of the fragment first, then
// computes, then stores; kUnroll is the U of the fragments chunk_thread hands it, chosen so that
// the loads in flight per thread cover the memory latency without spilling registers.

// Vectors per list a thread of the accumulate kernel has in flight. GA_CUDA_ACCUMULATE_UNROLL
// changes it for an experiment build only (benchmarks/cuda/accumulate_variants.cu).
#ifndef GA_CUDA_ACCUMULATE_UNROLL
#define GA_CUDA_ACCUMULATE_UNROLL 1
#endif

template <typename G>
struct AccumulateOp {  // lists: 0 accumulator (fp32), 1 gradient (G)
  // One vector per list and one block per chunk (Grid, above), the fastest pair measured on
  // an H200 (benchmarks/README.md, the kernels' grids): 1.05x the copy floor at 1B elements,
  // where 4 vectors on a resident grid (the earlier choice) ran at 1.24x.
  static constexpr int kUnroll = GA_CUDA_ACCUMULATE_UNROLL;
  static constexpr Grid kGrid = Grid::kPerChunk;
  float alpha, beta;
  int overwrite, want_sumsq;
  template <int U, int W, int L>
  GA_HD double run(const Meta<L>& m, int t, int64_t i, int64_t stride, ThreadState& st) const {
    constexpr int N = U * W;
    float* acc = static_cast<float*>(m.ptr[0][t]) + i;
    const G* g = static_cast<const G*>(m.ptr[1][t]) + i;
    float x[N], a[N];
    load_frag<U, W>(g, stride, x);
    if (!overwrite) load_frag<U, W>(acc, stride, a);
    double s = 0.0;
    for (int k = 0; k < N; ++k) {
      st.bad |= !is_finite(x[k]);
      if (overwrite)
        a[k] = beta * x[k];
      else
        a[k] = alpha == 1.0f ? fma_f(beta, x[k], a[k]) : fma_f(beta, x[k], alpha * a[k]);
      if (want_sumsq) s += static_cast<double>(a[k]) * a[k];
    }
    store_frag<U, W>(acc, stride, a);
    return s;
  }
};

template <typename T>
struct SumsqOp {  // list 0: the tensor
  static constexpr int kUnroll = 4;
  template <int U, int W, int L>
  GA_HD double run(const Meta<L>& m, int t, int64_t i, int64_t stride, ThreadState&) const {
    float x[U * W];
    load_frag<U, W>(static_cast<const T*>(m.ptr[0][t]) + i, stride, x);
    double s = 0.0;
    for (int k = 0; k < U * W; ++k) s += static_cast<double>(x[k]) * x[k];
    return s;
  }
};

template <typename T>
struct ZeroOp {  // list 0: the tensor
  static constexpr int kUnroll = 4;
  template <int U, int W, int L>
  GA_HD double run(const Meta<L>& m, int t, int64_t i, int64_t stride, ThreadState&) const {
    float z[U * W];
    for (int k = 0; k < U * W; ++k) z[k] = 0.0f;
    store_frag<U, W>(static_cast<T*>(m.ptr[0][t]) + i, stride, z);
    return 0.0;
  }
};

enum class Opt { kNone, kSGD, kAdam, kAdamW };

/// Scalars of the fused apply: the optimizer's, rounded to fp32 on the host exactly as the CPU
/// kernels round them, and the gradient scale.
struct ApplyScalars : formulas::OptimizerScalars<float> {
  double grad_scale;
};

/// The fused apply: scale (·clip coefficient, read from device memory) → optimizer update →
/// reset; or, when a skip flag in device memory is set, only the reset.
/// Lists: 0 params (P), 1 accumulators (fp32), 2 state1 (S), 3 state2 (S), 4 grads_out (OutT).
template <Opt O, bool Momentum, bool Reset, bool Agc, typename P, typename S, typename OutT>
struct ApplyOp {
  // One vector per list: Adam's four fp32 lists already put 8 × 16 bytes in flight per thread,
  // and every further vector would multiply the code of the many apply variants (compile time).
  static constexpr int kUnroll = 1;
  // Adam/AdamW (eight 16-byte accesses per thread): 1.10x the copy floor on two blocks per SM,
  // 1.17x on the resident grid of three. The other optimizers keep the resident grid (not
  // measured otherwise).
  static constexpr Grid kGrid =
      O == Opt::kAdam || O == Opt::kAdamW ? Grid::kTwoPerSm : Grid::kResident;
  ApplyScalars k;
  const double* coef64;     // clip coefficient computed by the norm pass, or null
  const float* coef32;      // clip coefficient given by the caller, or null
  const float* skip0;       // caller's skip flag, or null
  const float* skip1;       // the norm pass's skip flag, or null
  const float* unit_scale;  // AGC: grad_scale · coefficient of every unit
  int in_place;             // kNone without grads_out: write the gradient into the accumulator
  const float* adam_dev;    // Adam: {step_size, bc2_sqrt} of each tensor's step counter, or null

  template <int U, int W, int L>
  GA_HD double run(const Meta<L>& m, int t, int64_t i, int64_t stride, ThreadState&) const {
    constexpr int N = U * W;
    float* acc = static_cast<float*>(m.ptr[1][t]) + i;
    const bool skip = (skip0 != nullptr && *skip0 != 0.0f) || (skip1 != nullptr && *skip1 != 0.0f);
    float zero[N];
    for (int e = 0; e < N; ++e) zero[e] = 0.0f;
    if (skip) {
      if (Reset) store_frag<U, W>(acc, stride, zero);
      return 0.0;
    }
    float g[N];
    load_frag<U, W>(acc, stride, g);
    if constexpr (Agc) {
      const int64_t nu = m.num_units[t], fan = m.fan_in[t];
      const float* us = unit_scale + m.out_base[t];
      const bool trailing = (m.trailing >> t) & 1u;
      for (int q = 0; q < U; ++q) {
        const int64_t j = i + q * stride;
        int64_t u = nu == 1 ? 0 : (trailing ? j % nu : j / fan);
        int64_t r = (nu == 1 || trailing) ? 0 : j % fan;
        for (int e = q * W; e < (q + 1) * W; ++e) {
          g[e] *= us[u];
          if (nu == 1) continue;
          if (trailing) {
            if (++u == nu) u = 0;
          } else if (++r == fan) {
            r = 0;
            ++u;
          }
        }
      }
    } else {
      const float sc = static_cast<float>(
          coef64 != nullptr
              ? k.grad_scale * *coef64
              : (coef32 != nullptr ? k.grad_scale * static_cast<double>(*coef32) : k.grad_scale));
      for (int e = 0; e < N; ++e) g[e] *= sc;
    }
    for (int e = 0; e < N; ++e) g[e] = k.maximize ? -g[e] : g[e];
    if constexpr (O == Opt::kNone) {
      if (in_place)
        store_frag<U, W>(reinterpret_cast<OutT*>(acc), stride, g);
      else
        store_frag<U, W>(static_cast<OutT*>(m.ptr[4][t]) + i, stride, g);
    } else if constexpr (O == Opt::kSGD) {
      P* p = static_cast<P*>(m.ptr[0][t]) + i;
      float w[N], b[N];
      load_frag<U, W>(p, stride, w);
      if (Momentum && !k.first_momentum)
        load_frag<U, W>(static_cast<const S*>(m.ptr[2][t]) + i, stride, b);
      for (int e = 0; e < N; ++e) {
        float gg = k.has_wd ? fma_f(k.wd, w[e], g[e]) : g[e];
        if (Momentum) {
          b[e] = k.first_momentum ? gg : fma_f(k.momentum, b[e], k.one_minus_dampening * gg);
          gg = k.nesterov ? fma_f(k.momentum, b[e], gg) : b[e];
        }
        w[e] = fma_f(-k.lr, gg, w[e]);
      }
      if (Momentum) store_frag<U, W>(static_cast<S*>(m.ptr[2][t]) + i, stride, b);
      store_frag<U, W>(p, stride, w);
    } else {
      P* p = static_cast<P*>(m.ptr[0][t]) + i;
      S* s1 = static_cast<S*>(m.ptr[2][t]) + i;
      S* s2 = static_cast<S*>(m.ptr[3][t]) + i;
      float w[N], mm[N], v[N];
      load_frag<U, W>(p, stride, w);
      load_frag<U, W>(s1, stride, mm);
      load_frag<U, W>(s2, stride, v);
      const float step_size = adam_dev != nullptr ? adam_dev[2 * t] : k.step_size;
      const float bc2_sqrt = adam_dev != nullptr ? adam_dev[2 * t + 1] : k.bc2_sqrt;
      for (int e = 0; e < N; ++e) {
        float gg = g[e];
        if constexpr (O == Opt::kAdam) {
          gg = k.has_wd ? fma_f(k.wd, w[e], gg) : gg;
        } else {
          w[e] = w[e] * k.adamw_decay;
        }
        mm[e] = fma_f(k.beta1c, gg - mm[e], mm[e]);
        v[e] = fma_f(k.beta2, v[e], k.one_minus_beta2 * gg * gg);
        const float denom = div_f(sqrt_f(v[e]), bc2_sqrt) + k.adam_eps;
        w[e] = w[e] - step_size * div_f(mm[e], denom);
      }
      store_frag<U, W>(s1, stride, mm);
      store_frag<U, W>(s2, stride, v);
      store_frag<U, W>(p, stride, w);
    }
    if (Reset) store_frag<U, W>(acc, stride, zero);
    return 0.0;
  }
};

/// Per-unit AGC factor: unit_scale[u] = grad_scale · min(1, λ·max(‖w_u‖, ε) / max(‖g_u‖, 1e-6)).
struct AgcScaleOp {
  const double* sum_w;  // Σ w² per unit
  const double* sum_g;  // Σ acc² per unit
  float* unit_scale;
  double scale, clip_factor, eps;
  GA_HD void operator()(int64_t u) const {
    const double gn = std::sqrt(sum_g[u]) * std::fabs(scale);
    const double c = formulas::agc_unit_coef(std::sqrt(sum_w[u]), gn, clip_factor, eps);
    unit_scale[u] = static_cast<float>(scale * c);
  }
};

/// norms[u] = sqrt(Σ x² of unit u), as fp32 or fp64.
struct SqrtToOp {
  const double* sums;
  void* out;
  int out_is_double;
  GA_HD void operator()(int64_t u) const {
    const double v = std::sqrt(sums[u]);
    if (out_is_double)
      static_cast<double*>(out)[u] = v;
    else
      static_cast<float*>(out)[u] = static_cast<float>(v);
  }
};

/// Writes a finished sum to device memory.
struct StoreSumPost {
  double* out;
  GA_HD void operator()(double total) const { *out = total; }
};

/// Turns the accumulators' Σ acc² into the apply's norm, clip coefficient and skip decision.
struct NormPost {
  double scale, max_norm;
  int clip_global, coef_given, skip_nonfinite;
  const float* given_coef;     // the caller's coefficient (clip_global with coef_given)
  const float* skip_flag;      // the caller's skip flag, or null
  double* coef64;              // out: coefficient for the apply
  float* skip;                 // out: 1 if the update is skipped
  ga_cuda_apply_stats* stats;  // out: may be null
  GA_HD void operator()(double total) const {
    const double norm = std::sqrt(total) * std::fabs(scale);
    bool skipped = skip_nonfinite && !std::isfinite(norm);
    double coef = 1.0;
    if (clip_global)
      coef = coef_given ? static_cast<double>(*given_coef)
                        : formulas::global_clip_coef(norm, max_norm);
    *coef64 = coef;
    *skip = skipped ? 1.0f : 0.0f;
    if (stats != nullptr) {
      stats->grad_norm = static_cast<float>(norm);
      stats->clip_coef = static_cast<float>(coef);
      stats->skipped = (skipped || (skip_flag != nullptr && *skip_flag != 0.0f)) ? 1.0f : 0.0f;
    }
  }
};

/// Adam's step counters in device memory, one per tensor of a launch (torch's `step`): each
/// advanced by one only when the update is applied (no skip flag set), and the bias corrections
/// of its new step written for the launch's apply (out[2t], out[2t + 1]), with the arithmetic of
/// formulas::optimizer_scalars. A skipped update leaves every counter as it was.
struct StepCountersOp {
  double lr, beta1, beta2;
  const float* skip0;  // the caller's skip flag, or null
  const float* skip1;  // the norm pass's skip flag, or null
  float* step[kMaxTensors];
  float* out;  // {step_size, bc2_sqrt} of every tensor of the launch
  GA_HD void operator()(int64_t t) const {
    const bool skipped =
        (skip0 != nullptr && *skip0 != 0.0f) || (skip1 != nullptr && *skip1 != 0.0f);
    if (skipped) return;  // the apply is a no-op and reads neither value
    const float s = *step[t] + 1.0f;
    *step[t] = s;
    const double bc1 = 1.0 - std::pow(beta1, static_cast<double>(s));
    const double bc2 = 1.0 - std::pow(beta2, static_cast<double>(s));
    out[2 * t] = static_cast<float>(lr / bc1);
    out[2 * t + 1] = static_cast<float>(std::sqrt(bc2));
  }
};

/// Stats of an apply without a norm pass.
struct StatsOp {
  const float* given_coef;
  const float* skip_flag;
  ga_cuda_apply_stats* stats;
  GA_HD void operator()(int64_t) const {
    stats->grad_norm = -1.0f;
    stats->clip_coef = given_coef != nullptr ? *given_coef : 1.0f;
    stats->skipped = (skip_flag != nullptr && *skip_flag != 0.0f) ? 1.0f : 0.0f;
  }
};

GA_HD double stat_get(const void* p, int is_double, int64_t c) {
  return is_double ? static_cast<const double*>(p)[c] : static_cast<const float*>(p)[c];
}
GA_HD void stat_put(void* p, int is_double, int64_t c, double v) {
  if (is_double)
    static_cast<double*>(p)[c] = v;
  else
    static_cast<float*>(p)[c] = static_cast<float>(v);
}

/// Chan's merge of (n_b, mean_b, M2_b) into (n_a, mean_a, M2_a), per channel.
struct BnMergeOp {
  void* mean_a;
  void* m2_a;
  const void* mean_b;
  const void* m2_b;
  int d_mean_a, d_m2_a, d_mean_b, d_m2_b;  // 1: float64
  double na, nb;
  GA_HD void operator()(int64_t c) const {
    const formulas::Moments m =
        formulas::chan_merge(na, stat_get(mean_a, d_mean_a, c), stat_get(m2_a, d_m2_a, c), nb,
                             stat_get(mean_b, d_mean_b, c), stat_get(m2_b, d_m2_b, c));
    stat_put(mean_a, d_mean_a, c, m.mean);
    stat_put(m2_a, d_m2_a, c, m.m2);
  }
};

/// running ← (1 − w)·running + w·batch, per channel.
struct BnRunningOp {
  void* rmean;
  void* rvar;
  const void* mean;
  const void* m2;
  int d_rmean, d_rvar, d_mean, d_m2;
  double div, new_weight;
  GA_HD void operator()(int64_t c) const {
    const double var = stat_get(m2, d_m2, c) / div;
    stat_put(rmean, d_rmean, c,
             formulas::running_update(stat_get(rmean, d_rmean, c), stat_get(mean, d_mean, c),
                                      new_weight));
    stat_put(rvar, d_rvar, c, formulas::running_update(stat_get(rvar, d_rvar, c), var, new_weight));
  }
};

// ======================= host side: grouping, metadata, pipelines ===========================

using detail::fail;
using detail::item;

inline int64_t chunks_of(int64_t numel) { return (numel + kChunk - 1) / kChunk; }

/// Tensor indices split into launches: same key (dtype combination), at most kMaxTensors each,
/// empty tensors dropped; the order within a key is the list order.
template <typename KeyFn>
std::vector<std::vector<int64_t>> group(int64_t n, const ga_tensor_list& sizes, KeyFn key) {
  std::map<decltype(key(0)), std::vector<std::vector<int64_t>>> by_key;
  std::vector<decltype(key(0))> order;
  for (int64_t i = 0; i < n; ++i) {
    if (sizes.tensors[i].numel == 0) continue;
    auto k = key(i);
    auto& launches = by_key[k];
    if (launches.empty()) order.push_back(k);
    if (launches.empty() || launches.back().size() == static_cast<size_t>(kMaxTensors))
      launches.emplace_back();
    launches.back().push_back(i);
  }
  std::vector<std::vector<int64_t>> out;
  for (const auto& k : order)
    for (auto& l : by_key[k]) out.push_back(std::move(l));
  return out;
}

/// Metadata of one launch over tensors `idx` of the L lists (a null list leaves its pointers
/// null). Work items are chunks; `out_base[t]` is `chunk_base[idx[t]]`.
template <int L>
Meta<L> chunk_meta(const std::vector<int64_t>& idx, const ga_tensor_list* const (&lists)[L],
                   const std::vector<int64_t>& chunk_base, int64_t* num_chunks) {
  Meta<L> m{};
  m.num_tensors = static_cast<int32_t>(idx.size());
  int64_t c = 0;
  for (size_t t = 0; t < idx.size(); ++t) {
    const void* ptrs[L] = {};
    int sizes[L] = {};
    for (int l = 0; l < L; ++l) {
      if (lists[l] == nullptr || lists[l]->size == 0) continue;
      const ga_tensor& x = lists[l]->tensors[idx[t]];
      m.ptr[l][t] = x.data;
      ptrs[l] = x.data;
      sizes[l] = static_cast<int>(ga_dtype_size(x.dtype));
    }
    const ga_tensor& first = lists[0] && lists[0]->size ? lists[0]->tensors[idx[t]]
                                                        : lists[L > 1 ? 1 : 0]->tensors[idx[t]];
    m.numel[t] = first.numel;
    m.head[t] = static_cast<int8_t>(vec_head(ptrs, sizes, L));
    m.start[t] = static_cast<int32_t>(c);
    m.out_base[t] = chunk_base.empty() ? 0 : static_cast<int32_t>(chunk_base[idx[t]]);
    c += chunks_of(first.numel);
  }
  m.start[idx.size()] = static_cast<int32_t>(c);
  *num_chunks = c;
  return m;
}

/// First chunk of every tensor of the list in the call's chunk order (the order partial sums
/// are added in), and the total.
inline std::vector<int64_t> chunk_bases(const ga_tensor_list& l, int64_t* total) {
  std::vector<int64_t> base(static_cast<size_t>(l.size));
  int64_t c = 0;
  for (int64_t i = 0; i < l.size; ++i) {
    base[i] = c;
    c += chunks_of(l.tensors[i].numel);
  }
  *total = c;
  return base;
}

template <typename F>
void visit_float(ga_dtype d, F&& f) {
  switch (d) {
    case kGaFloat32:
      f(float{});
      break;
    case kGaBFloat16:
      f(bf16{});
      break;
    case kGaFloat16:
      f(f16{});
      break;
    default:
      break;  // validated earlier
  }
}

inline void check_cuda_dtypes(const ga_tensor_list& l, const char* name) {
  detail::check_list_dtype_in(l, name, {kGaFloat32, kGaBFloat16, kGaFloat16});
}

/// Workspace bytes rounded up to 256 so that every carved array stays aligned.
inline size_t round_up(size_t b) { return (b + 255) / 256 * 256; }

/// Σ x² of `list` into device double `out` (chunk partials, then one fixed-order sum).
template <typename B>
void enqueue_sumsq(B& b, const ga_tensor_list& list, double* out) {
  int64_t total = 0;
  std::vector<int64_t> base = chunk_bases(list, &total);
  if (total == 0) {
    b.zero_bytes(out, sizeof(double));
    return;
  }
  double* partials = reinterpret_cast<double*>(b.workspace(round_up(total * sizeof(double))));
  const ga_tensor_list* lists[1] = {&list};
  for (const auto& idx : group(list.size, list, [&](int64_t i) { return list.tensors[i].dtype; })) {
    int64_t n = 0;
    Meta<1> m = chunk_meta<1>(idx, lists, base, &n);
    visit_float(list.tensors[idx[0]].dtype, [&](auto tv) {
      b.template chunks<true>(m, SumsqOp<decltype(tv)>{}, n, partials, nullptr);
    });
  }
  b.sum_partials(partials, total, StoreSumPost{out});
}

template <typename B>
ga_status accumulate(B& b, ga_tensor_list accumulators, ga_tensor_list grads,
                     const ga_accumulate_options* options, float* nonfinite_flag, double* sumsq) {
  return detail::guarded([&] {
    double alpha = 1.0, beta = 1.0;
    detail::validate_accumulate(accumulators, grads, options, kGaCUDA, &alpha, &beta);
    int64_t total = 0;
    std::vector<int64_t> base = chunk_bases(accumulators, &total);
    double* partials = nullptr;
    if (sumsq != nullptr) {
      if (total == 0) {
        b.zero_bytes(sumsq, sizeof(double));
        return;
      }
      partials = reinterpret_cast<double*>(b.workspace(round_up(total * sizeof(double))));
    }
    const ga_tensor_list* lists[2] = {&accumulators, &grads};
    for (const auto& idx : group(accumulators.size, accumulators,
                                 [&](int64_t i) { return grads.tensors[i].dtype; })) {
      int64_t n = 0;
      Meta<2> m = chunk_meta<2>(idx, lists, base, &n);
      visit_float(grads.tensors[idx[0]].dtype, [&](auto gv) {
        AccumulateOp<decltype(gv)> op{static_cast<float>(alpha), static_cast<float>(beta),
                                      options->overwrite != 0, sumsq != nullptr};
        if (sumsq != nullptr)
          b.template chunks<true>(m, op, n, partials, nonfinite_flag);
        else
          b.template chunks<false>(m, op, n, nullptr, nonfinite_flag);
      });
    }
    if (sumsq != nullptr) b.sum_partials(partials, total, StoreSumPost{sumsq});
  });
}

template <typename B>
ga_status sum_of_squares(B& b, ga_tensor_list tensors, double* sumsq) {
  return detail::guarded([&] {
    if (sumsq == nullptr) fail(kGaInvalidArgument, "sumsq", "sumsq is null");
    detail::check_list(tensors, "tensors");
    check_cuda_dtypes(tensors, "tensors");
    int32_t device = -1;
    detail::check_all_cuda({{&tensors, "tensors"}}, &device);
    enqueue_sumsq(b, tensors, sumsq);
  });
}

/// Per-unit Σ x² of list 0 (and list 1) into out0 (out1), units numbered across the lists'
/// tensors in order from 0.
template <typename B, int L>
void enqueue_unit_sums(B& b, const ga_tensor_list* const (&lists)[L], const ga_units* units,
                       const std::vector<int64_t>& unit_base, double* out0, double* out1) {
  const ga_tensor_list& l0 = *lists[0];
  auto key = [&](int64_t i) {
    return std::make_pair(l0.tensors[i].dtype, L > 1 ? lists[L - 1]->tensors[i].dtype : kGaFloat32);
  };
  for (const auto& idx : group(l0.size, l0, key)) {
    Meta<L> m{};
    m.num_tensors = static_cast<int32_t>(idx.size());
    int64_t tasks = 0;
    for (size_t t = 0; t < idx.size(); ++t) {
      const int64_t i = idx[t];
      const void* ptrs[L] = {};
      int sizes[L] = {};
      for (int l = 0; l < L; ++l) {
        m.ptr[l][t] = lists[l]->tensors[i].data;
        ptrs[l] = m.ptr[l][t];
        sizes[l] = static_cast<int>(ga_dtype_size(lists[l]->tensors[i].dtype));
      }
      m.head[t] = static_cast<int8_t>(vec_head(ptrs, sizes, L));
      const int64_t nu = units[i].num_units;
      const bool trailing = units[i].layout == kGaUnitsTrailing && nu > 1;
      m.numel[t] = l0.tensors[i].numel;
      m.num_units[t] = nu;
      m.fan_in[t] = l0.tensors[i].numel / nu;
      if (trailing) m.trailing |= uint64_t(1) << t;
      m.start[t] = static_cast<int32_t>(tasks);
      m.out_base[t] = static_cast<int32_t>(unit_base[i]);
      tasks += trailing ? (nu + kWarp - 1) / kWarp : nu;
    }
    m.start[idx.size()] = static_cast<int32_t>(tasks);
    visit_float(l0.tensors[idx[0]].dtype, [&](auto t0) {
      visit_float(lists[L - 1]->tensors[idx[0]].dtype, [&](auto t1) {
        b.template unit_sums<decltype(t0), decltype(t1)>(m, tasks, out0, out1);
      });
    });
  }
}

template <typename B>
ga_status unitwise_norm(B& b, ga_tensor tensor, ga_units units, ga_tensor norms) {
  return detail::guarded([&] {
    detail::validate_unitwise_norm(tensor, units, norms, kGaCUDA);
    const ga_tensor_list one{&tensor, 1};
    detail::check_list_dtype_in(one, "tensor", {kGaFloat32, kGaBFloat16, kGaFloat16});
    if (units.num_units == 0) return;
    double* sums = reinterpret_cast<double*>(
        b.workspace(round_up(static_cast<size_t>(units.num_units) * sizeof(double))));
    if (tensor.numel == 0) {
      b.zero_bytes(sums, units.num_units * sizeof(double));
    } else {
      const ga_tensor_list* lists[1] = {&one};
      enqueue_unit_sums<B, 1>(b, lists, &units, {0}, sums, nullptr);
    }
    b.for_each(units.num_units, SqrtToOp{sums, norms.data, norms.dtype == kGaFloat64});
  });
}

inline ApplyScalars apply_scalars(const ga_apply_options& o) {
  return ApplyScalars{formulas::optimizer_scalars<float>(o), o.grad_scale};
}

/// Launch the apply for one group: pick the template variant from the runtime flags.
template <Opt O, typename B, typename P, typename S, typename OutT, typename Base>
void launch_apply(B& b, const Meta<5>& m, int64_t n, const Base& base, bool momentum, bool reset,
                  bool agc) {
  auto go = [&](auto mom, auto rst, auto ag) {
    ApplyOp<O, decltype(mom)::value, decltype(rst)::value, decltype(ag)::value, P, S, OutT> op{
        base.k,     base.coef64,     base.coef32,   base.skip0,
        base.skip1, base.unit_scale, base.in_place, base.adam_dev};
    b.template chunks<false>(m, op, n, nullptr, nullptr);
  };
  using T = std::true_type;
  using F = std::false_type;
  auto with_agc = [&](auto mom, auto rst) {
    if (agc)
      go(mom, rst, T{});
    else
      go(mom, rst, F{});
  };
  auto with_reset = [&](auto mom) {
    if (reset)
      with_agc(mom, T{});
    else
      with_agc(mom, F{});
  };
  if (O == Opt::kSGD && momentum)
    with_reset(T{});
  else
    with_reset(F{});
}

struct ApplyBase {
  ApplyScalars k;
  const double* coef64;
  const float* coef32;
  const float* skip0;
  const float* skip1;
  const float* unit_scale;
  int in_place;
  const float* adam_dev;
};

/// Which optimizers an instantiation of apply() can launch, one bit per ga_optimizer. Every
/// optimizer multiplies the kernels compiled (dtypes × momentum/reset/AGC variants), so the CUDA
/// build instantiates disjoint sets in different translation units, which compile in parallel.
enum OptimizerSet : unsigned {
  kSetNone = 1u << kGaOptimizerNone,
  kSetSGD = 1u << kGaOptimizerSGD,
  kSetAdam = 1u << kGaOptimizerAdam,
  kSetAdamW = 1u << kGaOptimizerAdamW,
  kSetAll = kSetNone | kSetSGD | kSetAdam | kSetAdamW,
};

template <typename B, unsigned Set = kSetAll>
ga_status apply(B& b, const ga_apply_tensors* tp, const ga_apply_options* op,
                const float* skip_flag, ga_cuda_apply_stats* stats, const char* acc_name,
                const char* param_name) {
  return detail::guarded([&] {
    if (tp == nullptr) fail(kGaInvalidArgument, "tensors", "tensors is null");
    if (op == nullptr) fail(kGaInvalidArgument, "options", "options is null");
    const ga_apply_tensors& t = *tp;
    const ga_apply_options& o = *op;
    detail::validate_apply(t, o, acc_name, param_name, kGaCUDA);
    if (skip_flag != nullptr && o.skip_flag != nullptr)
      fail(kGaInvalidArgument, "skip_flag", "skip_flag is given twice (argument and options)");
    if (skip_flag == nullptr) skip_flag = o.skip_flag;
    if (((1u << o.optimizer) & Set) == 0)
      fail(kGaRuntimeError, "", "internal: this apply() was not compiled for the optimizer");
    const bool update = o.optimizer != kGaOptimizerNone;
    const bool agc = o.clip == kGaClipAgc;
    const bool momentum = o.optimizer == kGaOptimizerSGD && o.momentum != 0.0;
    const int64_t n = t.accumulators.size;

    // ---- workspace: [coef64 | skip | pad | adam_dev[2 · kMaxTensors]][partials][unit sums w |
    // unit sums g][unit scales] ----
    const bool norm_pass =
        (o.clip == kGaClipGlobalNorm && o.clip_coef == nullptr) || o.skip_nonfinite;
    int64_t total_chunks = 0;
    std::vector<int64_t> cbase = chunk_bases(t.accumulators, &total_chunks);
    std::vector<int64_t> ubase(static_cast<size_t>(n));
    int64_t total_units = 0;
    if (agc)
      for (int64_t i = 0; i < n; ++i) {
        ubase[i] = total_units;
        total_units += o.units[i].num_units;
      }
    const size_t head = round_up(16 + 2 * kMaxTensors * sizeof(float));
    const size_t part_bytes = norm_pass ? round_up(std::max<int64_t>(total_chunks, 1) * 8) : 0;
    const size_t unit_bytes = agc ? round_up(std::max<int64_t>(total_units, 1) * 8) : 0;
    const size_t scale_bytes = agc ? round_up(std::max<int64_t>(total_units, 1) * 4) : 0;
    char* ws = b.workspace(head + part_bytes + 2 * unit_bytes + scale_bytes);
    double* coef64 = reinterpret_cast<double*>(ws);
    float* skip = reinterpret_cast<float*>(ws + 8);
    float* adam_dev = reinterpret_cast<float*>(ws + 16);
    double* partials = reinterpret_cast<double*>(ws + head);
    double* sum_w = reinterpret_cast<double*>(ws + head + part_bytes);
    double* sum_g = reinterpret_cast<double*>(ws + head + part_bytes + unit_bytes);
    float* unit_scale = reinterpret_cast<float*>(ws + head + part_bytes + 2 * unit_bytes);

    if (norm_pass) {
      const ga_tensor_list* lists[1] = {&t.accumulators};
      for (const auto& idx : group(n, t.accumulators, [](int64_t) { return 0; })) {
        int64_t nc = 0;
        Meta<1> m = chunk_meta<1>(idx, lists, cbase, &nc);
        b.template chunks<true>(m, SumsqOp<float>{}, nc, partials, nullptr);
      }
      if (total_chunks == 0) b.zero_bytes(partials, 8);
      NormPost post{o.grad_scale,
                    o.max_norm,
                    o.clip == kGaClipGlobalNorm,
                    o.clip_coef != nullptr,
                    o.skip_nonfinite,
                    o.clip_coef,
                    skip_flag,
                    coef64,
                    skip,
                    stats};
      b.sum_partials(partials, std::max<int64_t>(total_chunks, 1), post);
    } else if (stats != nullptr) {
      b.for_each(1, StatsOp{o.clip_coef, skip_flag, stats});
    }
    if (agc && total_units > 0) {
      const ga_tensor_list* lists[2] = {&t.params, &t.accumulators};
      b.zero_bytes(sum_w, 2 * unit_bytes);  // units of empty tensors stay 0
      enqueue_unit_sums<B, 2>(b, lists, o.units, ubase, sum_w, sum_g);
      b.for_each(total_units,
                 AgcScaleOp{sum_w, sum_g, unit_scale, o.grad_scale, o.clip_factor, o.agc_eps});
    }

    const bool adam = o.optimizer == kGaOptimizerAdam || o.optimizer == kGaOptimizerAdamW;
    // Adam with step counters on the device: o.step is not read; each launch advances its
    // tensors' counters and writes their bias corrections into adam_dev before it runs.
    const bool step_on_device = adam && o.step_counters != nullptr;
    auto advance = [&](const std::vector<int64_t>& idx) {
      StepCountersOp op{o.lr, o.beta1, o.beta2, skip_flag, norm_pass ? skip : nullptr,
                        {},   adam_dev};
      for (size_t j = 0; j < idx.size(); ++j) op.step[j] = o.step_counters[idx[j]];
      b.for_each(static_cast<int64_t>(idx.size()), op);
    };
    ApplyBase base{apply_scalars(o),
                   norm_pass && o.clip == kGaClipGlobalNorm ? coef64 : nullptr,
                   !norm_pass && o.clip == kGaClipGlobalNorm ? o.clip_coef : nullptr,
                   skip_flag,
                   norm_pass ? skip : nullptr,
                   agc ? unit_scale : nullptr,
                   !update && t.grads_out.size == 0,
                   step_on_device ? adam_dev : nullptr};
    const bool has_state = momentum || adam;
    // Lists this call does not use are null (chunk_meta skips them); list 1 is always there.
    const ga_tensor_list* lists[5] = {update || agc ? &t.params : nullptr, &t.accumulators,
                                      has_state ? &t.state1 : nullptr, adam ? &t.state2 : nullptr,
                                      !update ? &t.grads_out : nullptr};
    auto key = [&](int64_t i) {
      const ga_dtype pd = update ? t.params.tensors[i].dtype : kGaFloat32;
      const ga_dtype sd = has_state ? t.state1.tensors[i].dtype : pd;
      const ga_dtype od = (!update && t.grads_out.size) ? t.grads_out.tensors[i].dtype : kGaFloat32;
      return std::make_tuple(pd, sd, od);
    };
    for (const auto& idx : group(n, t.accumulators, key)) {
      int64_t nc = 0;
      Meta<5> m = chunk_meta<5>(idx, lists, {}, &nc);
      if (agc) {
        for (size_t j = 0; j < idx.size(); ++j) {
          const ga_units& u = o.units[idx[j]];
          m.num_units[j] = u.num_units;
          m.fan_in[j] = t.accumulators.tensors[idx[j]].numel / u.num_units;
          m.out_base[j] = static_cast<int32_t>(ubase[idx[j]]);
          if (u.layout == kGaUnitsTrailing && u.num_units > 1) m.trailing |= uint64_t(1) << j;
        }
      }
      if (step_on_device) advance(idx);
      const auto dtypes = key(idx[0]);
      const ga_dtype pd = std::get<0>(dtypes), sd = std::get<1>(dtypes), od = std::get<2>(dtypes);
      visit_float(pd, [&](auto pv) {
        using P = decltype(pv);
        visit_float(sd, [&](auto sv) {
          using S = decltype(sv);
          switch (o.optimizer) {
            case kGaOptimizerNone:
              if constexpr ((Set & kSetNone) != 0)
                visit_float(od, [&](auto ov) {
                  launch_apply<Opt::kNone, B, float, float, decltype(ov)>(b, m, nc, base, false,
                                                                          o.reset, agc);
                });
              break;
            case kGaOptimizerSGD:
              if constexpr ((Set & kSetSGD) != 0)
                launch_apply<Opt::kSGD, B, P, S, float>(b, m, nc, base, momentum, o.reset, agc);
              break;
            case kGaOptimizerAdam:
              if constexpr ((Set & kSetAdam) != 0)
                launch_apply<Opt::kAdam, B, P, S, float>(b, m, nc, base, false, o.reset, agc);
              break;
            case kGaOptimizerAdamW:
              if constexpr ((Set & kSetAdamW) != 0)
                launch_apply<Opt::kAdamW, B, P, S, float>(b, m, nc, base, false, o.reset, agc);
              break;
          }
        });
      });
    }
    if (step_on_device) {  // empty tensors make no launch; their counters advance too
      std::vector<int64_t> empty;
      for (int64_t i = 0; i < n; ++i) {
        if (t.accumulators.tensors[i].numel != 0) continue;
        empty.push_back(i);
        if (empty.size() == static_cast<size_t>(kMaxTensors)) advance(empty), empty.clear();
      }
      if (!empty.empty()) advance(empty);
    }
  });
}

template <typename B>
ga_status adaptive_clip(B& b, ga_tensor_list params, ga_tensor_list grads, const ga_units* units,
                        double clip_factor, double eps) {
  ga_apply_tensors t;
  ga_apply_options o;
  detail::agc_as_apply(params, grads, units, clip_factor, eps, &t, &o);
  return apply<B, kSetNone>(b, &t, &o, nullptr, nullptr, "grads", "params");
}

template <typename B>
ga_status zero(B& b, ga_tensor_list tensors) {
  return detail::guarded([&] {
    detail::check_list(tensors, "tensors");
    check_cuda_dtypes(tensors, "tensors");
    int32_t device = -1;
    detail::check_all_cuda({{&tensors, "tensors"}}, &device);
    const ga_tensor_list* lists[1] = {&tensors};
    for (const auto& idx : group(tensors.size, tensors, [&](int64_t i) {
           return ga_dtype_size(tensors.tensors[i].dtype);
         })) {
      int64_t nc = 0;
      Meta<1> m = chunk_meta<1>(idx, lists, {}, &nc);
      if (ga_dtype_size(tensors.tensors[idx[0]].dtype) == 4)
        b.template chunks<false>(m, ZeroOp<float>{}, nc, nullptr, nullptr);
      else
        b.template chunks<false>(m, ZeroOp<bf16>{}, nc, nullptr, nullptr);
    }
  });
}

template <typename B>
ga_status bn_merge(B& b, double* count_a, ga_tensor mean_a, ga_tensor m2_a, double count_b,
                   ga_tensor mean_b, ga_tensor m2_b) {
  return detail::guarded([&] {
    detail::validate_bn_merge(count_a, mean_a, m2_a, count_b, mean_b, m2_b, kGaCUDA);
    if (count_b == 0) return;
    auto d = [](const ga_tensor& x) { return x.dtype == kGaFloat64 ? 1 : 0; };
    if (mean_a.numel > 0)
      b.for_each(mean_a.numel, BnMergeOp{mean_a.data, m2_a.data, mean_b.data, m2_b.data, d(mean_a),
                                         d(m2_a), d(mean_b), d(m2_b), *count_a, count_b});
    *count_a += count_b;
  });
}

template <typename B>
ga_status bn_update_running(B& b, ga_tensor running_mean, ga_tensor running_var, ga_tensor mean,
                            ga_tensor m2, double count, double new_weight, int unbiased) {
  return detail::guarded([&] {
    detail::validate_bn_update(running_mean, running_var, mean, m2, count, new_weight, unbiased,
                               kGaCUDA);
    auto d = [](const ga_tensor& x) { return x.dtype == kGaFloat64 ? 1 : 0; };
    if (running_mean.numel > 0)
      b.for_each(running_mean.numel, BnRunningOp{running_mean.data, running_var.data, mean.data,
                                                 m2.data, d(running_mean), d(running_var), d(mean),
                                                 d(m2), unbiased ? count - 1 : count, new_weight});
  });
}

}  // namespace cuda
}  // namespace ga

#endif  // GRADIENT_ACCUMULATOR_CUDA_OPS_H_
