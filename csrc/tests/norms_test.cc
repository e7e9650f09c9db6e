// Tests of the norms op family: deterministic sum of squares, unit-wise norms (leading and
// trailing layouts) and adaptive gradient clipping, against fp64 references; bad input.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "gradient_accumulator/gradient_accumulator.h"
#include "test_util.h"

namespace ga_test {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();
const ga_dtype kAllDtypes[] = {kGaFloat32, kGaBFloat16, kGaFloat16, kGaFloat64};

// Runs f with the CPU kernels on `threads` OpenMP threads (no-op without OpenMP).
template <typename F>
void WithThreads(int threads, F&& f) {
#if defined(_OPENMP)
  const int saved = omp_get_max_threads();
  omp_set_num_threads(threads);
  f();
  omp_set_num_threads(saved);
#else
  (void)threads;
  f();
#endif
}

// ---- ga_sum_of_squares ----

TEST(SumOfSquares, MatchesReferenceForEveryDtype) {
  auto rng = Rng(21);
  for (ga_dtype d : kAllDtypes) {
    SCOPED_TRACE(DtypeName(d));
    TensorList l(d, OddSizes());
    l.FillUniform(rng, -3.0, 3.0);
    ExactSum ref;
    for (const auto& v : l.Values())
      for (double x : v) ref.Add(x * x);
    double got = -1.0;
    ASSERT_EQ(ga_sum_of_squares(l.list(), &got), kGaOk) << ga_last_error();
    EXPECT_TRUE(NearScalar(got, ref.Value(), kFp64Compute));
    EXPECT_GT(got, 1e5);  // ~148814 elements of mean square 3
  }
}

TEST(SumOfSquares, Float64WideRange) {
  // fp64 inputs across many binades: the fp64 accumulation must keep ~1e-12 relative accuracy.
  auto rng = Rng(22);
  TensorList l(kGaFloat64, {100003, 16385, 5});
  std::uniform_real_distribution<double> mant(-1.0, 1.0);
  std::uniform_int_distribution<int> expo(-20, 20);
  for (size_t i = 0; i < l.size(); ++i)
    for (int64_t j = 0; j < l[i].numel(); ++j) l[i].Set(j, std::ldexp(mant(rng), expo(rng)));
  ExactSum ref;
  for (const auto& v : l.Values())
    for (double x : v) ref.Add(x * x);
  double got = 0.0;
  ASSERT_EQ(ga_sum_of_squares(l.list(), &got), kGaOk);
  EXPECT_TRUE(NearScalar(got, ref.Value(), kFp64Compute));
}

TEST(SumOfSquares, DeterministicAcrossCallsAndThreadCounts) {
  auto rng = Rng(23);
  TensorList l({kGaFloat32, kGaBFloat16, kGaFloat16, kGaFloat64, kGaFloat32},
               {100003, 16385, 31, 70001, 16384});
  l.FillUniform(rng, -1.0, 1.0);
  double first = 0.0;
  ASSERT_EQ(ga_sum_of_squares(l.list(), &first), kGaOk);
  for (int threads : {1, 2, 3, 8}) {
    WithThreads(threads, [&] {
      for (int rep = 0; rep < 2; ++rep) {
        double again = 0.0;
        ASSERT_EQ(ga_sum_of_squares(l.list(), &again), kGaOk);
        EXPECT_EQ(again, first) << threads << " threads";
      }
    });
  }
}

TEST(SumOfSquares, EmptyInputIsZero) {
  double s = -1.0;
  ASSERT_EQ(ga_sum_of_squares({nullptr, 0}, &s), kGaOk);
  EXPECT_EQ(s, 0.0);
  TensorList l(kGaBFloat16, {0, 0});
  s = -1.0;
  ASSERT_EQ(ga_sum_of_squares(l.list(), &s), kGaOk);
  EXPECT_EQ(s, 0.0);
}

TEST(SumOfSquares, NonfiniteInputGivesNonfiniteSum) {
  auto rng = Rng(24);
  for (ga_dtype d : kAllDtypes) {
    for (double special : {kNaN, kInf, -kInf}) {
      SCOPED_TRACE(testing::Message() << DtypeName(d) << " " << special);
      TensorList l(d, OddSizes());
      l.FillUniform(rng, -1.0, 1.0);
      l[6].Set(16384, special);
      double s = 0.0;
      ASSERT_EQ(ga_sum_of_squares(l.list(), &s), kGaOk);
      if (std::isnan(special))
        EXPECT_TRUE(std::isnan(s));
      else
        EXPECT_EQ(s, kInf);
    }
  }
}

TEST(SumOfSquares, BadInput) {
  TensorList l(kGaFloat32, {3, 5});
  double s = -3.0;
  EXPECT_TRUE(FailsWith(ga_sum_of_squares(l.list(), nullptr), kGaInvalidArgument, {"sumsq"}));
  l.desc(1).numel = -1;
  EXPECT_TRUE(FailsWith(ga_sum_of_squares(l.list(), &s), kGaInvalidArgument, {"tensors[1]"}));
  l.Rebuild();
  SetRaw(l.desc(0).dtype, 8);
  EXPECT_TRUE(FailsWith(ga_sum_of_squares(l.list(), &s), kGaTypeError, {"tensors[0]"}));
  l.Rebuild();
  EXPECT_TRUE(FailsWith(ga_sum_of_squares({nullptr, 2}, &s), kGaInvalidArgument, {"tensors"}));
  if (!ga_has_cuda()) {
    l.desc(1).device_type = kGaCUDA;
    EXPECT_TRUE(FailsWith(ga_sum_of_squares(l.list(), &s), kGaUnsupported, {"tensors[1]"}));
  }
  EXPECT_EQ(s, -3.0);
}

// ---- ga_unitwise_norm ----

// Element indices of unit u of a tensor with `numel` elements in `units` units.
std::vector<int64_t> UnitIndices(int64_t numel, ga_units units, int64_t u) {
  std::vector<int64_t> idx;
  if (numel == 0) return idx;
  const int64_t fan_in = numel / units.num_units;
  for (int64_t j = 0; j < fan_in; ++j)
    idx.push_back(units.layout == kGaUnitsLeading ? u * fan_in + j : j * units.num_units + u);
  return idx;
}

std::vector<double> ReferenceUnitNorms(const std::vector<double>& x, ga_units units) {
  std::vector<double> norms;
  for (int64_t u = 0; u < units.num_units; ++u) {
    ExactSum s;
    for (int64_t i : UnitIndices(static_cast<int64_t>(x.size()), units, u)) s.Add(x[i] * x[i]);
    norms.push_back(std::sqrt(s.Value()));
  }
  return norms;
}

struct Shape {
  int64_t numel;
  int64_t units;
};
const std::vector<Shape> kUnitShapes{{0, 5},      {1, 1},        {7, 7},       {31, 1},
                                     {217, 7},    {16383, 127},  {16384, 128}, {16385, 113},
                                     {100003, 1}, {18450, 2050}, {40000, 400}, {49152, 3}};

TEST(UnitwiseNorm, LeadingAndTrailingEveryDtype) {
  auto rng = Rng(31);
  for (ga_dtype d : kAllDtypes) {
    for (ga_dtype out_dtype : {kGaFloat32, kGaFloat64}) {
      for (ga_unit_layout layout : {kGaUnitsLeading, kGaUnitsTrailing}) {
        for (const Shape& s : kUnitShapes) {
          SCOPED_TRACE(testing::Message()
                       << DtypeName(d) << " -> " << DtypeName(out_dtype) << " layout " << layout
                       << " numel " << s.numel << " units " << s.units);
          TestTensor x(d, s.numel);
          x.FillUniform(rng, -2.0, 2.0);
          const ga_units units{s.units, layout};
          TestTensor norms(out_dtype, s.units);
          ASSERT_EQ(ga_unitwise_norm(x.desc(), units, norms.desc()), kGaOk) << ga_last_error();
          EXPECT_TRUE(
              Near(norms.Values(), ReferenceUnitNorms(x.Values(), units), kFp64Compute, out_dtype));
          EXPECT_TRUE(norms.GuardsIntact());
        }
      }
    }
  }
}

TEST(UnitwiseNorm, LayoutMatters) {
  // 2 units of 3: leading units are rows {1,2,3}, {4,5,6}; trailing units are {1,3,5}, {2,4,6}.
  std::vector<float> x{1, 2, 3, 4, 5, 6};
  std::vector<double> n(2);
  const ga_tensor xt{x.data(), 6, kGaFloat32, kGaCPU, 0};
  const ga_tensor nt{n.data(), 2, kGaFloat64, kGaCPU, 0};
  ASSERT_EQ(ga_unitwise_norm(xt, {2, kGaUnitsLeading}, nt), kGaOk);
  EXPECT_EQ(n, (std::vector<double>{std::sqrt(14.0), std::sqrt(77.0)}));
  ASSERT_EQ(ga_unitwise_norm(xt, {2, kGaUnitsTrailing}, nt), kGaOk);
  EXPECT_EQ(n, (std::vector<double>{std::sqrt(35.0), std::sqrt(56.0)}));
}

TEST(UnitwiseNorm, DeterministicAcrossThreadCounts) {
  auto rng = Rng(32);
  TestTensor x(kGaFloat32, 18450);
  x.FillUniform(rng, -1.0, 1.0);
  for (ga_unit_layout layout : {kGaUnitsLeading, kGaUnitsTrailing}) {
    for (int64_t units : {int64_t{1}, int64_t{2050}}) {
      TestTensor first(kGaFloat64, units), again(kGaFloat64, units);
      ASSERT_EQ(ga_unitwise_norm(x.desc(), {units, layout}, first.desc()), kGaOk);
      for (int threads : {1, 3, 8}) {
        WithThreads(threads, [&] {
          ASSERT_EQ(ga_unitwise_norm(x.desc(), {units, layout}, again.desc()), kGaOk);
          EXPECT_EQ(again.DataBytes(), first.DataBytes()) << threads << " threads";
        });
      }
    }
  }
}

TEST(UnitwiseNorm, BadInputWritesNothing) {
  auto rng = Rng(33);
  TestTensor x(kGaFloat32, 12), norms(kGaFloat32, 3);
  x.FillUniform(rng, -1.0, 1.0);
  norms.FillUniform(rng, 5.0, 6.0);
  const std::vector<uint8_t> before = Snapshot(x, norms);
  auto expect_fail = [&](ga_tensor t, ga_units u, ga_tensor n, ga_status status,
                         std::initializer_list<std::string> args) {
    EXPECT_TRUE(FailsWith(ga_unitwise_norm(t, u, n), status, args));
    EXPECT_EQ(Snapshot(x, norms), before);
  };
  const ga_units ok{3, kGaUnitsLeading};
  expect_fail(x.desc(), {5, kGaUnitsLeading}, norms.desc(), kGaInvalidArgument, {"units"});
  expect_fail(x.desc(), {0, kGaUnitsLeading}, norms.desc(), kGaInvalidArgument, {"units"});
  expect_fail(x.desc(), {-3, kGaUnitsTrailing}, norms.desc(), kGaInvalidArgument, {"units"});
  ga_units bad_layout{3, kGaUnitsLeading};
  SetRaw(bad_layout.layout, 9);
  expect_fail(x.desc(), bad_layout, norms.desc(), kGaInvalidArgument, {"units"});
  expect_fail(x.desc(), {4, kGaUnitsLeading}, norms.desc(), kGaInvalidArgument, {"norms"});
  ga_tensor bad = norms.desc();
  bad.dtype = kGaBFloat16;
  expect_fail(x.desc(), ok, bad, kGaTypeError, {"norms"});
  bad = x.desc();
  bad.numel = -12;
  expect_fail(bad, ok, norms.desc(), kGaInvalidArgument, {"tensor"});
  bad = x.desc();
  SetRaw(bad.dtype, 6);
  expect_fail(bad, ok, norms.desc(), kGaTypeError, {"tensor"});
  // norms inside the tensor's memory.
  const ga_tensor inside{x.at(4), 3, kGaFloat32, kGaCPU, 0};
  expect_fail(x.desc(), ok, inside, kGaInvalidArgument, {"norms", "tensor"});
  if (!ga_has_cuda()) {
    bad = norms.desc();
    bad.device_type = kGaCUDA;
    expect_fail(x.desc(), ok, bad, kGaUnsupported, {"norms"});
  }
}

// ---- ga_adaptive_clip ----

struct AgcTensor {
  int64_t numel;
  ga_units units;
};
const std::vector<AgcTensor> kAgcTensors{
    {0, {1, kGaUnitsLeading}},        {1, {1, kGaUnitsLeading}},
    {7, {7, kGaUnitsTrailing}},       {31, {1, kGaUnitsLeading}},
    {16383, {127, kGaUnitsLeading}},  {16384, {128, kGaUnitsTrailing}},
    {16385, {113, kGaUnitsTrailing}}, {100003, {1, kGaUnitsTrailing}},
    {40000, {400, kGaUnitsLeading}},  {18450, {2050, kGaUnitsTrailing}},
};

// g_u ← g_u · min(1, λ·max(‖w_u‖, ε) / max(‖g_u‖, 1e-6)), in fp64.
std::vector<double> ReferenceAgc(const std::vector<double>& w, const std::vector<double>& g,
                                 ga_units units, double lambda, double eps, int64_t* clipped) {
  std::vector<double> out(g);
  const std::vector<double> wn = ReferenceUnitNorms(w, units), gn = ReferenceUnitNorms(g, units);
  for (int64_t u = 0; u < units.num_units; ++u) {
    const double c = std::min(1.0, lambda * std::max(wn[u], eps) / std::max(gn[u], 1e-6));
    if (c < 1.0) ++*clipped;
    for (int64_t i : UnitIndices(static_cast<int64_t>(g.size()), units, u)) out[i] = g[i] * c;
  }
  return out;
}

// Gradients whose unit norms are λ·‖w_u‖ times a factor in [0.1, 10]: about half the units are
// clipped. Unit 0 of every tensor with several units gets zero parameters (ε takes over).
void MakeAgcData(std::mt19937_64& rng, TensorList& params, TensorList& grads,
                 const std::vector<ga_units>& units, double lambda) {
  params.FillUniform(rng, -1.0, 1.0);
  grads.FillUniform(rng, -1.0, 1.0);
  std::uniform_real_distribution<double> log_factor(std::log(0.1), std::log(10.0));
  for (size_t i = 0; i < params.size(); ++i) {
    const int64_t n = params[i].numel();
    if (n == 0) continue;
    if (units[i].num_units > 1)
      for (int64_t j : UnitIndices(n, units[i], 0)) params[i].Set(j, 0.0);
    const std::vector<double> w = params[i].Values(), g = grads[i].Values();
    const std::vector<double> wn = ReferenceUnitNorms(w, units[i]);
    const std::vector<double> gn = ReferenceUnitNorms(g, units[i]);
    for (int64_t u = 0; u < units[i].num_units; ++u) {
      const double target = lambda * std::max(wn[u], 1e-3) * std::exp(log_factor(rng));
      for (int64_t j : UnitIndices(n, units[i], u)) grads[i].Set(j, g[j] * target / gn[u]);
    }
  }
}

TEST(AdaptiveClip, MatchesNfnetsRuleForEveryParamDtype) {
  auto rng = Rng(41);
  std::vector<int64_t> sizes;
  std::vector<ga_units> units;
  for (const AgcTensor& t : kAgcTensors) {
    sizes.push_back(t.numel);
    units.push_back(t.units);
  }
  const double lambda = 0.01, eps = 1e-3;
  for (ga_dtype pd : {kGaFloat32, kGaBFloat16, kGaFloat16}) {
    SCOPED_TRACE(DtypeName(pd));
    TensorList params(pd, sizes), grads(kGaFloat32, sizes);
    MakeAgcData(rng, params, grads, units, lambda);
    const std::vector<uint8_t> params_before = params.Bytes();
    int64_t clipped = 0, total_units = 0;
    std::vector<std::vector<double>> want;
    for (size_t i = 0; i < sizes.size(); ++i) {
      want.push_back(
          ReferenceAgc(params[i].Values(), grads[i].Values(), units[i], lambda, eps, &clipped));
      total_units += units[i].num_units;
    }
    ASSERT_EQ(ga_adaptive_clip(params.list(), grads.list(), units.data(), lambda, eps), kGaOk)
        << ga_last_error();
    for (size_t i = 0; i < sizes.size(); ++i)
      EXPECT_TRUE(Near(grads[i].Values(), want[i], kFp32Compute, kGaFloat32)) << "tensor " << i;
    EXPECT_EQ(params.Bytes(), params_before);
    EXPECT_TRUE(grads.GuardsIntact());
    // Both branches of the rule were exercised.
    EXPECT_GT(clipped, total_units / 4);
    EXPECT_LT(clipped, total_units * 3 / 4);
  }
}

TEST(AdaptiveClip, HandExample) {
  // One unit: ‖w‖ = 5, ‖g‖ = 10, λ = 0.5 → factor 0.25. Second unit with ‖g‖ tiny stays.
  std::vector<float> w{3, 4, 0, 0}, g{6, 8, 1e-8f, 0};
  const ga_tensor wt{w.data(), 4, kGaFloat32, kGaCPU, 0}, gt{g.data(), 4, kGaFloat32, kGaCPU, 0};
  const ga_units u{2, kGaUnitsLeading};
  ASSERT_EQ(ga_adaptive_clip({&wt, 1}, {&gt, 1}, &u, 0.5, 1e-3), kGaOk);
  EXPECT_EQ(g, (std::vector<float>{1.5f, 2.0f, 1e-8f, 0.0f}));
  // ‖w‖ = 0: the bound is λ·ε = 0.5·0.1 = 0.05 → g = (0.6, 0.8) · 0.05 / 1.
  std::vector<float> w2{0, 0}, g2{0.6f, 0.8f};
  const ga_tensor w2t{w2.data(), 2, kGaFloat32, kGaCPU, 0};
  const ga_tensor g2t{g2.data(), 2, kGaFloat32, kGaCPU, 0};
  const ga_units one{1, kGaUnitsTrailing};
  ASSERT_EQ(ga_adaptive_clip({&w2t, 1}, {&g2t, 1}, &one, 0.5, 0.1), kGaOk);
  EXPECT_NEAR(g2[0], 0.03, 1e-8);
  EXPECT_NEAR(g2[1], 0.04, 1e-8);
}

TEST(AdaptiveClip, EmptyList) {
  EXPECT_EQ(ga_adaptive_clip({nullptr, 0}, {nullptr, 0}, nullptr, 0.01, 1e-3), kGaOk)
      << ga_last_error();
}

class AdaptiveClipBadInput : public ::testing::Test {
 protected:
  AdaptiveClipBadInput()
      : params_(kGaBFloat16, {12, 31}),
        grads_(kGaFloat32, {12, 31}),
        units_{{3, kGaUnitsLeading}, {1, kGaUnitsTrailing}} {
    auto rng = Rng(42);
    params_.FillUniform(rng, -1.0, 1.0);
    grads_.FillUniform(rng, -1.0, 1.0);
    before_ = Snapshot(params_, grads_);
  }
  void ExpectFail(ga_status status, std::initializer_list<std::string> args, const ga_units* units,
                  double lambda = 0.01, double eps = 1e-3, ga_tensor_list params = {nullptr, -9},
                  ga_tensor_list grads = {nullptr, -9}) {
    if (params.size == -9) params = params_.list();
    if (grads.size == -9) grads = grads_.list();
    EXPECT_TRUE(FailsWith(ga_adaptive_clip(params, grads, units, lambda, eps), status, args));
    EXPECT_EQ(Snapshot(params_, grads_), before_);
    params_.Rebuild();
    grads_.Rebuild();
  }
  TensorList params_, grads_;
  std::vector<ga_units> units_;
  std::vector<uint8_t> before_;
};

TEST_F(AdaptiveClipBadInput, HyperParameters) {
  ExpectFail(kGaInvalidArgument, {"units"}, nullptr);
  for (double lambda : {0.0, -1.0, kNaN, kInf})
    ExpectFail(kGaInvalidArgument, {"clip_factor"}, units_.data(), lambda);
  for (double eps : {-1e-3, kNaN, kInf})
    ExpectFail(kGaInvalidArgument, {"eps"}, units_.data(), 0.01, eps);
}

TEST_F(AdaptiveClipBadInput, Units) {
  std::vector<ga_units> bad = units_;
  bad[1] = {2, kGaUnitsLeading};  // 2 does not divide 31
  ExpectFail(kGaInvalidArgument, {"units[1]"}, bad.data());
  bad = units_;
  bad[0] = {5, kGaUnitsTrailing};
  ExpectFail(kGaInvalidArgument, {"units[0]"}, bad.data());
  bad = units_;
  bad[0] = {0, kGaUnitsLeading};
  ExpectFail(kGaInvalidArgument, {"units[0]"}, bad.data());
  bad = units_;
  SetRaw(bad[1].layout, 3);
  ExpectFail(kGaInvalidArgument, {"units[1]"}, bad.data());
}

TEST_F(AdaptiveClipBadInput, ListsAndDtypes) {
  ExpectFail(kGaInvalidArgument, {"params", "grads"}, units_.data(), 0.01, 1e-3,
             {params_.list().tensors, 1});
  params_.desc(1).numel = 30;
  ExpectFail(kGaInvalidArgument, {"params[1]", "grads[1]"}, units_.data());
  TestTensor f64(kGaFloat64, 12);
  params_.desc(0) = f64.desc();
  ExpectFail(kGaTypeError, {"params[0]"}, units_.data());
  grads_.desc(1).dtype = kGaBFloat16;
  ExpectFail(kGaTypeError, {"grads[1]"}, units_.data());
  grads_.desc(0).numel = -12;
  ExpectFail(kGaInvalidArgument, {"grads[0]"}, units_.data());
}

TEST_F(AdaptiveClipBadInput, GradsAliasingParams) {
  TestTensor shared(kGaFloat32, 12);
  params_.desc(0) = shared.desc();
  grads_.desc(0) = shared.desc();
  const std::vector<uint8_t> shared_before = shared.Bytes();
  ExpectFail(kGaInvalidArgument, {"grads[0]", "params[0]"}, units_.data());
  EXPECT_EQ(shared.Bytes(), shared_before);
  grads_.desc(1).data = grads_[0].at(0);  // grads[1] (31 floats) runs over grads[0]
  grads_.desc(1).numel = 12;
  params_.desc(1).numel = 12;
  std::vector<ga_units> u = units_;
  ExpectFail(kGaInvalidArgument, {"grads[0]", "grads[1]"}, u.data());
}

}  // namespace
}  // namespace ga_test
