// Tests of the apply op family: scale, global-norm and adaptive clipping, SGD/Adam/AdamW updates
// over several steps against PyTorch's formulas in fp64, non-finite skipping, reset, the
// no-optimizer path, every parameter/state dtype pairing, and bad input.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "gradient_accumulator/gradient_accumulator.h"
#include "test_util.h"

namespace ga_test {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

// Units of the OddSizes() tensors for AGC: whole-vector, leading and trailing layouts.
const std::vector<ga_units>& OddUnits() {
  static const std::vector<ga_units> u{{1, kGaUnitsLeading},    {1, kGaUnitsLeading},
                                       {7, kGaUnitsTrailing},   {1, kGaUnitsLeading},
                                       {127, kGaUnitsLeading},  {128, kGaUnitsTrailing},
                                       {113, kGaUnitsTrailing}, {1, kGaUnitsTrailing}};
  return u;
}

std::vector<int64_t> UnitIndices(int64_t numel, ga_units units, int64_t u) {
  std::vector<int64_t> idx;
  if (numel == 0) return idx;
  const int64_t fan_in = numel / units.num_units;
  for (int64_t j = 0; j < fan_in; ++j)
    idx.push_back(units.layout == kGaUnitsLeading ? u * fan_in + j : j * units.num_units + u);
  return idx;
}

double NormOf(const std::vector<double>& x, const std::vector<int64_t>& idx) {
  ExactSum s;
  for (int64_t i : idx) s.Add(x[i] * x[i]);
  return std::sqrt(s.Value());
}

// The tensors of one ga_apply call, owned.
struct Buffers {
  TensorList params, acc, state1, state2, out;
  ga_apply_tensors tensors() const {
    return ga_apply_tensors{params.list(), acc.list(), state1.list(), state2.list(), out.list()};
  }
};

// Expected contents after one ga_apply call, with running-error magnitudes (see test_util.h).
struct Expected {
  std::vector<std::vector<double>> p, pm, s1, s1m, s2, s2m, out, outm;
  double grad_norm = -1.0, clip_coef = -1.0;
  bool skipped = false;
  int64_t units_clipped = 0, units_total = 0;
};

bool UsesState1(const ga_apply_options& o) {
  return o.optimizer == kGaOptimizerAdam || o.optimizer == kGaOptimizerAdamW ||
         (o.optimizer == kGaOptimizerSGD && o.momentum != 0.0);
}
bool UsesState2(const ga_apply_options& o) {
  return o.optimizer == kGaOptimizerAdam || o.optimizer == kGaOptimizerAdamW;
}

// PyTorch's update rules (torch.optim.SGD, Adam, AdamW with amsgrad=False, foreach=False) in
// fp64, from the values the buffers hold now.
Expected ReferenceApply(const Buffers& b, const ga_apply_options& o) {
  Expected e;
  const auto acc = b.acc.Values();
  const bool update = o.optimizer != kGaOptimizerNone;
  const bool agc = o.clip == kGaClipAgc;
  const auto w = (update || agc) ? b.params.Values() : std::vector<std::vector<double>>{};
  const auto s1 = UsesState1(o) ? b.state1.Values() : std::vector<std::vector<double>>{};
  const auto s2 = UsesState2(o) ? b.state2.Values() : std::vector<std::vector<double>>{};
  const double scale = o.grad_scale;

  ExactSum ss;
  for (const auto& a : acc)
    for (double x : a) ss.Add(x * x);
  const bool norm_pass =
      (o.clip == kGaClipGlobalNorm && o.clip_coef == nullptr) || o.skip_nonfinite;
  if (norm_pass) e.grad_norm = std::sqrt(ss.Value()) * std::fabs(scale);
  e.skipped = o.skip_nonfinite && !std::isfinite(e.grad_norm);
  double coef = 1.0;
  if (o.clip == kGaClipGlobalNorm)
    coef = o.clip_coef ? *o.clip_coef : std::min(1.0, o.max_norm / (e.grad_norm + 1e-6));
  e.clip_coef = o.clip == kGaClipGlobalNorm ? coef : (norm_pass ? 1.0 : -1.0);

  const double lr = o.lr, wd = o.weight_decay, mu = o.momentum, damp = o.dampening;
  const double b1 = o.beta1, b2 = o.beta2;
  const double t = static_cast<double>(o.step);
  const double bc1 = 1.0 - std::pow(b1, t), bc2 = 1.0 - std::pow(b2, t);
  const double step_size = lr / bc1, bc2_sqrt = std::sqrt(bc2);
  for (size_t i = 0; i < acc.size(); ++i) {
    const size_t n = acc[i].size();
    std::vector<double> c(n, coef);
    if (agc) {
      const ga_units u = o.units[i];
      for (int64_t k = 0; k < u.num_units; ++k) {
        const auto idx = UnitIndices(static_cast<int64_t>(n), u, k);
        const double pn = std::max(NormOf(w[i], idx), o.agc_eps);
        const double gn = NormOf(acc[i], idx) * std::fabs(scale);
        const double uc = std::min(1.0, o.clip_factor * pn / std::max(gn, 1e-6));
        e.units_clipped += uc < 1.0;
        ++e.units_total;
        for (int64_t j : idx) c[j] = uc;
      }
    }
    std::vector<double> p(n), pm(n), m1(n), m1m(n), m2(n), m2m(n);
    for (size_t j = 0; j < n; ++j) {
      double g = acc[i][j] * scale * c[j];
      double G = std::fabs(g);
      if (o.maximize) g = -g;
      if (o.optimizer == kGaOptimizerNone) {
        p[j] = g;
        pm[j] = G;
      } else if (o.optimizer == kGaOptimizerSGD) {
        const double wj = w[i][j];
        if (wd != 0.0) {
          g += wd * wj;
          G += wd * std::fabs(wj) + std::fabs(g);
        }
        if (mu != 0.0) {
          const bool first = o.momentum_initialized == 0;
          const double buf = first ? g : mu * s1[i][j] + (1.0 - damp) * g;
          const double B =
              first ? G : mu * std::fabs(s1[i][j]) + std::fabs(1.0 - damp) * G + std::fabs(buf);
          m1[j] = buf;
          m1m[j] = B;
          if (o.nesterov) {
            g = g + mu * buf;
            G = G + mu * B + std::fabs(g);
          } else {
            g = buf;
            G = B;
          }
        }
        p[j] = wj - lr * g;
        pm[j] = std::fabs(wj) + lr * G + std::fabs(p[j]);
      } else {
        double wj = w[i][j];
        double W = std::fabs(wj);
        if (o.optimizer == kGaOptimizerAdam && wd != 0.0) {
          g += wd * wj;
          G += wd * std::fabs(wj) + std::fabs(g);
        }
        if (o.optimizer == kGaOptimizerAdamW) {
          wj = wj * (1.0 - lr * wd);
          W += std::fabs(wj);
        }
        const double m_old = s1[i][j], v_old = s2[i][j];
        const double m = m_old + (1.0 - b1) * (g - m_old);
        const double M = std::fabs(m_old) + (1.0 - b1) * (G + std::fabs(m_old)) + std::fabs(m);
        const double v = b2 * v_old + (1.0 - b2) * g * g;
        const double V = b2 * std::fabs(v_old) + (1.0 - b2) * (g * g + 2.0 * std::fabs(g) * G) + v;
        const double s = std::sqrt(v);
        const double S = s > 0.0 ? V / (2.0 * s) + s : std::sqrt(V);
        const double d = s / bc2_sqrt + o.adam_eps;
        const double D = S / bc2_sqrt + d;
        const double upd = step_size * m / d;
        const double U = step_size * (M / d + std::fabs(m) * D / (d * d)) + std::fabs(upd);
        m1[j] = m;
        m1m[j] = M;
        m2[j] = v;
        m2m[j] = V;
        p[j] = wj - upd;
        pm[j] = W + U + std::fabs(p[j]);
      }
    }
    if (update) {
      e.p.push_back(p);
      e.pm.push_back(pm);
    } else {
      e.out.push_back(p);
      e.outm.push_back(pm);
    }
    e.s1.push_back(m1);
    e.s1m.push_back(m1m);
    e.s2.push_back(m2);
    e.s2m.push_back(m2m);
  }
  return e;
}

bool AllZeroBytes(const TensorList& l) {
  for (size_t i = 0; i < l.size(); ++i)
    for (uint8_t b : l[i].DataBytes())
      if (b != 0) return false;
  return true;
}

// Checks a completed (not skipped) call against the reference.
void ExpectMatches(const Buffers& b, const Expected& e, const ga_apply_options& o,
                   const std::vector<std::vector<double>>& acc_before, const ga_apply_result& r) {
  EXPECT_EQ(r.skipped, 0);
  if (e.grad_norm < 0)
    EXPECT_EQ(r.grad_norm, -1.0);
  else
    EXPECT_TRUE(NearScalar(r.grad_norm, e.grad_norm, kFp64Compute));
  if (e.clip_coef < 0)
    EXPECT_EQ(r.clip_coef, -1.0);
  else
    EXPECT_TRUE(NearScalar(r.clip_coef, e.clip_coef, kFp64Compute));
  const bool update = o.optimizer != kGaOptimizerNone;
  for (size_t i = 0; i < b.acc.size(); ++i) {
    SCOPED_TRACE(testing::Message() << "tensor " << i << " numel " << b.acc[i].numel());
    if (update) {
      EXPECT_TRUE(Near(b.params[i].Values(), e.p[i], e.pm[i], kFp32Compute, b.params[i].dtype()))
          << "params";
      if (UsesState1(o))
        EXPECT_TRUE(
            Near(b.state1[i].Values(), e.s1[i], e.s1m[i], kFp32Compute, b.state1[i].dtype()))
            << "state1";
      if (UsesState2(o))
        EXPECT_TRUE(
            Near(b.state2[i].Values(), e.s2[i], e.s2m[i], kFp32Compute, b.state2[i].dtype()))
            << "state2";
    } else if (b.out.size() > 0) {
      EXPECT_TRUE(Near(b.out[i].Values(), e.out[i], e.outm[i], kFp32Compute, b.out[i].dtype()))
          << "grads_out";
    } else {
      EXPECT_TRUE(Near(b.acc[i].Values(), e.out[i], e.outm[i], kFp32Compute, b.acc[i].dtype()))
          << "in-place gradient";
    }
    if (o.reset) {
      for (uint8_t x : b.acc[i].DataBytes()) ASSERT_EQ(x, 0) << "accumulator not reset";
    } else if (update || b.out.size() > 0) {
      ASSERT_LT(i, acc_before.size());
      EXPECT_EQ(b.acc[i].Values(), acc_before[i]) << "accumulator changed without reset";
    }
  }
  EXPECT_TRUE(b.params.GuardsIntact());
  EXPECT_TRUE(b.acc.GuardsIntact());
  EXPECT_TRUE(b.state1.GuardsIntact());
  EXPECT_TRUE(b.state2.GuardsIntact());
  EXPECT_TRUE(b.out.GuardsIntact());
}

// ---- the optimizer matrix: every optimizer × parameter/state dtype × clip mode, 4 steps ----

struct OptimizerCase {
  const char* name;
  ga_optimizer optimizer;
  double lr, weight_decay, momentum, dampening;
  int nesterov, maximize;
};
const OptimizerCase kOptimizers[] = {
    {"sgd", kGaOptimizerSGD, 0.1, 0.0, 0.0, 0.0, 0, 0},
    {"sgd_momentum_dampening_wd", kGaOptimizerSGD, 0.1, 0.01, 0.9, 0.1, 0, 0},
    {"sgd_nesterov_wd_maximize", kGaOptimizerSGD, 0.05, 0.01, 0.9, 0.0, 1, 1},
    {"adam_l2", kGaOptimizerAdam, 0.01, 0.01, 0, 0, 0, 0},
    {"adam_maximize", kGaOptimizerAdam, 0.01, 0.0, 0, 0, 0, 1},
    {"adamw", kGaOptimizerAdamW, 0.01, 0.1, 0, 0, 0, 0},
};

struct DtypeCase {
  ga_dtype param, state;
};
const DtypeCase kParamDtypes[] = {{kGaFloat32, kGaFloat32},
                                  {kGaBFloat16, kGaBFloat16},
                                  {kGaBFloat16, kGaFloat32},
                                  {kGaFloat16, kGaFloat16},
                                  {kGaFloat16, kGaFloat32}};

enum ClipCase { kNoClip, kGlobalNorm, kGlobalNormPrecomputed, kAgc };
const char* ClipName(ClipCase c) {
  switch (c) {
    case kNoClip:
      return "noclip";
    case kGlobalNorm:
      return "global";
    case kGlobalNormPrecomputed:
      return "coefptr";
    case kAgc:
      return "agc";
  }
  return "?";
}

const float kPrecomputedCoef = 0.375f;

class ApplyMatrix
    : public ::testing::TestWithParam<std::tuple<OptimizerCase, DtypeCase, ClipCase>> {};

TEST_P(ApplyMatrix, SeveralStepsMatchTorchFormulas) {
  const auto [oc, dc, clip] = GetParam();
  auto rng = Rng(51);
  Buffers b;
  b.params = TensorList(dc.param, OddSizes());
  b.acc = TensorList(kGaFloat32, OddSizes());
  b.state1 = TensorList(dc.state, OddSizes());
  b.state2 = TensorList(dc.state, OddSizes());
  b.params.FillUniform(rng, -1.0, 1.0);
  // SGD's first step must not read the momentum buffer: poison it. Adam starts from zeros.
  if (oc.optimizer == kGaOptimizerSGD)
    for (size_t i = 0; i < b.state1.size(); ++i)
      for (int64_t j = 0; j < b.state1[i].numel(); ++j) b.state1[i].Set(j, kNaN);

  for (int64_t step = 1; step <= 4; ++step) {
    SCOPED_TRACE(testing::Message() << "step " << step);
    b.acc.FillUniform(rng, -1.0, 1.0);
    ga_apply_options o{};
    o.grad_scale = 1.0 / 3.0;  // mean over three micro-batches
    o.optimizer = oc.optimizer;
    o.lr = oc.lr;
    o.weight_decay = oc.weight_decay;
    o.maximize = oc.maximize;
    o.momentum = oc.momentum;
    o.dampening = oc.dampening;
    o.nesterov = oc.nesterov;
    o.momentum_initialized = step > 1;
    o.beta1 = 0.9;
    o.beta2 = 0.999;
    o.adam_eps = 1e-8;
    o.step = step;
    o.reset = step % 2;
    o.skip_nonfinite = step == 3;  // finite data: must not skip, but computes the norm
    switch (clip) {
      case kNoClip:
        break;
      case kGlobalNorm:
        o.clip = kGaClipGlobalNorm;
        o.max_norm = step % 2 ? 10.0 : 1000.0;  // the norm is about 74: clip, then not
        break;
      case kGlobalNormPrecomputed:
        o.clip = kGaClipGlobalNorm;
        o.max_norm = 1e-9;  // ignored: the coefficient comes from memory
        o.clip_coef = &kPrecomputedCoef;
        break;
      case kAgc:
        o.clip = kGaClipAgc;
        o.clip_factor = 0.3;
        o.agc_eps = 1e-3;
        o.units = OddUnits().data();
        break;
    }
    const Expected e = ReferenceApply(b, o);
    const auto acc_before = b.acc.Values();
    const auto params_before = b.params.Values();
    const ga_apply_tensors t = b.tensors();
    ga_apply_result r{-1, -2.0, -2.0};
    ASSERT_EQ(ga_apply(&t, &o, &r), kGaOk) << ga_last_error();
    ExpectMatches(b, e, o, acc_before, r);
    // The update is visible: many elements of the large tensor moved.
    int64_t moved = 0;
    const auto after = b.params[7].Values();
    for (size_t j = 0; j < after.size(); ++j) moved += after[j] != params_before[7][j];
    EXPECT_GT(moved, 100003 / 10);
    if (clip == kGlobalNorm) {
      if (step % 2)
        EXPECT_LT(r.clip_coef, 0.5);
      else
        EXPECT_EQ(r.clip_coef, 1.0);
    }
    if (clip == kGlobalNormPrecomputed) EXPECT_EQ(r.clip_coef, 0.375);
    if (clip == kAgc) {
      EXPECT_GT(e.units_clipped, 0);
      EXPECT_LT(e.units_clipped, e.units_total);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    AllOptimizers, ApplyMatrix,
    ::testing::Combine(::testing::ValuesIn(kOptimizers), ::testing::ValuesIn(kParamDtypes),
                       ::testing::Values(kNoClip, kGlobalNorm, kGlobalNormPrecomputed, kAgc)),
    [](const ::testing::TestParamInfo<ApplyMatrix::ParamType>& info) {
      const OptimizerCase& oc = std::get<0>(info.param);
      const DtypeCase& dc = std::get<1>(info.param);
      return std::string(oc.name) + "_" + DtypeName(dc.param) + "_state_" + DtypeName(dc.state) +
             "_" + ClipName(std::get<2>(info.param));
    });

// ---- hand-checked single steps (exact binary fractions) ----

TEST(Apply, SgdHandExample) {
  // p = 1, acc = 6, grad_scale 0.5 → g = 3; wd 0.5 → g = 3.5; first step: buf = 3.5;
  // Nesterov: g = 3.5 + 0.5·3.5 = 5.25; lr 0.25 → p = 1 − 1.3125 = −0.3125.
  float p = 1.0f, acc = 6.0f, buf = 123.0f;
  ga_tensor pt{&p, 1, kGaFloat32, kGaCPU, 0}, at{&acc, 1, kGaFloat32, kGaCPU, 0};
  ga_tensor bt{&buf, 1, kGaFloat32, kGaCPU, 0};
  ga_apply_tensors t{{&pt, 1}, {&at, 1}, {&bt, 1}, {nullptr, 0}, {nullptr, 0}};
  ga_apply_options o{};
  o.grad_scale = 0.5;
  o.optimizer = kGaOptimizerSGD;
  o.lr = 0.25;
  o.weight_decay = 0.5;
  o.momentum = 0.5;
  o.nesterov = 1;
  ASSERT_EQ(ga_apply(&t, &o, nullptr), kGaOk) << ga_last_error();
  EXPECT_EQ(buf, 3.5f);
  EXPECT_EQ(p, -0.3125f);
  EXPECT_EQ(acc, 6.0f);  // no reset requested
  // Second step, initialized buffer, dampening 0.5, no Nesterov: g = 3 + 0.5·(−0.3125) =
  // 2.84375; buf = 0.5·3.5 + 0.5·2.84375 = 3.171875; p = −0.3125 − 0.25·3.171875.
  o.momentum_initialized = 1;
  o.nesterov = 0;
  o.dampening = 0.5;
  o.reset = 1;
  ASSERT_EQ(ga_apply(&t, &o, nullptr), kGaOk) << ga_last_error();
  EXPECT_EQ(buf, 3.171875f);
  EXPECT_EQ(p, -0.3125f - 0.25f * 3.171875f);
  EXPECT_EQ(acc, 0.0f);
}

TEST(Apply, AdamFirstStepMovesByLr) {
  // On step 1 with zero state and eps → 0, Adam moves every parameter by lr·sign(g), and AdamW
  // first scales it by (1 − lr·wd).
  for (ga_optimizer opt : {kGaOptimizerAdam, kGaOptimizerAdamW}) {
    std::vector<float> p{1.0f, -2.0f, 0.5f}, acc{0.3f, -4.0f, 2e-3f}, m(3, 0.0f), v(3, 0.0f);
    ga_tensor pt{p.data(), 3, kGaFloat32, kGaCPU, 0}, at{acc.data(), 3, kGaFloat32, kGaCPU, 0};
    ga_tensor mt{m.data(), 3, kGaFloat32, kGaCPU, 0}, vt{v.data(), 3, kGaFloat32, kGaCPU, 0};
    ga_apply_tensors t{{&pt, 1}, {&at, 1}, {&mt, 1}, {&vt, 1}, {nullptr, 0}};
    ga_apply_options o{};
    o.grad_scale = 1.0;
    o.optimizer = opt;
    o.lr = 0.125;
    o.weight_decay = opt == kGaOptimizerAdamW ? 0.5 : 0.0;
    o.beta1 = 0.9;
    o.beta2 = 0.99;
    o.adam_eps = 0.0;
    o.step = 1;
    ASSERT_EQ(ga_apply(&t, &o, nullptr), kGaOk) << ga_last_error();
    const double decay = opt == kGaOptimizerAdamW ? 1.0 - 0.125 * 0.5 : 1.0;
    EXPECT_NEAR(p[0], 1.0 * decay - 0.125, 1e-6);
    EXPECT_NEAR(p[1], -2.0 * decay + 0.125, 1e-6);
    EXPECT_NEAR(p[2], 0.5 * decay - 0.125, 1e-6);
    EXPECT_NEAR(m[1], 0.1 * -4.0, 1e-6);
    EXPECT_NEAR(v[1], 0.01 * 16.0, 1e-6);
  }
}

TEST(Apply, StepCountersGiveEachTensorItsOwnStep) {
  // Tensors of steps 0, 3, 0, 7 in one call: each updated with its own bias corrections, bit
  // for bit as one call per step with the host step, and each counter advanced by one. A raised
  // skip flag then writes nothing but the reset, and leaves the counters.
  auto rng = Rng(31);
  const std::vector<int64_t> sizes = {5, 300, 0, 33};
  const std::vector<float> steps = {0, 3, 0, 7};
  TensorList p(kGaFloat32, sizes), a(kGaFloat32, sizes), m(kGaFloat32, sizes), v(kGaFloat32, sizes);
  p.FillUniform(rng, -1, 1);
  a.FillUniform(rng, -1, 1);
  m.FillUniform(rng, -0.1, 0.1);
  v.FillUniform(rng, 0.0, 0.01);
  ga_apply_options o{};
  o.grad_scale = 0.5;
  o.optimizer = kGaOptimizerAdamW;
  o.lr = 1e-2;
  o.weight_decay = 0.1;
  o.beta1 = 0.9;
  o.beta2 = 0.999;
  o.adam_eps = 1e-8;
  // Reference: one call per tensor with the host step.
  std::vector<std::vector<double>> want_p, want_m, want_v;
  for (size_t i = 0; i < sizes.size(); ++i) {
    TestTensor pi(kGaFloat32, sizes[i]), ai(kGaFloat32, sizes[i]), mi(kGaFloat32, sizes[i]),
        vi(kGaFloat32, sizes[i]);
    pi.SetValues(p[i].Values());
    ai.SetValues(a[i].Values());
    mi.SetValues(m[i].Values());
    vi.SetValues(v[i].Values());
    ga_tensor tp = pi.desc(), ta = ai.desc(), tm = mi.desc(), tv = vi.desc();
    ga_apply_tensors t{{&tp, 1}, {&ta, 1}, {&tm, 1}, {&tv, 1}, {nullptr, 0}};
    ga_apply_options oi = o;
    oi.step = static_cast<int64_t>(steps[i]) + 1;
    ASSERT_EQ(ga_apply(&t, &oi, nullptr), kGaOk) << ga_last_error();
    want_p.push_back(pi.Values());
    want_m.push_back(mi.Values());
    want_v.push_back(vi.Values());
  }
  std::vector<float> counters = steps;
  std::vector<float*> ptrs;
  for (float& c : counters) ptrs.push_back(&c);
  o.step_counters = ptrs.data();
  ga_apply_tensors t{p.list(), a.list(), m.list(), v.list(), {nullptr, 0}};
  ASSERT_EQ(ga_apply(&t, &o, nullptr), kGaOk) << ga_last_error();
  EXPECT_EQ(p.Values(), want_p);
  EXPECT_EQ(m.Values(), want_m);
  EXPECT_EQ(v.Values(), want_v);
  for (size_t i = 0; i < steps.size(); ++i) EXPECT_EQ(counters[i], steps[i] + 1);

  const auto p_before = p.Values(), m_before = m.Values(), v_before = v.Values();
  const float raised = 1.0f;
  o.skip_flag = &raised;
  o.reset = 1;
  ga_apply_result r{};
  ASSERT_EQ(ga_apply(&t, &o, &r), kGaOk) << ga_last_error();
  EXPECT_EQ(r.skipped, 1);
  EXPECT_EQ(p.Values(), p_before);
  EXPECT_EQ(m.Values(), m_before);
  EXPECT_EQ(v.Values(), v_before);
  for (const auto& x : a.Values())
    for (double e : x) EXPECT_EQ(e, 0.0);
  for (size_t i = 0; i < steps.size(); ++i) EXPECT_EQ(counters[i], steps[i] + 1);

  // Refused before anything is written: a fractional step, and one counter given twice.
  o.skip_flag = nullptr;
  counters[3] = 2.5f;
  EXPECT_EQ(ga_apply(&t, &o, nullptr), kGaInvalidArgument);
  EXPECT_NE(std::string(ga_last_error()).find("step_counters[3]"), std::string::npos);
  counters[3] = 2.0f;
  ptrs[2] = ptrs[0];
  EXPECT_EQ(ga_apply(&t, &o, nullptr), kGaInvalidArgument);
  EXPECT_NE(std::string(ga_last_error()).find("overlaps"), std::string::npos);
  EXPECT_EQ(p.Values(), p_before);
  EXPECT_EQ(counters[0], 1.0f);
}

// ---- non-finite gradients: skip everything, reset iff asked ----

TEST(Apply, SkipNonfiniteLeavesEverythingUntouched) {
  auto rng = Rng(52);
  for (ga_optimizer opt :
       {kGaOptimizerSGD, kGaOptimizerAdam, kGaOptimizerAdamW, kGaOptimizerNone}) {
    for (ClipCase clip : {kNoClip, kGlobalNorm, kAgc}) {
      for (double special : {kNaN, kInf, -kInf}) {
        for (int reset : {0, 1}) {
          SCOPED_TRACE(testing::Message() << "optimizer " << opt << " clip " << ClipName(clip)
                                          << " " << special << " reset " << reset);
          Buffers b;
          b.params = TensorList(kGaBFloat16, OddSizes());
          b.acc = TensorList(kGaFloat32, OddSizes());
          b.state1 = TensorList(kGaFloat32, OddSizes());
          b.state2 = TensorList(kGaFloat32, OddSizes());
          b.out = TensorList(kGaFloat16, OddSizes());
          b.params.FillUniform(rng, -1.0, 1.0);
          b.acc.FillUniform(rng, -1.0, 1.0);
          b.state1.FillUniform(rng, -1.0, 1.0);
          b.state2.FillUniform(rng, 0.0, 1.0);
          b.out.FillUniform(rng, -1.0, 1.0);
          b.acc[6].Set(16384, special);
          ga_apply_options o{};
          o.grad_scale = 0.5;
          o.skip_nonfinite = 1;
          o.reset = reset;
          o.optimizer = opt;
          o.lr = 0.1;
          o.momentum = 0.9;
          o.momentum_initialized = 1;
          o.beta1 = 0.9;
          o.beta2 = 0.999;
          o.step = 3;
          if (clip == kGlobalNorm) {
            o.clip = kGaClipGlobalNorm;
            o.max_norm = 1.0;
          } else if (clip == kAgc) {
            o.clip = kGaClipAgc;
            o.clip_factor = 0.01;
            o.agc_eps = 1e-3;
            o.units = OddUnits().data();
          }
          const auto untouched = Snapshot(b.params, b.state1, b.state2, b.out);
          const auto acc_before = b.acc.Bytes();
          const ga_apply_tensors t = b.tensors();
          ga_apply_result r{-1, 0.0, 0.0};
          ASSERT_EQ(ga_apply(&t, &o, &r), kGaOk) << ga_last_error();
          EXPECT_EQ(r.skipped, 1);
          EXPECT_FALSE(std::isfinite(r.grad_norm));
          EXPECT_EQ(Snapshot(b.params, b.state1, b.state2, b.out), untouched);
          if (reset) {
            EXPECT_TRUE(AllZeroBytes(b.acc));
            EXPECT_TRUE(b.acc.GuardsIntact());
          } else {
            EXPECT_EQ(b.acc.Bytes(), acc_before);
          }
        }
      }
    }
  }
}

TEST(Apply, NonfiniteWithoutSkipIsApplied) {
  // skip_nonfinite = 0: the update runs and the NaN reaches exactly the element it came from.
  std::vector<float> p{1, 1, 1}, acc{1, std::nanf(""), 1};
  ga_tensor pt{p.data(), 3, kGaFloat32, kGaCPU, 0}, at{acc.data(), 3, kGaFloat32, kGaCPU, 0};
  ga_apply_tensors t{{&pt, 1}, {&at, 1}, {nullptr, 0}, {nullptr, 0}, {nullptr, 0}};
  ga_apply_options o{};
  o.grad_scale = 1.0;
  o.optimizer = kGaOptimizerSGD;
  o.lr = 0.5;
  ga_apply_result r{-1, 0, 0};
  ASSERT_EQ(ga_apply(&t, &o, &r), kGaOk);
  EXPECT_EQ(r.skipped, 0);
  EXPECT_EQ(p[0], 0.5f);
  EXPECT_TRUE(std::isnan(p[1]));
  EXPECT_EQ(p[2], 0.5f);
}

// ---- optimizer none: the final gradient in each dtype ----

TEST(Apply, OptimizerNoneWritesTheFinalGradient) {
  auto rng = Rng(53);
  for (ga_dtype acc_dtype : {kGaFloat32, kGaFloat64}) {
    for (ga_dtype out_dtype : {kGaFloat32, kGaBFloat16, kGaFloat16, kGaFloat64}) {
      for (ClipCase clip : {kNoClip, kGlobalNorm, kGlobalNormPrecomputed, kAgc}) {
        for (int reset : {0, 1}) {
          SCOPED_TRACE(testing::Message() << DtypeName(acc_dtype) << " -> " << DtypeName(out_dtype)
                                          << " " << ClipName(clip) << " reset " << reset);
          Buffers b;
          b.params = TensorList(kGaFloat16, OddSizes());
          b.acc = TensorList(acc_dtype, OddSizes());
          b.out = TensorList(out_dtype, OddSizes());
          b.params.FillUniform(rng, -1.0, 1.0);
          b.acc.FillUniform(rng, -4.0, 4.0);
          ga_apply_options o{};
          o.grad_scale = 0.25;
          o.reset = reset;
          o.optimizer = kGaOptimizerNone;
          if (clip == kGlobalNorm) {
            o.clip = kGaClipGlobalNorm;
            o.max_norm = 50.0;
          } else if (clip == kGlobalNormPrecomputed) {
            o.clip = kGaClipGlobalNorm;
            o.clip_coef = &kPrecomputedCoef;
          } else if (clip == kAgc) {
            o.clip = kGaClipAgc;
            o.clip_factor = 0.5;
            o.agc_eps = 1e-3;
            o.units = OddUnits().data();
          }
          const Expected e = ReferenceApply(b, o);
          const auto acc_before = b.acc.Values();
          const auto params_before = b.params.Bytes();
          const ga_apply_tensors t = b.tensors();
          ga_apply_result r{-1, -2.0, -2.0};
          ASSERT_EQ(ga_apply(&t, &o, &r), kGaOk) << ga_last_error();
          ExpectMatches(b, e, o, acc_before, r);
          EXPECT_EQ(b.params.Bytes(), params_before);  // read only (AGC) or ignored
          if (clip == kGlobalNorm) EXPECT_LT(r.clip_coef, 1.0);
          if (clip == kAgc) EXPECT_GT(e.units_clipped, 0);
        }
      }
    }
  }
}

TEST(Apply, OptimizerNoneInPlace) {
  auto rng = Rng(54);
  for (ClipCase clip : {kNoClip, kGlobalNorm, kAgc}) {
    SCOPED_TRACE(ClipName(clip));
    Buffers b;
    b.params = TensorList(kGaFloat32, OddSizes());
    b.acc = TensorList(kGaFloat32, OddSizes());
    b.params.FillUniform(rng, -1.0, 1.0);
    b.acc.FillUniform(rng, -1.0, 1.0);
    ga_apply_options o{};
    o.grad_scale = 1.0 / 7.0;
    o.optimizer = kGaOptimizerNone;
    if (clip == kGlobalNorm) {
      o.clip = kGaClipGlobalNorm;
      o.max_norm = 5.0;
    } else if (clip == kAgc) {
      o.clip = kGaClipAgc;
      o.clip_factor = 0.05;
      o.agc_eps = 1e-3;
      o.units = OddUnits().data();
    }
    const Expected e = ReferenceApply(b, o);
    const ga_apply_tensors t = b.tensors();
    ga_apply_result r{-1, -2.0, -2.0};
    ASSERT_EQ(ga_apply(&t, &o, &r), kGaOk) << ga_last_error();
    ExpectMatches(b, e, o, {}, r);
  }
}

// ---- fp64 accumulators, unused lists, empty input ----

TEST(Apply, Float64AccumulatorsDriveFloat32Params) {
  auto rng = Rng(55);
  for (ga_optimizer opt : {kGaOptimizerSGD, kGaOptimizerAdamW}) {
    Buffers b;
    b.params = TensorList(kGaFloat32, OddSizes());
    b.acc = TensorList(kGaFloat64, OddSizes());
    b.state1 = TensorList(kGaFloat32, OddSizes());
    b.state2 = TensorList(kGaFloat32, OddSizes());
    b.params.FillUniform(rng, -1.0, 1.0);
    b.acc.FillUniform(rng, -1.0, 1.0);
    ga_apply_options o{};
    o.grad_scale = 0.5;
    o.optimizer = opt;
    o.lr = 0.01;
    o.weight_decay = 0.01;
    o.momentum = 0.9;
    o.beta1 = 0.8;
    o.beta2 = 0.95;
    o.adam_eps = 1e-6;
    o.step = 1;
    o.reset = 1;
    o.clip = kGaClipGlobalNorm;
    o.max_norm = 1.0;
    const Expected e = ReferenceApply(b, o);
    const ga_apply_tensors t = b.tensors();
    ga_apply_result r{};
    ASSERT_EQ(ga_apply(&t, &o, &r), kGaOk) << ga_last_error();
    ExpectMatches(b, e, o, {}, r);
  }
}

TEST(Apply, UnusedStateListsAreIgnored) {
  // Plain SGD (no momentum) uses no state: malformed state lists must not be read.
  auto rng = Rng(56);
  Buffers b;
  b.params = TensorList(kGaBFloat16, {7, 31, 16385});
  b.acc = TensorList(kGaFloat32, {7, 31, 16385});
  b.params.FillUniform(rng, -1.0, 1.0);
  b.acc.FillUniform(rng, -1.0, 1.0);
  ga_apply_options o{};
  o.grad_scale = 1.0;
  o.optimizer = kGaOptimizerSGD;
  o.lr = 0.1;
  const Expected e = ReferenceApply(b, o);
  const auto acc_before = b.acc.Values();
  ga_apply_tensors t = b.tensors();
  t.state1 = ga_tensor_list{nullptr, 3};
  t.state2 = ga_tensor_list{nullptr, 1};
  t.grads_out = ga_tensor_list{nullptr, 2};
  ga_apply_result r{};
  ASSERT_EQ(ga_apply(&t, &o, &r), kGaOk) << ga_last_error();
  ExpectMatches(b, e, o, acc_before, r);
}

TEST(Apply, EmptyListsAndEmptyTensors) {
  ga_apply_tensors t{};
  ga_apply_options o{};
  o.grad_scale = 1.0;
  o.optimizer = kGaOptimizerAdamW;
  o.beta1 = 0.9;
  o.beta2 = 0.999;
  o.step = 1;
  o.lr = 1e-3;
  o.clip = kGaClipGlobalNorm;
  o.max_norm = 1.0;
  o.reset = 1;
  ga_apply_result r{-1, -2.0, -2.0};
  ASSERT_EQ(ga_apply(&t, &o, &r), kGaOk) << ga_last_error();
  EXPECT_EQ(r.skipped, 0);
  EXPECT_EQ(r.grad_norm, 0.0);
  EXPECT_EQ(r.clip_coef, 1.0);
  ga_tensor e32{nullptr, 0, kGaFloat32, kGaCPU, 0}, e16{nullptr, 0, kGaBFloat16, kGaCPU, 0};
  t = ga_apply_tensors{{&e16, 1}, {&e32, 1}, {&e16, 1}, {&e16, 1}, {nullptr, 0}};
  ASSERT_EQ(ga_apply(&t, &o, &r), kGaOk) << ga_last_error();
  EXPECT_EQ(r.grad_norm, 0.0);
}

// ---- equivalence with one big batch through accumulate + apply ----

TEST(Apply, AccumulateThenApplyEqualsTheBigBatch) {
  // Four micro-batches of different weights accumulated, then averaged by grad_scale = 1/W,
  // give the SGD-with-Nesterov-momentum update of the weighted-mean gradient.
  auto rng = Rng(57);
  const std::vector<int64_t> sizes{31, 16385};
  const std::vector<double> weights{3, 1, 4, 2};
  TensorList acc(kGaFloat32, sizes), p1(kGaFloat32, sizes), p2(kGaFloat32, sizes);
  TensorList b1(kGaFloat32, sizes), b2(kGaFloat32, sizes), mean(kGaFloat32, sizes);
  p1.FillUniform(rng, -1.0, 1.0);
  b1.FillUniform(rng, -1.0, 1.0);
  for (size_t i = 0; i < sizes.size(); ++i) {
    p2[i].SetValues(p1[i].Values());
    b2[i].SetValues(b1[i].Values());
  }
  std::vector<std::vector<double>> sum(sizes.size()), abs_sum(sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i) {
    sum[i].assign(sizes[i], 0.0);
    abs_sum[i].assign(sizes[i], 0.0);
  }
  double total = 0.0;
  for (size_t k = 0; k < weights.size(); ++k) {
    TensorList g(kGaBFloat16, sizes);
    g.FillUniform(rng, -1.0, 1.0);
    const ga_accumulate_options ao{kGaAccumulateSum, weights[k], 0.0, k == 0};
    ASSERT_EQ(ga_accumulate(acc.list(), g.list(), &ao, 0, nullptr), kGaOk);
    for (size_t i = 0; i < sizes.size(); ++i) {
      const auto gv = g[i].Values();
      for (size_t j = 0; j < gv.size(); ++j) {
        sum[i][j] += weights[k] * gv[j];
        abs_sum[i][j] += weights[k] * std::fabs(gv[j]);
      }
    }
    total += weights[k];
  }
  for (size_t i = 0; i < sizes.size(); ++i) {
    for (double& x : sum[i]) x /= total;
    mean[i].SetValues(sum[i]);
  }
  ga_apply_options o{};
  o.optimizer = kGaOptimizerSGD;
  o.lr = 0.1;
  o.momentum = 0.9;
  o.nesterov = 1;
  o.weight_decay = 0.01;
  o.momentum_initialized = 1;
  o.grad_scale = 1.0 / total;
  const ga_apply_tensors t1{p1.list(), acc.list(), b1.list(), {nullptr, 0}, {nullptr, 0}};
  ASSERT_EQ(ga_apply(&t1, &o, nullptr), kGaOk);
  o.grad_scale = 1.0;
  const ga_apply_tensors t2{p2.list(), mean.list(), b2.list(), {nullptr, 0}, {nullptr, 0}};
  ASSERT_EQ(ga_apply(&t2, &o, nullptr), kGaOk);
  for (size_t i = 0; i < sizes.size(); ++i) {
    // Error scale: the mean of |w·g| (the sums may cancel), the old buffer and the parameters.
    const auto pv = p2[i].Values(), bv = b2[i].Values();
    std::vector<double> bmag(sizes[i]), pmag(sizes[i]);
    for (int64_t j = 0; j < sizes[i]; ++j) {
      bmag[j] = 0.9 + abs_sum[i][j] / total + std::fabs(bv[j]);
      pmag[j] = 1.0 + std::fabs(pv[j]) + 0.1 * 2.0 * bmag[j];
    }
    EXPECT_TRUE(Near(b1[i].Values(), bv, bmag, 4 * kFp32Compute, kGaFloat32));
    EXPECT_TRUE(Near(p1[i].Values(), pv, pmag, 4 * kFp32Compute, kGaFloat32));
  }
}

// ---- bad input: status, argument, no byte written ----

class ApplyBadInput : public ::testing::Test {
 protected:
  ApplyBadInput() {
    const std::vector<int64_t> sizes{12, 31, 7};
    b_.params = TensorList(kGaBFloat16, sizes);
    b_.acc = TensorList(kGaFloat32, sizes);
    b_.state1 = TensorList(kGaFloat32, sizes);
    b_.state2 = TensorList(kGaFloat32, sizes);
    b_.out = TensorList(kGaFloat16, sizes);
    auto rng = Rng(58);
    b_.params.FillUniform(rng, -1.0, 1.0);
    b_.acc.FillUniform(rng, -1.0, 1.0);
    b_.state1.FillUniform(rng, -1.0, 1.0);
    b_.state2.FillUniform(rng, 0.0, 1.0);
    b_.out.FillUniform(rng, -1.0, 1.0);
    before_ = Snapshot(b_.params, b_.acc, b_.state1, b_.state2, b_.out);
    adam_.grad_scale = 0.5;
    adam_.optimizer = kGaOptimizerAdam;
    adam_.lr = 1e-3;
    adam_.beta1 = 0.9;
    adam_.beta2 = 0.999;
    adam_.adam_eps = 1e-8;
    adam_.step = 1;
    adam_.reset = 1;
    units_ = {{3, kGaUnitsLeading}, {1, kGaUnitsLeading}, {7, kGaUnitsTrailing}};
  }
  // One call that must fail; the descriptors are rebuilt afterwards.
  void ExpectFail(const ga_apply_options* o, ga_status status,
                  std::initializer_list<std::string> args, const ga_apply_tensors* t = nullptr,
                  bool null_tensors = false) {
    const ga_apply_tensors def = b_.tensors();
    if (t == nullptr && !null_tensors) t = &def;
    ga_apply_result r{-5, -5.0, -5.0};
    EXPECT_TRUE(FailsWith(ga_apply(t, o, &r), status, args));
    EXPECT_EQ(r.skipped, -5);
    EXPECT_EQ(r.grad_norm, -5.0);
    EXPECT_EQ(r.clip_coef, -5.0);
    EXPECT_EQ(Snapshot(b_.params, b_.acc, b_.state1, b_.state2, b_.out), before_);
    for (TensorList* l : {&b_.params, &b_.acc, &b_.state1, &b_.state2, &b_.out}) l->Rebuild();
  }
  Buffers b_;
  std::vector<uint8_t> before_;
  ga_apply_options adam_{};
  std::vector<ga_units> units_;
};

TEST_F(ApplyBadInput, NullArguments) {
  ExpectFail(&adam_, kGaInvalidArgument, {"tensors"}, nullptr, true);
  ExpectFail(nullptr, kGaInvalidArgument, {"options"});
}

TEST_F(ApplyBadInput, HyperParameters) {
  struct Case {
    const char* argument;
    void (*edit)(ga_apply_options&);
  };
  const Case cases[] = {
      {"beta1", [](ga_apply_options& o) { o.beta1 = 1.0; }},
      {"beta1", [](ga_apply_options& o) { o.beta1 = -0.1; }},
      {"beta1", [](ga_apply_options& o) { o.beta1 = kNaN; }},
      {"beta2", [](ga_apply_options& o) { o.beta2 = 1.0; }},
      {"beta2", [](ga_apply_options& o) { o.beta2 = kNaN; }},
      {"step", [](ga_apply_options& o) { o.step = 0; }},
      {"step", [](ga_apply_options& o) { o.step = -3; }},
      {"lr", [](ga_apply_options& o) { o.lr = -1e-3; }},
      {"lr", [](ga_apply_options& o) { o.lr = kNaN; }},
      {"lr", [](ga_apply_options& o) { o.lr = kInf; }},
      {"weight_decay", [](ga_apply_options& o) { o.weight_decay = -0.1; }},
      {"weight_decay", [](ga_apply_options& o) { o.weight_decay = kNaN; }},
      {"eps", [](ga_apply_options& o) { o.adam_eps = -1e-8; }},
      {"eps", [](ga_apply_options& o) { o.adam_eps = kNaN; }},
      {"grad_scale", [](ga_apply_options& o) { o.grad_scale = kNaN; }},
      {"grad_scale", [](ga_apply_options& o) { o.grad_scale = kInf; }},
      {"max_norm",
       [](ga_apply_options& o) {
         o.clip = kGaClipGlobalNorm;
         o.max_norm = 0.0;
       }},
      {"max_norm",
       [](ga_apply_options& o) {
         o.clip = kGaClipGlobalNorm;
         o.max_norm = kNaN;
       }},
      {"clip_factor",
       [](ga_apply_options& o) {
         o.clip = kGaClipAgc;
         o.clip_factor = 0.0;
         o.agc_eps = 1e-3;
       }},
      {"eps",
       [](ga_apply_options& o) {
         o.clip = kGaClipAgc;
         o.clip_factor = 0.01;
         o.agc_eps = -1.0;
       }},
      {"units",
       [](ga_apply_options& o) {
         o.clip = kGaClipAgc;
         o.clip_factor = 0.01;
         o.units = nullptr;
       }},
      {"clip", [](ga_apply_options& o) { SetRaw(o.clip, 9); }},
      {"optimizer", [](ga_apply_options& o) { SetRaw(o.optimizer, 9); }},
      {"nesterov",
       [](ga_apply_options& o) {
         o.optimizer = kGaOptimizerSGD;
         o.momentum = 0.9;
         o.dampening = 0.1;
         o.nesterov = 1;
       }},
      {"nesterov",
       [](ga_apply_options& o) {
         o.optimizer = kGaOptimizerSGD;
         o.momentum = 0.0;
         o.nesterov = 1;
       }},
      {"momentum",
       [](ga_apply_options& o) {
         o.optimizer = kGaOptimizerSGD;
         o.momentum = -0.5;
       }},
      {"momentum",
       [](ga_apply_options& o) {
         o.optimizer = kGaOptimizerSGD;
         o.momentum = kNaN;
       }},
      {"dampening",
       [](ga_apply_options& o) {
         o.optimizer = kGaOptimizerSGD;
         o.momentum = 0.9;
         o.dampening = kNaN;
       }},
      {"lr",
       [](ga_apply_options& o) {
         o.optimizer = kGaOptimizerSGD;
         o.lr = -0.1;
       }},
      {"reset",
       [](ga_apply_options& o) {
         o.optimizer = kGaOptimizerNone;
         o.reset = 1;
       }},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.argument);
    ga_apply_options o = adam_;
    c.edit(o);
    ga_apply_tensors t = b_.tensors();
    // A case may hold an out-of-range optimizer value: read it as its integer, as the core does.
    std::underlying_type_t<ga_optimizer> optimizer;
    std::memcpy(&optimizer, &o.optimizer, sizeof optimizer);
    if (optimizer == kGaOptimizerNone) t.grads_out = {nullptr, 0};  // in place
    ExpectFail(&o, kGaInvalidArgument, {c.argument}, &t);
  }
}

TEST_F(ApplyBadInput, ListLengthsAndElementCounts) {
  ga_apply_tensors t = b_.tensors();
  t.params.size = 2;
  ExpectFail(&adam_, kGaInvalidArgument, {"params"}, &t);
  t = b_.tensors();
  t.state1.size = 2;
  ExpectFail(&adam_, kGaInvalidArgument, {"state1"}, &t);
  t = b_.tensors();
  t.state2 = {nullptr, 0};
  ExpectFail(&adam_, kGaInvalidArgument, {"state2"}, &t);
  t = b_.tensors();
  t.accumulators = {nullptr, 3};
  ExpectFail(&adam_, kGaInvalidArgument, {"accumulators"}, &t);
  b_.params.desc(1).numel = 30;
  ExpectFail(&adam_, kGaInvalidArgument, {"params[1]"});
  b_.state1.desc(2).numel = 8;
  ExpectFail(&adam_, kGaInvalidArgument, {"state1[2]"});
  b_.state2.desc(0).numel = 11;
  ExpectFail(&adam_, kGaInvalidArgument, {"state2[0]"});
  b_.acc.desc(0).numel = -12;
  ExpectFail(&adam_, kGaInvalidArgument, {"accumulators[0]"});
  b_.params.desc(2).data = nullptr;
  ExpectFail(&adam_, kGaInvalidArgument, {"params[2]"});
  ga_apply_options none = adam_;
  none.optimizer = kGaOptimizerNone;
  t = b_.tensors();
  t.grads_out.size = 1;
  ExpectFail(&none, kGaInvalidArgument, {"grads_out"}, &t);
  b_.out.desc(1).numel = 3;
  ExpectFail(&none, kGaInvalidArgument, {"grads_out[1]"});
  // units that do not divide the element count
  ga_apply_options agc = adam_;
  agc.clip = kGaClipAgc;
  agc.clip_factor = 0.01;
  agc.agc_eps = 1e-3;
  std::vector<ga_units> u = units_;
  u[1] = {2, kGaUnitsLeading};
  agc.units = u.data();
  ExpectFail(&agc, kGaInvalidArgument, {"units[1]"});
}

TEST_F(ApplyBadInput, Dtypes) {
  TestTensor f64(kGaFloat64, 12);
  b_.params.desc(0) = f64.desc();
  ExpectFail(&adam_, kGaTypeError, {"params[0]"});
  b_.acc.desc(1).dtype = kGaBFloat16;
  ExpectFail(&adam_, kGaTypeError, {"accumulators[1]"});
  b_.state1.desc(2).dtype = kGaFloat16;  // neither the param dtype (bf16) nor fp32
  ExpectFail(&adam_, kGaTypeError, {"state1[2]"});
  b_.state2.desc(0).dtype = kGaBFloat16;  // differs from state1 (fp32) and from state2[1]
  ExpectFail(&adam_, kGaTypeError, {"state2[0]", "state2[1]"});
  SetRaw(b_.out.desc(0).dtype, 5);
  ga_apply_options none = adam_;
  none.optimizer = kGaOptimizerNone;
  ExpectFail(&none, kGaTypeError, {"grads_out[0]"});
  if (!ga_has_cuda()) {
    b_.state2.desc(1).device_type = kGaCUDA;
    ExpectFail(&adam_, kGaUnsupported, {"state2[1]"});
  }
}

TEST_F(ApplyBadInput, Aliasing) {
  // An accumulator that is a parameter's memory.
  TestTensor shared(kGaFloat32, 31);
  b_.params.desc(1) = shared.desc();
  b_.acc.desc(1) = shared.desc();
  const auto shared_before = shared.Bytes();
  ExpectFail(&adam_, kGaInvalidArgument, {"params[1]", "accumulators[1]"});
  // Optimizer state aliasing the parameters.
  b_.params.desc(1) = shared.desc();
  b_.state1.desc(1) = shared.desc();
  ExpectFail(&adam_, kGaInvalidArgument, {"params[1]", "state1[1]"});
  // exp_avg_sq overlapping exp_avg of another tensor.
  b_.state2.desc(2).data = b_.state1[1].at(20);
  ExpectFail(&adam_, kGaInvalidArgument, {"state1[1]", "state2[2]"});
  // Two accumulators sharing memory.
  b_.acc.desc(2).data = b_.acc[0].at(1);
  ExpectFail(&adam_, kGaInvalidArgument, {"accumulators[0]", "accumulators[2]"});
  // grads_out viewing an accumulator.
  ga_apply_options none = adam_;
  none.optimizer = kGaOptimizerNone;
  b_.out.desc(0) = b_.acc[0].desc();
  ExpectFail(&none, kGaInvalidArgument, {"grads_out[0]", "accumulators[0]"});
  // AGC without an update reads the parameters: they still must not overlap the accumulators.
  ga_apply_options agc = none;
  agc.clip = kGaClipAgc;
  agc.clip_factor = 0.01;
  agc.agc_eps = 1e-3;
  agc.units = units_.data();
  b_.params.desc(0) = ga_tensor{b_.acc[0].data(), 12, kGaFloat32, kGaCPU, 0};
  ExpectFail(&agc, kGaInvalidArgument, {"params[0]", "accumulators[0]"});
  EXPECT_EQ(shared.Bytes(), shared_before);
}

}  // namespace
}  // namespace ga_test
