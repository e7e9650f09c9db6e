// Tests of the accumulate op family: weighted sums, first-step overwrite, running mean,
// the fused non-finite check and Σacc², against fp64 references; bad input.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "gradient_accumulator/gradient_accumulator.h"
#include "test_util.h"

namespace ga_test {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

ga_accumulate_options Options(ga_accumulate_mode mode, double weight, double before,
                              int overwrite) {
  ga_accumulate_options o{};
  o.mode = mode;
  o.weight = weight;
  o.weight_before = before;
  o.overwrite = overwrite;
  return o;
}

// Compute bound of the accumulator's arithmetic: fp32 accumulators are updated in fp32,
// fp64 accumulators in fp64.
double ComputeBound(ga_dtype acc) { return acc == kGaFloat64 ? kFp64Compute : kFp32Compute; }

// One step of the fp64 reference from the values the accumulators hold now.
struct StepRef {
  std::vector<std::vector<double>> want, mag;
};

StepRef Reference(const TensorList& acc, const TensorList& grads, const ga_accumulate_options& o) {
  StepRef r;
  const double w = o.weight;
  const double before = o.overwrite ? 0.0 : o.weight_before;
  for (size_t i = 0; i < acc.size(); ++i) {
    const std::vector<double> a = acc[i].Values(), g = grads[i].Values();
    std::vector<double> want(a.size()), mag(a.size());
    for (size_t j = 0; j < a.size(); ++j) {
      if (o.mode == kGaAccumulateSum) {
        const double prev = o.overwrite ? 0.0 : a[j];
        want[j] = prev + w * g[j];
        mag[j] = std::fabs(prev) + std::fabs(w * g[j]);
      } else {
        const double total = before + w;
        const double prev = o.overwrite ? 0.0 : a[j] * (before / total);
        want[j] = prev + g[j] * (w / total);
        mag[j] = std::fabs(prev) + std::fabs(g[j] * (w / total));
      }
    }
    r.want.push_back(want);
    r.mag.push_back(mag);
  }
  return r;
}

::testing::AssertionResult MatchesReference(const TensorList& acc, const StepRef& ref,
                                            double compute) {
  for (size_t i = 0; i < acc.size(); ++i) {
    ::testing::AssertionResult r =
        Near(acc[i].Values(), ref.want[i], ref.mag[i], compute, acc[i].dtype());
    if (!r) return r << " (tensor " << i << ", numel " << acc[i].numel() << ")";
  }
  return ::testing::AssertionSuccess();
}

double AllSumSquares(const TensorList& l) {
  ExactSum s;
  for (size_t i = 0; i < l.size(); ++i)
    for (double v : l[i].Values()) s.Add(v * v);
  return s.Value();
}

class AccumulateDtypes : public ::testing::TestWithParam<std::tuple<ga_dtype, ga_dtype>> {};

TEST_P(AccumulateDtypes, WeightedSumOverACycle) {
  const auto [acc_dtype, grad_dtype] = GetParam();
  auto rng = Rng(11);
  TensorList acc(acc_dtype, OddSizes());
  acc.FillUniform(rng, -100.0, 100.0);  // stale values: the first step must not read them
  const std::vector<double> weights{1.5, 0.25, 3.0, 1.0};
  std::vector<std::vector<double>> cycle(acc.size()), cycle_mag(acc.size());
  for (size_t i = 0; i < acc.size(); ++i) {
    cycle[i].assign(acc[i].numel(), 0.0);
    cycle_mag[i].assign(acc[i].numel(), 0.0);
  }
  for (size_t k = 0; k < weights.size(); ++k) {
    SCOPED_TRACE(testing::Message() << "step " << k);
    TensorList grads(grad_dtype, OddSizes());
    grads.FillUniform(rng, -2.0, 2.0);
    const ga_accumulate_options o = Options(kGaAccumulateSum, weights[k], 0.0, k == 0);
    const StepRef ref = Reference(acc, grads, o);
    const int want_sumsq = k % 2 == 0;
    ga_accumulate_result res{-1, -1.0};
    ASSERT_EQ(ga_accumulate(acc.list(), grads.list(), &o, want_sumsq, &res), kGaOk)
        << ga_last_error();
    EXPECT_EQ(res.nonfinite, 0);
    EXPECT_TRUE(MatchesReference(acc, ref, ComputeBound(acc_dtype)));
    if (want_sumsq) EXPECT_TRUE(NearScalar(res.sumsq, AllSumSquares(acc), kFp64Compute));
    EXPECT_TRUE(acc.GuardsIntact());
    EXPECT_TRUE(grads.GuardsIntact());
    for (size_t i = 0; i < acc.size(); ++i) {
      const std::vector<double> g = grads[i].Values();
      for (size_t j = 0; j < g.size(); ++j) {
        cycle[i][j] += weights[k] * g[j];
        cycle_mag[i][j] += std::fabs(weights[k] * g[j]);
      }
    }
  }
  // The whole cycle against Σ_k w_k·g_k: k fp32 roundings of the running sum, far inside one
  // bf16 rounding (the design's precision promise for bf16 gradients).
  for (size_t i = 0; i < acc.size(); ++i) {
    EXPECT_TRUE(Near(acc[i].Values(), cycle[i], cycle_mag[i],
                     weights.size() * ComputeBound(acc_dtype), acc_dtype))
        << "tensor " << i;
  }
}

TEST_P(AccumulateDtypes, RunningMeanIsTheWeightedMean) {
  const auto [acc_dtype, grad_dtype] = GetParam();
  auto rng = Rng(12);
  TensorList acc(acc_dtype, OddSizes());
  acc.FillUniform(rng, -100.0, 100.0);
  const std::vector<double> weights{2.0, 0.5, 3.0, 7.0};
  std::vector<std::vector<double>> weighted(acc.size()), mag(acc.size());
  for (size_t i = 0; i < acc.size(); ++i) {
    weighted[i].assign(acc[i].numel(), 0.0);
    mag[i].assign(acc[i].numel(), 0.0);
  }
  double before = 0.0;
  for (size_t k = 0; k < weights.size(); ++k) {
    SCOPED_TRACE(testing::Message() << "step " << k);
    TensorList grads(grad_dtype, OddSizes());
    grads.FillUniform(rng, -2.0, 2.0);
    // On the first step weight_before is ignored (a stale value is passed on purpose).
    const ga_accumulate_options o =
        Options(kGaAccumulateRunningMean, weights[k], k == 0 ? 123.0 : before, k == 0);
    const StepRef ref = Reference(acc, grads, o);
    ga_accumulate_result res{-1, -1.0};
    ASSERT_EQ(ga_accumulate(acc.list(), grads.list(), &o, 1, &res), kGaOk) << ga_last_error();
    EXPECT_EQ(res.nonfinite, 0);
    EXPECT_TRUE(MatchesReference(acc, ref, 2 * ComputeBound(acc_dtype)));
    EXPECT_TRUE(NearScalar(res.sumsq, AllSumSquares(acc), kFp64Compute));
    before += weights[k];
    for (size_t i = 0; i < acc.size(); ++i) {
      const std::vector<double> g = grads[i].Values();
      for (size_t j = 0; j < g.size(); ++j) {
        weighted[i][j] += weights[k] * g[j];
        mag[i][j] += std::fabs(weights[k] * g[j]);
      }
    }
    // After every step the accumulator holds Σ w·g / Σ w.
    for (size_t i = 0; i < acc.size(); ++i) {
      std::vector<double> mean(weighted[i]), m(mag[i]);
      for (size_t j = 0; j < mean.size(); ++j) {
        mean[j] /= before;
        m[j] /= before;
      }
      EXPECT_TRUE(Near(acc[i].Values(), mean, m, 3 * (k + 1) * ComputeBound(acc_dtype), acc_dtype))
          << "tensor " << i;
    }
  }
}

TEST_P(AccumulateDtypes, NonfiniteGradientsAreFlagged) {
  const auto [acc_dtype, grad_dtype] = GetParam();
  auto rng = Rng(13);
  TensorList acc(acc_dtype, OddSizes());
  // (tensor, element) positions: first element, a chunk's last element, the very last element.
  const std::vector<std::pair<size_t, int64_t>> spots{{1, 0}, {5, 16383}, {6, 16384}, {7, 100002}};
  for (double special : {kNaN, kInf, -kInf}) {
    for (const auto& [ti, el] : spots) {
      for (int overwrite : {1, 0}) {
        for (ga_accumulate_mode mode : {kGaAccumulateSum, kGaAccumulateRunningMean}) {
          SCOPED_TRACE(testing::Message() << special << " at " << ti << "/" << el << " overwrite "
                                          << overwrite << " mode " << mode);
          TensorList grads(grad_dtype, OddSizes());
          grads.FillUniform(rng, -1.0, 1.0);
          acc.FillUniform(rng, -1.0, 1.0);
          grads[ti].Set(el, special);
          const ga_accumulate_options o = Options(mode, 0.5, 1.0, overwrite);
          const StepRef ref = Reference(acc, grads, o);
          ga_accumulate_result res{-1, 0.0};
          ASSERT_EQ(ga_accumulate(acc.list(), grads.list(), &o, 1, &res), kGaOk);
          EXPECT_EQ(res.nonfinite, 1);
          EXPECT_FALSE(std::isfinite(res.sumsq));
          // The pass still completes: every other element is updated as usual.
          EXPECT_TRUE(MatchesReference(acc, ref, 2 * ComputeBound(acc_dtype)));
        }
      }
    }
  }
  // The flag is per call: a finite call right after reports 0, also for the largest value that
  // is finite in both the gradient's and the accumulator's format.
  TensorList grads(grad_dtype, OddSizes());
  grads.FillUniform(rng, -1.0, 1.0);
  const double big = grad_dtype == kGaFloat16    ? 65504.0
                     : grad_dtype == kGaBFloat16 ? DecodeBf16(0x7f7f)
                     : grad_dtype == kGaFloat32 || acc_dtype == kGaFloat32
                         ? std::numeric_limits<float>::max()
                         : std::numeric_limits<double>::max();
  grads[7].Set(5, big);
  grads[7].Set(6, -big);
  ga_accumulate_result res{-1, 0.0};
  const ga_accumulate_options o = Options(kGaAccumulateSum, 1.0, 0.0, 1);
  ASSERT_EQ(ga_accumulate(acc.list(), grads.list(), &o, 0, &res), kGaOk);
  EXPECT_EQ(res.nonfinite, 0);
}

INSTANTIATE_TEST_SUITE_P(AllDtypes, AccumulateDtypes,
                         ::testing::Combine(::testing::Values(kGaFloat32, kGaFloat64),
                                            ::testing::Values(kGaFloat32, kGaBFloat16, kGaFloat16,
                                                              kGaFloat64)),
                         [](const ::testing::TestParamInfo<AccumulateDtypes::ParamType>& info) {
                           return std::string("acc_") + DtypeName(std::get<0>(info.param)) +
                                  "_grad_" + DtypeName(std::get<1>(info.param));
                         });

TEST(Accumulate, OverwriteNeverReadsTheAccumulator) {
  auto rng = Rng(14);
  for (ga_dtype gd : {kGaFloat32, kGaBFloat16, kGaFloat16}) {
    SCOPED_TRACE(DtypeName(gd));
    TensorList acc(kGaFloat32, OddSizes()), grads(gd, OddSizes());
    grads.FillUniform(rng, -3.0, 3.0);
    for (size_t i = 0; i < acc.size(); ++i)
      for (int64_t j = 0; j < acc[i].numel(); ++j) acc[i].Set(j, j % 2 ? kNaN : kInf);
    // A power-of-two weight makes w·g exact, so the result must equal it bit for bit.
    for (double w : {1.0, 0.5}) {
      for (ga_accumulate_mode mode : {kGaAccumulateSum, kGaAccumulateRunningMean}) {
        const ga_accumulate_options o = Options(mode, w, 5.0, 1);
        ga_accumulate_result res{-1, 0.0};
        ASSERT_EQ(ga_accumulate(acc.list(), grads.list(), &o, 1, &res), kGaOk);
        EXPECT_EQ(res.nonfinite, 0);
        EXPECT_TRUE(std::isfinite(res.sumsq));
        const double factor = mode == kGaAccumulateSum ? w : 1.0;  // running mean: w / w
        for (size_t i = 0; i < acc.size(); ++i) {
          const std::vector<double> a = acc[i].Values(), g = grads[i].Values();
          for (size_t j = 0; j < a.size(); ++j) ASSERT_EQ(a[j], factor * g[j]) << i << "/" << j;
        }
        for (size_t i = 0; i < acc.size(); ++i)
          for (int64_t j = 0; j < acc[i].numel(); ++j) acc[i].Set(j, kNaN);
      }
    }
  }
}

TEST(Accumulate, LargeOverwrite) {
  // A first step writing more than 16 MiB without Σacc² (the path that may stream its stores),
  // unaligned, with an odd tail; w = 0.5 keeps w·g exact, so results must match bit for bit.
  auto rng = Rng(18);
  const std::vector<int64_t> sizes{(int64_t{1} << 22) + 13, 7, 100003};
  for (ga_dtype gd : {kGaFloat32, kGaBFloat16, kGaFloat16}) {
    SCOPED_TRACE(DtypeName(gd));
    TensorList acc(kGaFloat32, sizes), grads(gd, sizes);
    acc.FillUniform(rng, -1.0, 1.0);
    grads.FillUniform(rng, -8.0, 8.0);
    const ga_accumulate_options o = Options(kGaAccumulateSum, 0.5, 0.0, 1);
    ga_accumulate_result res{-1, 0.0};
    ASSERT_EQ(ga_accumulate(acc.list(), grads.list(), &o, 0, &res), kGaOk);
    EXPECT_EQ(res.nonfinite, 0);
    for (size_t i = 0; i < sizes.size(); ++i) {
      const std::vector<double> a = acc[i].Values(), g = grads[i].Values();
      int64_t bad = 0;
      for (size_t j = 0; j < a.size(); ++j) bad += a[j] != 0.5 * g[j];
      EXPECT_EQ(bad, 0) << "tensor " << i;
    }
    EXPECT_TRUE(acc.GuardsIntact());
    // A NaN deep inside the large tensor is still seen.
    grads[0].Set(3000001, kNaN);
    ASSERT_EQ(ga_accumulate(acc.list(), grads.list(), &o, 0, &res), kGaOk);
    EXPECT_EQ(res.nonfinite, 1);
    EXPECT_TRUE(std::isnan(acc[0].Get(3000001)));
    EXPECT_EQ(acc[0].Get(3000002), 0.5 * grads[0].Get(3000002));
  }
}

TEST(Accumulate, ExactSmallExample) {
  // acc ← 2·g on the first step, then + 0.5·g: every number is exact in binary.
  std::vector<float> acc{9, 9, 9}, g1{1, -2, 0.25f}, g2{4, 8, -1};
  ga_tensor a{acc.data(), 3, kGaFloat32, kGaCPU, 0};
  ga_tensor t1{g1.data(), 3, kGaFloat32, kGaCPU, 0}, t2{g2.data(), 3, kGaFloat32, kGaCPU, 0};
  ga_accumulate_options o = Options(kGaAccumulateSum, 2.0, 0.0, 1);
  ga_accumulate_result res{-1, -1.0};
  ASSERT_EQ(ga_accumulate({&a, 1}, {&t1, 1}, &o, 1, &res), kGaOk);
  EXPECT_EQ(acc, (std::vector<float>{2, -4, 0.5f}));
  EXPECT_EQ(res.sumsq, 4.0 + 16.0 + 0.25);
  o = Options(kGaAccumulateSum, 0.5, 0.0, 0);
  ASSERT_EQ(ga_accumulate({&a, 1}, {&t2, 1}, &o, 1, &res), kGaOk);
  EXPECT_EQ(acc, (std::vector<float>{4, 0, 0}));
  EXPECT_EQ(res.sumsq, 16.0);
  // Running mean of (2, 0, 1) with weight 1 and (4, 8, −1) with weight 3 = (3.5, 6, −0.5).
  std::vector<float> g0{2, 0, 1};
  ga_tensor t0{g0.data(), 3, kGaFloat32, kGaCPU, 0};
  o = Options(kGaAccumulateRunningMean, 1.0, 0.0, 1);
  ASSERT_EQ(ga_accumulate({&a, 1}, {&t0, 1}, &o, 0, nullptr), kGaOk);
  o = Options(kGaAccumulateRunningMean, 3.0, 1.0, 0);
  ASSERT_EQ(ga_accumulate({&a, 1}, {&t2, 1}, &o, 0, nullptr), kGaOk);
  EXPECT_EQ(acc, (std::vector<float>{3.5f, 6.0f, -0.5f}));
}

TEST(Accumulate, ZeroWeightLeavesTheSum) {
  auto rng = Rng(15);
  TensorList acc(kGaFloat32, OddSizes()), grads(kGaBFloat16, OddSizes());
  acc.FillUniform(rng, 1.0, 2.0);
  grads.FillUniform(rng, -1.0, 1.0);
  const auto before = acc.Values();
  const ga_accumulate_options o = Options(kGaAccumulateSum, 0.0, 0.0, 0);
  ASSERT_EQ(ga_accumulate(acc.list(), grads.list(), &o, 0, nullptr), kGaOk);
  EXPECT_EQ(acc.Values(), before);
}

TEST(Accumulate, SumsqIsDeterministic) {
  auto rng = Rng(16);
  TensorList acc(kGaFloat32, OddSizes()), grads(kGaFloat16, OddSizes());
  grads.FillUniform(rng, -1.0, 1.0);
  const ga_accumulate_options o = Options(kGaAccumulateSum, 1.0, 0.0, 1);
  ga_accumulate_result r1{}, r2{};
  ASSERT_EQ(ga_accumulate(acc.list(), grads.list(), &o, 1, &r1), kGaOk);
  ASSERT_EQ(ga_accumulate(acc.list(), grads.list(), &o, 1, &r2), kGaOk);
  EXPECT_EQ(r1.sumsq, r2.sumsq);
  EXPECT_GT(r1.sumsq, 1000.0);
}

TEST(Accumulate, EmptyListsAndEmptyTensors) {
  const ga_accumulate_options o = Options(kGaAccumulateSum, 1.0, 0.0, 0);
  ga_accumulate_result res{-1, -1.0};
  ASSERT_EQ(ga_accumulate({nullptr, 0}, {nullptr, 0}, &o, 1, &res), kGaOk);
  EXPECT_EQ(res.nonfinite, 0);
  EXPECT_EQ(res.sumsq, 0.0);
  ga_tensor a{nullptr, 0, kGaFloat32, kGaCPU, 0}, g{nullptr, 0, kGaBFloat16, kGaCPU, 0};
  res = {-1, -1.0};
  ASSERT_EQ(ga_accumulate({&a, 1}, {&g, 1}, &o, 1, &res), kGaOk);
  EXPECT_EQ(res.nonfinite, 0);
  EXPECT_EQ(res.sumsq, 0.0);
}

// ---- bad input: status, argument name, and not one byte written ----

class AccumulateBadInput : public ::testing::Test {
 protected:
  AccumulateBadInput() : acc_(kGaFloat32, {7, 31, 16385}), grads_(kGaBFloat16, {7, 31, 16385}) {
    auto rng = Rng(17);
    acc_.FillUniform(rng, -1.0, 1.0);
    grads_.FillUniform(rng, -1.0, 1.0);
    before_ = Snapshot(acc_, grads_);
  }
  // Runs one call that must fail; restores the descriptors afterwards.
  void ExpectFail(const ga_accumulate_options* o, ga_status status,
                  std::initializer_list<std::string> args, ga_tensor_list acc_list = {nullptr, -9},
                  ga_tensor_list grad_list = {nullptr, -9}) {
    if (acc_list.size == -9) acc_list = acc_.list();
    if (grad_list.size == -9) grad_list = grads_.list();
    ga_accumulate_result res{-5, -5.0};
    EXPECT_TRUE(FailsWith(ga_accumulate(acc_list, grad_list, o, 1, &res), status, args));
    EXPECT_EQ(res.nonfinite, -5);
    EXPECT_EQ(res.sumsq, -5.0);
    EXPECT_EQ(Snapshot(acc_, grads_), before_);
    acc_.Rebuild();
    grads_.Rebuild();
  }
  TensorList acc_, grads_;
  std::vector<uint8_t> before_;
  ga_accumulate_options ok_ = Options(kGaAccumulateSum, 1.0, 0.0, 0);
};

TEST_F(AccumulateBadInput, Options) {
  ExpectFail(nullptr, kGaInvalidArgument, {"options"});
  for (double w : {kNaN, kInf, -1.0}) {
    const ga_accumulate_options o = Options(kGaAccumulateSum, w, 0.0, 0);
    ExpectFail(&o, kGaInvalidArgument, {"weight"});
  }
  for (double b : {kNaN, -1.0, kInf}) {
    const ga_accumulate_options o = Options(kGaAccumulateRunningMean, 1.0, b, 0);
    ExpectFail(&o, kGaInvalidArgument, {"weight_before"});
  }
  const ga_accumulate_options zero_total = Options(kGaAccumulateRunningMean, 0.0, 0.0, 0);
  ExpectFail(&zero_total, kGaInvalidArgument, {"weight"});
  ga_accumulate_options bad_mode = Options(kGaAccumulateSum, 1.0, 0.0, 0);
  SetRaw(bad_mode.mode, 7);
  ExpectFail(&bad_mode, kGaInvalidArgument, {"mode"});
}

TEST_F(AccumulateBadInput, Lists) {
  ExpectFail(&ok_, kGaInvalidArgument, {"grads"}, acc_.list(), {grads_.list().tensors, 2});
  ExpectFail(&ok_, kGaInvalidArgument, {"grads", "accumulators"}, {acc_.list().tensors, 2},
             grads_.list());
  ExpectFail(&ok_, kGaInvalidArgument, {"accumulators"}, {nullptr, 3});
  ExpectFail(&ok_, kGaInvalidArgument, {"grads"}, acc_.list(), {nullptr, 3});
  ExpectFail(&ok_, kGaInvalidArgument, {"accumulators"}, {acc_.list().tensors, -1});
  grads_.desc(1).numel = 30;
  ExpectFail(&ok_, kGaInvalidArgument, {"grads[1]"});
  acc_.desc(2).numel = 16384;
  ExpectFail(&ok_, kGaInvalidArgument, {"grads[2]"});
  acc_.desc(0).numel = -7;
  ExpectFail(&ok_, kGaInvalidArgument, {"accumulators[0]"});
  grads_.desc(2).data = nullptr;
  ExpectFail(&ok_, kGaInvalidArgument, {"grads[2]"});
  acc_.desc(1).data = static_cast<uint8_t*>(acc_[1].data()) + 2;  // not 4-byte aligned
  ExpectFail(&ok_, kGaInvalidArgument, {"accumulators[1]"});
}

TEST_F(AccumulateBadInput, Dtypes) {
  acc_.desc(1).dtype = kGaBFloat16;
  ExpectFail(&ok_, kGaTypeError, {"accumulators[1]"});
  acc_.desc(0).dtype = kGaFloat16;
  ExpectFail(&ok_, kGaTypeError, {"accumulators[0]"});
  SetRaw(grads_.desc(2).dtype, 11);
  ExpectFail(&ok_, kGaTypeError, {"grads[2]"});
}

TEST_F(AccumulateBadInput, Devices) {
  grads_.desc(1).device_type = kGaCUDA;
  ExpectFail(&ok_, UnsupportedOrTypeError(), {"grads[1]"});
  SetRaw(acc_.desc(0).device_type, 4);
  ExpectFail(&ok_, kGaTypeError, {"accumulators[0]"});
}

TEST_F(AccumulateBadInput, Aliasing) {
  // An accumulator viewing a gradient's memory (same dtype size so the ranges coincide).
  TestTensor shared(kGaFloat32, 31);
  const std::vector<uint8_t> shared_before = shared.Bytes();
  acc_.desc(1).data = shared.data();
  grads_.desc(1) = ga_tensor{shared.data(), 31, kGaFloat32, kGaCPU, 0};
  ExpectFail(&ok_, kGaInvalidArgument, {"accumulators[1]", "grads[1]"});
  EXPECT_EQ(shared.Bytes(), shared_before);
  // A partial overlap: accumulators[0] starts inside grads[2].
  acc_.desc(0).data = grads_[2].at(100);
  ExpectFail(&ok_, kGaInvalidArgument, {"accumulators[0]", "grads[2]"});
  // Two accumulators overlapping each other: accumulators[1] views elements 10..40 of [2].
  acc_.desc(1).data = acc_[2].at(10);
  ExpectFail(&ok_, kGaInvalidArgument, {"accumulators[1]", "accumulators[2]"});
}

}  // namespace
}  // namespace ga_test
