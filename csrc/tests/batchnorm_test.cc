// Tests of the batch-norm op family: per-channel moments (NCHW and channels-last), Chan's merge
// and the once-per-cycle running-statistics update, against fp64 references; bad input.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "gradient_accumulator/gradient_accumulator.h"
#include "test_util.h"

namespace ga_test {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();
const ga_dtype kAllDtypes[] = {kGaFloat32, kGaBFloat16, kGaFloat16, kGaFloat64};

struct Nchw {
  int64_t n, c, h, w;
  int64_t numel() const { return n * c * h * w; }
};

// Two-pass fp64 moments of NCHW data, per channel, plus Σ|x| / count for error bounds.
struct Moments {
  std::vector<double> mean, m2, abs_mean;
  double count = 0;
};
Moments ReferenceMoments(const std::vector<double>& x, const Nchw& s) {
  Moments r;
  const int64_t inner = s.h * s.w;
  r.count = static_cast<double>(s.n * inner);
  for (int64_t c = 0; c < s.c; ++c) {
    ExactSum sum, abs_sum;
    for (int64_t n = 0; n < s.n; ++n)
      for (int64_t j = 0; j < inner; ++j) {
        sum.Add(x[(n * s.c + c) * inner + j]);
        abs_sum.Add(std::fabs(x[(n * s.c + c) * inner + j]));
      }
    const double mean = r.count > 0 ? sum.Value() / r.count : 0.0;
    ExactSum q;
    for (int64_t n = 0; n < s.n; ++n)
      for (int64_t j = 0; j < inner; ++j) {
        const double d = x[(n * s.c + c) * inner + j] - mean;
        q.Add(d * d);
      }
    r.mean.push_back(mean);
    r.m2.push_back(q.Value());
    r.abs_mean.push_back(r.count > 0 ? abs_sum.Value() / r.count : 0.0);
  }
  return r;
}

// NCHW → NHWC copy (values as doubles).
std::vector<double> ToChannelsLast(const std::vector<double>& x, const Nchw& s) {
  std::vector<double> y(x.size());
  const int64_t inner = s.h * s.w;
  for (int64_t n = 0; n < s.n; ++n)
    for (int64_t c = 0; c < s.c; ++c)
      for (int64_t j = 0; j < inner; ++j)
        y[(n * inner + j) * s.c + c] = x[(n * s.c + c) * inner + j];
  return y;
}

// Per-channel data: channel c has mean offset + c and unit spread.
void FillChannels(TestTensor& x, const Nchw& s, double offset, double spread, uint64_t seed) {
  auto rng = Rng(seed);
  std::uniform_real_distribution<double> u(-spread, spread);
  const int64_t inner = s.h * s.w;
  for (int64_t n = 0; n < s.n; ++n)
    for (int64_t c = 0; c < s.c; ++c)
      for (int64_t j = 0; j < inner; ++j) x.Set((n * s.c + c) * inner + j, offset + c + u(rng));
}

double Bound(ga_dtype stats) { return stats == kGaFloat64 ? kFp64Compute : kFp32Compute; }

::testing::AssertionResult StatsMatch(const TestTensor& mean, const TestTensor& m2,
                                      const Moments& ref, double compute) {
  ::testing::AssertionResult r = Near(mean.Values(), ref.mean, ref.abs_mean, compute, mean.dtype());
  if (!r) return r << " (mean)";
  r = Near(m2.Values(), ref.m2, compute, m2.dtype());
  if (!r) return r << " (m2)";
  return ::testing::AssertionSuccess();
}

const std::vector<Nchw> kShapes{{3, 5, 7, 11},   {1, 1, 1, 100003}, {16385, 3, 1, 1},
                                {2, 64, 16, 16}, {7, 31, 1, 1},     {1, 7, 1, 1}};

TEST(BnMoments, NchwAndChannelsLastEveryDtype) {
  uint64_t seed = 100;
  for (ga_dtype xd : kAllDtypes) {
    for (ga_dtype sd : {kGaFloat32, kGaFloat64}) {
      for (const Nchw& s : kShapes) {
        SCOPED_TRACE(testing::Message() << DtypeName(xd) << " -> " << DtypeName(sd) << " shape "
                                        << s.n << "x" << s.c << "x" << s.h << "x" << s.w);
        TestTensor x(xd, s.numel());
        FillChannels(x, s, 0.5, 1.0, ++seed);
        const std::vector<double> xv = x.Values();
        const Moments ref = ReferenceMoments(xv, s);
        TestTensor mean(sd, s.c), m2(sd, s.c);
        ASSERT_EQ(ga_bn_moments(x.desc(), s.n, s.c, s.h * s.w, mean.desc(), m2.desc()), kGaOk)
            << ga_last_error();
        EXPECT_TRUE(StatsMatch(mean, m2, ref, kFp64Compute));
        EXPECT_TRUE(mean.GuardsIntact() && m2.GuardsIntact());

        TestTensor xcl(xd, s.numel());
        xcl.SetValues(ToChannelsLast(xv, s));  // exact: same values, same dtype
        TestTensor mean_cl(sd, s.c), m2_cl(sd, s.c);
        ASSERT_EQ(ga_bn_moments(xcl.desc(), s.n * s.h * s.w, s.c, 1, mean_cl.desc(), m2_cl.desc()),
                  kGaOk)
            << ga_last_error();
        EXPECT_TRUE(StatsMatch(mean_cl, m2_cl, ref, kFp64Compute)) << "channels-last";
      }
    }
  }
}

TEST(BnMoments, LargeOffsetNeedsTwoPasses) {
  // Mean 1e4, spread 1e-2: Σx² − n·mean² would lose every digit of M2; two passes keep 1e-12.
  const Nchw s{64, 4, 5, 5};
  for (ga_dtype xd : {kGaFloat32, kGaFloat64}) {
    TestTensor x(xd, s.numel());
    FillChannels(x, s, 1e4, 1e-2, 7);
    const Moments ref = ReferenceMoments(x.Values(), s);
    TestTensor mean(kGaFloat64, s.c), m2(kGaFloat64, s.c);
    ASSERT_EQ(ga_bn_moments(x.desc(), s.n, s.c, s.h * s.w, mean.desc(), m2.desc()), kGaOk);
    EXPECT_TRUE(StatsMatch(mean, m2, ref, kFp64Compute)) << DtypeName(xd);
    EXPECT_GT(m2.Get(0), 0.0);
  }
}

TEST(BnMoments, EmptyBatchGivesZeros) {
  TestTensor mean(kGaFloat32, 3), m2(kGaFloat64, 3);
  for (int64_t c = 0; c < 3; ++c) {
    mean.Set(c, 5.0);
    m2.Set(c, 5.0);
  }
  const ga_tensor x{nullptr, 0, kGaBFloat16, kGaCPU, 0};
  ASSERT_EQ(ga_bn_moments(x, 0, 3, 16, mean.desc(), m2.desc()), kGaOk) << ga_last_error();
  EXPECT_EQ(mean.Values(), (std::vector<double>{0, 0, 0}));
  EXPECT_EQ(m2.Values(), (std::vector<double>{0, 0, 0}));
}

// Moments of batch rows [n0, n0 + count) of an NCHW tensor (a contiguous slice).
void SliceMoments(const TestTensor& x, const Nchw& s, int64_t n0, int64_t count, TestTensor& mean,
                  TestTensor& m2) {
  const int64_t per = s.c * s.h * s.w;
  const ga_tensor slice{count ? x.at(n0 * per) : nullptr, count * per, x.dtype(), kGaCPU, 0};
  ASSERT_EQ(ga_bn_moments(slice, count, s.c, s.h * s.w, mean.desc(), m2.desc()), kGaOk)
      << ga_last_error();
}

TEST(BnMerge, ChunksMergeToTheWholeBatch) {
  const Nchw s{11, 6, 3, 5};
  const std::vector<int64_t> chunks{0, 3, 1, 5, 2};
  for (ga_dtype xd : {kGaFloat32, kGaBFloat16}) {
    for (ga_dtype sd : {kGaFloat32, kGaFloat64}) {
      SCOPED_TRACE(testing::Message() << DtypeName(xd) << " stats " << DtypeName(sd));
      TestTensor x(xd, s.numel());
      FillChannels(x, s, -2.0, 3.0, 9);
      const Moments ref = ReferenceMoments(x.Values(), s);
      // Sequential: left side starts empty (count 0, zeros).
      double count = 0.0;
      TestTensor mean(sd, s.c), m2(sd, s.c);
      int64_t n0 = 0;
      for (int64_t k : chunks) {
        TestTensor mb(sd, s.c), qb(sd, s.c);
        SliceMoments(x, s, n0, k, mb, qb);
        ASSERT_EQ(ga_bn_merge(&count, mean.desc(), m2.desc(), static_cast<double>(k * s.h * s.w),
                              mb.desc(), qb.desc()),
                  kGaOk)
            << ga_last_error();
        n0 += k;
      }
      EXPECT_EQ(count, ref.count);
      EXPECT_TRUE(StatsMatch(mean, m2, ref, 8 * Bound(sd)));
      // The same through ga_bn_moments on the whole batch.
      TestTensor mean_all(sd, s.c), m2_all(sd, s.c);
      SliceMoments(x, s, 0, s.n, mean_all, m2_all);
      EXPECT_TRUE(StatsMatch(mean_all, m2_all, ref, kFp64Compute));
      // Pairwise tree: (0..4 ⊕ 4..6) ⊕ (6..11), as replicas would be merged.
      TestTensor ma(sd, s.c), qa(sd, s.c), mb(sd, s.c), qb(sd, s.c), mc(sd, s.c), qc(sd, s.c);
      SliceMoments(x, s, 0, 4, ma, qa);
      SliceMoments(x, s, 4, 2, mb, qb);
      SliceMoments(x, s, 6, 5, mc, qc);
      double na = 4.0 * s.h * s.w;
      ASSERT_EQ(ga_bn_merge(&na, ma.desc(), qa.desc(), 2.0 * s.h * s.w, mb.desc(), qb.desc()),
                kGaOk);
      ASSERT_EQ(ga_bn_merge(&na, ma.desc(), qa.desc(), 5.0 * s.h * s.w, mc.desc(), qc.desc()),
                kGaOk);
      EXPECT_EQ(na, ref.count);
      EXPECT_TRUE(StatsMatch(ma, qa, ref, 8 * Bound(sd)));
    }
  }
}

TEST(BnMerge, HandExample) {
  // {1, 3} ⊕ {5, 7, 9}: means 2 and 7, M2 2 and 8 → mean 5, M2 = 2 + 8 + 25·6/5 = 40.
  std::vector<double> ma{2.0}, qa{2.0}, mb{7.0}, qb{8.0};
  double count = 2.0;
  const ga_tensor mat{ma.data(), 1, kGaFloat64, kGaCPU, 0},
      qat{qa.data(), 1, kGaFloat64, kGaCPU, 0};
  const ga_tensor mbt{mb.data(), 1, kGaFloat64, kGaCPU, 0},
      qbt{qb.data(), 1, kGaFloat64, kGaCPU, 0};
  ASSERT_EQ(ga_bn_merge(&count, mat, qat, 3.0, mbt, qbt), kGaOk);
  EXPECT_EQ(count, 5.0);
  EXPECT_EQ(ma[0], 5.0);
  EXPECT_EQ(qa[0], 40.0);
}

TEST(BnMerge, EmptySidesAreExact) {
  auto rng = Rng(10);
  for (ga_dtype sd : {kGaFloat32, kGaFloat64}) {
    TestTensor ma(sd, 9), qa(sd, 9), mb(sd, 9), qb(sd, 9);
    mb.FillUniform(rng, -3.0, 3.0);
    qb.FillUniform(rng, 0.0, 5.0);
    // Empty left side: the result is the right side, bit for bit.
    double count = 0.0;
    ASSERT_EQ(ga_bn_merge(&count, ma.desc(), qa.desc(), 17.0, mb.desc(), qb.desc()), kGaOk);
    EXPECT_EQ(count, 17.0);
    EXPECT_EQ(ma.DataBytes(), mb.DataBytes());
    EXPECT_EQ(qa.DataBytes(), qb.DataBytes());
    // Empty right side: nothing changes.
    mb.FillUniform(rng, -3.0, 3.0);
    const auto before = Snapshot(ma, qa);
    ASSERT_EQ(ga_bn_merge(&count, ma.desc(), qa.desc(), 0.0, mb.desc(), qb.desc()), kGaOk);
    EXPECT_EQ(count, 17.0);
    EXPECT_EQ(Snapshot(ma, qa), before);
  }
}

TEST(BnUpdateRunning, UnbiasedAndBiased) {
  auto rng = Rng(11);
  for (ga_dtype sd : {kGaFloat32, kGaFloat64}) {
    for (int unbiased : {1, 0}) {
      for (double nw : {0.1, 0.01, 0.0, 1.0}) {
        SCOPED_TRACE(testing::Message()
                     << DtypeName(sd) << " unbiased " << unbiased << " w " << nw);
        const int64_t c = 33;
        TestTensor rm(sd, c), rv(sd, c), mean(sd, c), m2(sd, c);
        rm.FillUniform(rng, -1.0, 1.0);
        rv.FillUniform(rng, 0.5, 2.0);
        mean.FillUniform(rng, -5.0, 5.0);
        m2.FillUniform(rng, 10.0, 100.0);
        const double count = 48.0;
        std::vector<double> want_m(c), want_v(c), mag_m(c), mag_v(c);
        for (int64_t i = 0; i < c; ++i) {
          const double var = m2.Get(i) / (unbiased ? count - 1 : count);
          want_m[i] = (1 - nw) * rm.Get(i) + nw * mean.Get(i);
          want_v[i] = (1 - nw) * rv.Get(i) + nw * var;
          mag_m[i] = (1 - nw) * std::fabs(rm.Get(i)) + nw * std::fabs(mean.Get(i));
          mag_v[i] = std::fabs(want_v[i]);
        }
        const auto inputs_before = Snapshot(mean, m2);
        ASSERT_EQ(
            ga_bn_update_running(rm.desc(), rv.desc(), mean.desc(), m2.desc(), count, nw, unbiased),
            kGaOk)
            << ga_last_error();
        EXPECT_TRUE(Near(rm.Values(), want_m, mag_m, kFp64Compute, sd));
        EXPECT_TRUE(Near(rv.Values(), want_v, mag_v, kFp64Compute, sd));
        EXPECT_EQ(Snapshot(mean, m2), inputs_before);
      }
    }
  }
}

TEST(BnUpdateRunning, MergedMicroBatchesEqualTheBigBatch) {
  // Running statistics from merged micro-batch moments equal those of one big batch.
  const Nchw s{12, 8, 4, 4};
  TestTensor x(kGaFloat32, s.numel());
  FillChannels(x, s, 1.0, 2.0, 12);
  double count = 0.0;
  TestTensor mean(kGaFloat64, s.c), m2(kGaFloat64, s.c);
  for (int64_t k = 0; k < 4; ++k) {
    TestTensor mb(kGaFloat64, s.c), qb(kGaFloat64, s.c);
    SliceMoments(x, s, 3 * k, 3, mb, qb);
    ASSERT_EQ(ga_bn_merge(&count, mean.desc(), m2.desc(), 3.0 * s.h * s.w, mb.desc(), qb.desc()),
              kGaOk);
  }
  TestTensor big_mean(kGaFloat64, s.c), big_m2(kGaFloat64, s.c);
  SliceMoments(x, s, 0, s.n, big_mean, big_m2);
  TestTensor rm1(kGaFloat32, s.c), rv1(kGaFloat32, s.c), rm2(kGaFloat32, s.c), rv2(kGaFloat32, s.c);
  for (int64_t c = 0; c < s.c; ++c) {
    rm1.Set(c, 0.0);
    rv1.Set(c, 1.0);
    rm2.Set(c, 0.0);
    rv2.Set(c, 1.0);
  }
  ASSERT_EQ(ga_bn_update_running(rm1.desc(), rv1.desc(), mean.desc(), m2.desc(), count, 0.1, 1),
            kGaOk);
  ASSERT_EQ(ga_bn_update_running(rm2.desc(), rv2.desc(), big_mean.desc(), big_m2.desc(),
                                 static_cast<double>(s.n * s.h * s.w), 0.1, 1),
            kGaOk);
  EXPECT_EQ(count, static_cast<double>(s.n * s.h * s.w));
  EXPECT_TRUE(Near(rm1.Values(), rm2.Values(), kFp32Compute, kGaFloat32));
  EXPECT_TRUE(Near(rv1.Values(), rv2.Values(), kFp32Compute, kGaFloat32));
}

// ---- bad input ----

TEST(BnBadInput, Moments) {
  auto rng = Rng(13);
  TestTensor x(kGaFloat32, 60), mean(kGaFloat32, 3), m2(kGaFloat32, 3);
  x.FillUniform(rng, -1.0, 1.0);
  mean.FillUniform(rng, 7.0, 8.0);
  m2.FillUniform(rng, 7.0, 8.0);
  const auto before = Snapshot(x, mean, m2);
  auto expect_fail = [&](ga_tensor xt, int64_t o, int64_t c, int64_t i, ga_tensor mt, ga_tensor qt,
                         ga_status st, std::initializer_list<std::string> args) {
    EXPECT_TRUE(FailsWith(ga_bn_moments(xt, o, c, i, mt, qt), st, args));
    EXPECT_EQ(Snapshot(x, mean, m2), before);
  };
  expect_fail(x.desc(), 4, 0, 5, mean.desc(), m2.desc(), kGaInvalidArgument, {"channels"});
  expect_fail(x.desc(), -4, 3, -5, mean.desc(), m2.desc(), kGaInvalidArgument,
              {"channels", "outer"});
  expect_fail(x.desc(), 4, 3, 6, mean.desc(), m2.desc(), kGaInvalidArgument, {"x"});
  ga_tensor bad = mean.desc();
  bad.numel = 2;
  expect_fail(x.desc(), 4, 3, 5, bad, m2.desc(), kGaInvalidArgument, {"mean"});
  bad = m2.desc();
  bad.dtype = kGaBFloat16;
  expect_fail(x.desc(), 4, 3, 5, mean.desc(), bad, kGaTypeError, {"m2"});
  bad = x.desc();
  SetRaw(bad.dtype, 4);
  expect_fail(bad, 4, 3, 5, mean.desc(), m2.desc(), kGaTypeError, {"x"});
  bad = x.desc();
  bad.numel = -60;
  expect_fail(bad, 4, 3, 5, mean.desc(), m2.desc(), kGaInvalidArgument, {"x"});
  expect_fail(x.desc(), 4, 3, 5, mean.desc(), mean.desc(), kGaInvalidArgument, {"mean", "m2"});
  const ga_tensor inside{x.at(10), 3, kGaFloat32, kGaCPU, 0};
  expect_fail(x.desc(), 4, 3, 5, inside, m2.desc(), kGaInvalidArgument, {"mean", "x"});
  if (!ga_has_cuda()) {
    bad = x.desc();
    bad.device_type = kGaCUDA;
    expect_fail(bad, 4, 3, 5, mean.desc(), m2.desc(), kGaTypeError, {"x"});
  }
}

TEST(BnBadInput, Merge) {
  auto rng = Rng(14);
  TestTensor ma(kGaFloat64, 4), qa(kGaFloat64, 4), mb(kGaFloat64, 4), qb(kGaFloat64, 4);
  for (TestTensor* t : {&ma, &qa, &mb, &qb}) t->FillUniform(rng, 1.0, 2.0);
  const auto before = Snapshot(ma, qa, mb, qb);
  double count = 10.0;
  auto expect_fail = [&](double* ca, ga_tensor a, ga_tensor b, double cb, ga_tensor c, ga_tensor d,
                         ga_status st, std::initializer_list<std::string> args) {
    EXPECT_TRUE(FailsWith(ga_bn_merge(ca, a, b, cb, c, d), st, args));
    EXPECT_EQ(Snapshot(ma, qa, mb, qb), before);
    EXPECT_EQ(count, 10.0);
  };
  expect_fail(nullptr, ma.desc(), qa.desc(), 5.0, mb.desc(), qb.desc(), kGaInvalidArgument,
              {"count_a"});
  for (double cb : {-1.0, kNaN, kInf})
    expect_fail(&count, ma.desc(), qa.desc(), cb, mb.desc(), qb.desc(), kGaInvalidArgument,
                {"count_b"});
  double bad_count = -2.0;
  EXPECT_TRUE(FailsWith(ga_bn_merge(&bad_count, ma.desc(), qa.desc(), 5.0, mb.desc(), qb.desc()),
                        kGaInvalidArgument, {"count_a"}));
  EXPECT_EQ(bad_count, -2.0);
  bad_count = kNaN;
  EXPECT_TRUE(FailsWith(ga_bn_merge(&bad_count, ma.desc(), qa.desc(), 5.0, mb.desc(), qb.desc()),
                        kGaInvalidArgument, {"count_a"}));
  ga_tensor bad = mb.desc();
  bad.numel = 3;
  expect_fail(&count, ma.desc(), qa.desc(), 5.0, bad, qb.desc(), kGaInvalidArgument, {"mean_b"});
  bad = qb.desc();
  bad.dtype = kGaFloat16;
  expect_fail(&count, ma.desc(), qa.desc(), 5.0, mb.desc(), bad, kGaTypeError, {"m2_b"});
  expect_fail(&count, ma.desc(), ma.desc(), 5.0, mb.desc(), qb.desc(), kGaInvalidArgument,
              {"mean_a", "m2_a"});
  expect_fail(&count, ma.desc(), qa.desc(), 5.0, qa.desc(), qb.desc(), kGaInvalidArgument,
              {"m2_a", "mean_b"});
}

TEST(BnBadInput, UpdateRunning) {
  auto rng = Rng(15);
  TestTensor rm(kGaFloat32, 4), rv(kGaFloat32, 4), mean(kGaFloat32, 4), m2(kGaFloat32, 4);
  for (TestTensor* t : {&rm, &rv, &mean, &m2}) t->FillUniform(rng, 1.0, 2.0);
  const auto before = Snapshot(rm, rv, mean, m2);
  auto expect_fail = [&](ga_tensor a, ga_tensor b, ga_tensor c, ga_tensor d, double count,
                         double nw, int unbiased, ga_status st,
                         std::initializer_list<std::string> args) {
    EXPECT_TRUE(FailsWith(ga_bn_update_running(a, b, c, d, count, nw, unbiased), st, args));
    EXPECT_EQ(Snapshot(rm, rv, mean, m2), before);
  };
  for (double count : {0.0, -3.0, kNaN, kInf})
    expect_fail(rm.desc(), rv.desc(), mean.desc(), m2.desc(), count, 0.1, 0, kGaInvalidArgument,
                {"count"});
  expect_fail(rm.desc(), rv.desc(), mean.desc(), m2.desc(), 1.0, 0.1, 1, kGaInvalidArgument,
              {"count"});
  for (double nw : {-0.1, 1.5, kNaN})
    expect_fail(rm.desc(), rv.desc(), mean.desc(), m2.desc(), 8.0, nw, 1, kGaInvalidArgument,
                {"momentum", "new_weight"});
  ga_tensor bad = rv.desc();
  bad.numel = 5;
  expect_fail(rm.desc(), bad, mean.desc(), m2.desc(), 8.0, 0.1, 1, kGaInvalidArgument,
              {"running_var"});
  bad = mean.desc();
  bad.dtype = kGaFloat16;
  expect_fail(rm.desc(), rv.desc(), bad, m2.desc(), 8.0, 0.1, 1, kGaTypeError, {"mean"});
  expect_fail(rm.desc(), rv.desc(), rm.desc(), m2.desc(), 8.0, 0.1, 1, kGaInvalidArgument,
              {"running_mean", "mean"});
  expect_fail(rm.desc(), rm.desc(), mean.desc(), m2.desc(), 8.0, 0.1, 1, kGaInvalidArgument,
              {"running_mean", "running_var"});
}

}  // namespace
}  // namespace ga_test
