// ga_wgrad_accumulate and ga_bias_accumulate on the CPU (wgrad.h): the fused weight-gradient
// fold through oneDNN, compared with an fp64 reference of the same (rounded) inputs, and the
// argument checks, which write nothing.
//
// The GEMM cases need oneDNN: GA_ONEDNN_PATH names libdnnl.so.3 (.ci/run sets it from the
// onednn-cpu-gomp package), else the soname is tried; they skip when neither loads or the build
// has no oneDNN headers. Tolerance: the product is summed in fp32 (bf16/fp16 inputs widened or
// taken by a kernel that accumulates in fp32), so every dtype is held to 1e-5 of the reference's
// magnitude Σ|a·acc| + Σ|b·dy·x| per element.
#include "gradient_accumulator/wgrad.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "test_util.h"

namespace {

ga_matrix Matrix(void* data, ga_dtype dtype, int64_t numel, int64_t rows, int64_t cols, int64_t rs,
                 int64_t cs) {
  return ga_test::MatrixOn(kGaCPU, data, dtype, numel, rows, cols, rs, cs);
}

ga_accumulate_options Options(double w, bool overwrite = false, bool running = false,
                              double before = 0.0) {
  ga_accumulate_options o{};
  o.mode = running ? kGaAccumulateRunningMean : kGaAccumulateSum;
  o.weight = w;
  o.weight_before = before;
  o.overwrite = overwrite ? 1 : 0;
  return o;
}

uint16_t ToBf16(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

float FromBf16(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

bool LoadOneDnn() {
  const char* path = std::getenv("GA_ONEDNN_PATH");
  return ga_onednn_load(path != nullptr && *path != '\0' ? path : nullptr) == kGaOk;
}

#define REQUIRE_ONEDNN()                                                            \
  do {                                                                              \
    if (!LoadOneDnn()) GTEST_SKIP() << "oneDNN not available: " << ga_last_error(); \
  } while (0)

// acc ← a·acc + b·dyᵀx against fp64, for dy (n×out) and x (n×in) given as fp32 values (already
// rounded to the dtype under test). `dy_t`: pass dy as a transposed view (column-major).
void CheckCase(ga_dtype dtype, int64_t n, int64_t out, int64_t in, bool dy_t,
               const ga_accumulate_options& o) {
  std::mt19937 rng(static_cast<unsigned>(n * 131 + out * 7 + in));
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> dyv(n * out), xv(n * in), acc(out * in);
  for (auto& v : dyv) v = dtype == kGaBFloat16 ? FromBf16(ToBf16(dist(rng))) : dist(rng);
  for (auto& v : xv) v = dtype == kGaBFloat16 ? FromBf16(ToBf16(dist(rng))) : dist(rng);
  for (auto& v : acc) v = dist(rng);
  double a =
      o.mode == kGaAccumulateRunningMean ? o.weight_before / (o.weight_before + o.weight) : 1.0;
  double b =
      o.mode == kGaAccumulateRunningMean ? o.weight / (o.weight_before + o.weight) : o.weight;
  if (o.overwrite) a = 0.0;
  std::vector<double> ref(out * in), mag(out * in);
  for (int64_t i = 0; i < out; ++i)
    for (int64_t j = 0; j < in; ++j) {
      double s = 0.0, m = 0.0;
      for (int64_t r = 0; r < n; ++r) {
        const double p = static_cast<double>(dyv[r * out + i]) * xv[r * in + j];
        s += p;
        m += std::fabs(p);
      }
      const double keep = a == 0.0 ? 0.0 : a * acc[i * in + j];
      ref[i * in + j] = keep + b * s;
      mag[i * in + j] = std::fabs(keep) + std::fabs(b) * m;
    }
  if (o.overwrite) std::fill(acc.begin(), acc.end(), std::numeric_limits<float>::quiet_NaN());
  // The inputs in their dtype and layout.
  std::vector<uint16_t> dy16, x16;
  std::vector<float> dyt;
  void* dyp = dyv.data();
  void* xp = xv.data();
  int64_t dy_rs = out, dy_cs = 1;
  if (dy_t) {  // dy stored column-major: element (r, c) at c·n + r
    dyt.resize(n * out);
    for (int64_t r = 0; r < n; ++r)
      for (int64_t c = 0; c < out; ++c) dyt[c * n + r] = dyv[r * out + c];
    dyp = dyt.data();
    dy_rs = 1;
    dy_cs = n;
  }
  if (dtype == kGaBFloat16) {
    const std::vector<float>& src = dy_t ? dyt : dyv;
    for (float v : src) dy16.push_back(ToBf16(v));
    for (float v : xv) x16.push_back(ToBf16(v));
    dyp = dy16.data();
    xp = x16.data();
  }
  ga_matrix am = Matrix(acc.data(), kGaFloat32, out * in, out, in, in, 1);
  ga_matrix dm = Matrix(dyp, dtype, n * out, n, out, dy_rs, dy_cs);
  ga_matrix xm = Matrix(xp, dtype, n * in, n, in, in, 1);
  ASSERT_EQ(ga_wgrad_accumulate(&am, &dm, &xm, &o), kGaOk) << ga_last_error();
  for (int64_t k = 0; k < out * in; ++k)
    ASSERT_LE(std::fabs(acc[k] - ref[k]), 1e-5 * mag[k] + 1e-30) << "element " << k;
}

TEST(WgradCpu, Fp32EveryModeAndLayout) {
  REQUIRE_ONEDNN();
  CheckCase(kGaFloat32, 37, 23, 19, false, Options(0.5));
  CheckCase(kGaFloat32, 37, 23, 19, true, Options(2.0));
  CheckCase(kGaFloat32, 64, 48, 40, false, Options(3.0, /*overwrite=*/true));
  CheckCase(kGaFloat32, 17, 9, 33, false, Options(1.0, false, /*running=*/true, 3.0));
  CheckCase(kGaFloat32, 1, 1, 5, false, Options(1.0));
}

TEST(WgradCpu, Bf16InputsSumInFp32) {
  REQUIRE_ONEDNN();
  CheckCase(kGaBFloat16, 64, 48, 40, false, Options(3.0));
  CheckCase(kGaBFloat16, 29, 31, 7, true, Options(0.25, /*overwrite=*/true));
}

TEST(WgradCpu, NoRowsScalesOrZeroes) {
  std::vector<float> acc(6, 2.0f), dy(1), x(1);
  ga_matrix am = Matrix(acc.data(), kGaFloat32, 6, 2, 3, 3, 1);
  ga_matrix dm = Matrix(dy.data(), kGaFloat32, 0, 0, 2, 2, 1);
  ga_matrix xm = Matrix(x.data(), kGaFloat32, 0, 0, 3, 3, 1);
  ga_accumulate_options o = Options(1.0, false, true, 1.0);  // running mean: a = 1/2
  ASSERT_EQ(ga_wgrad_accumulate(&am, &dm, &xm, &o), kGaOk) << ga_last_error();
  for (float v : acc) EXPECT_EQ(v, 1.0f);
  o = Options(1.0, /*overwrite=*/true);
  ASSERT_EQ(ga_wgrad_accumulate(&am, &dm, &xm, &o), kGaOk);
  for (float v : acc) EXPECT_EQ(v, 0.0f);
}

TEST(WgradCpu, BadArgumentsWriteNothing) {
  std::vector<float> acc(12, 7.0f), dy(20), x(15);
  ga_matrix am = Matrix(acc.data(), kGaFloat32, 12, 4, 3, 3, 1);
  ga_matrix dm = Matrix(dy.data(), kGaFloat32, 20, 5, 4, 4, 1);
  ga_matrix xm = Matrix(x.data(), kGaFloat32, 15, 5, 3, 3, 1);
  ga_accumulate_options o = Options(1.0);
  ga_matrix bad = xm;
  bad.rows = 4;
  bad.tensor.numel = 12;
  EXPECT_EQ(ga_wgrad_accumulate(&am, &dm, &bad, &o), kGaInvalidArgument);
  EXPECT_NE(std::string(ga_last_error()).find("shapes do not chain"), std::string::npos);
  bad = xm;
  bad.tensor.dtype = kGaBFloat16;
  EXPECT_EQ(ga_wgrad_accumulate(&am, &dm, &bad, &o), kGaTypeError);
  EXPECT_STREQ(ga_last_error_argument(), "x");
  bad = xm;
  bad.row_stride = 4;  // reaches past its 15 elements
  EXPECT_EQ(ga_wgrad_accumulate(&am, &dm, &bad, &o), kGaInvalidArgument);
  EXPECT_STREQ(ga_last_error_argument(), "x");
  ga_accumulate_options neg = Options(-1.0);
  EXPECT_EQ(ga_wgrad_accumulate(&am, &dm, &xm, &neg), kGaInvalidArgument);
  EXPECT_STREQ(ga_last_error_argument(), "weight");
  EXPECT_NE(ga_wgrad_accumulate(&am, &dm, &am, &o), kGaOk);  // x is the accumulator itself
  EXPECT_EQ(ga_wgrad_accumulate(nullptr, &dm, &xm, &o), kGaInvalidArgument);
  for (float v : acc) EXPECT_EQ(v, 7.0f);
}

TEST(WgradCpu, BiasIsTheColumnSumsWithTheFormula) {
  // dy: 3×2 rows [1, 2], [3, 4], [5, 6] → Σ = [9, 12]; a strided (transposed) view too.
  std::vector<float> dy = {1, 2, 3, 4, 5, 6}, dyt = {1, 3, 5, 2, 4, 6};
  std::vector<float> acc = {1.0f, 1.0f};
  ga_tensor at{acc.data(), 2, kGaFloat32, kGaCPU, 0};
  ga_matrix dm = Matrix(dy.data(), kGaFloat32, 6, 3, 2, 2, 1);
  ga_accumulate_options o = Options(0.5);
  ASSERT_EQ(ga_bias_accumulate(&at, &dm, &o), kGaOk) << ga_last_error();
  EXPECT_EQ(acc[0], 1.0f + 4.5f);
  EXPECT_EQ(acc[1], 1.0f + 6.0f);
  ga_matrix dmt = Matrix(dyt.data(), kGaFloat32, 6, 3, 2, 1, 3);
  o = Options(2.0, /*overwrite=*/true);
  acc = {std::numeric_limits<float>::quiet_NaN(), 0.0f};
  ASSERT_EQ(ga_bias_accumulate(&at, &dmt, &o), kGaOk);
  EXPECT_EQ(acc[0], 18.0f);
  EXPECT_EQ(acc[1], 24.0f);
  ga_tensor wrong{acc.data(), 1, kGaFloat32, kGaCPU, 0};
  EXPECT_EQ(ga_bias_accumulate(&wrong, &dm, &o), kGaInvalidArgument);
  EXPECT_STREQ(ga_last_error_argument(), "bias_acc");
  EXPECT_EQ(acc[0], 18.0f);
}

TEST(WgradCpu, PathReportsTheKernelOrWhyNot) {
  char what[512];
  const int fused = ga_wgrad_cpu_path(kGaFloat32, 64, 32, 16, what, sizeof(what));
  if (!LoadOneDnn()) {
    EXPECT_EQ(fused, 0);
    EXPECT_GT(std::strlen(what), 0u);
    GTEST_SKIP() << "oneDNN not available: " << what;
  }
  ASSERT_EQ(ga_wgrad_cpu_path(kGaFloat32, 64, 32, 16, what, sizeof(what)), 1) << what;
  EXPECT_EQ(std::string(what).rfind("onednn:", 0), 0u) << what;
  ASSERT_EQ(ga_wgrad_cpu_path(kGaBFloat16, 64, 32, 16, what, sizeof(what)), 1) << what;
}

TEST(WgradCpu, LoadingSomethingElseIsRefusedWithTheReason) {
  const ga_status s = ga_onednn_load("libgradient-accumulator-no-such-library.so");
  if (s == kGaOk) GTEST_SKIP() << "oneDNN is already loaded in this process (idempotent)";
  EXPECT_EQ(s, kGaUnsupported);
  EXPECT_NE(std::string(ga_last_error()).find("could not be loaded"), std::string::npos);
}

}  // namespace
