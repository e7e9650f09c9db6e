// ga_cuda_wgrad_accumulate (cuda.h): the fused weight-gradient GEMM through cuBLASLt, compared
// with an fp64 host reference of the same (rounded) inputs, and its argument checks.
//
// Argument errors and the "not loaded" answer need no GPU and run in every build. The GEMM cases
// need a CUDA build (GA_TEST_CUDA), a GPU and cuBLASLt (GA_CUBLASLT_PATH, else the soname): they
// skip otherwise, and fail when GA_CUBLASLT_PATH is set but cannot be loaded.
//
// Tolerance: the accumulation is fp32 whatever the inputs (compute type 32F, no TF32), so every
// dtype is held to 1e-5 of the reference's magnitude Σ|a·acc| + Σ|b·dy·x| per element (k ≤ 300
// terms: fp32's worst case k·u ≈ 1.8e-5, random-sign sums stay far below that).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "gradient_accumulator/cuda.h"
#include "test_util.h"

#if defined(GA_TEST_CUDA)
#include <cuda_runtime.h>
#endif

namespace {

using namespace ga_test;

ga_matrix Matrix(void* data, ga_dtype dtype, int64_t numel, int64_t rows, int64_t cols, int64_t rs,
                 int64_t cs) {
  return ga_test::MatrixOn(kGaCUDA, data, dtype, numel, rows, cols, rs, cs);
}

ga_accumulate_options Sum(double w) {
  ga_accumulate_options o{};
  o.mode = kGaAccumulateSum;
  o.weight = w;
  return o;
}

// Fake device addresses: validation never dereferences them, and nothing is enqueued on error.
struct FakeCase {
  alignas(256) static inline char base[1 << 16];
  ga_matrix acc = Matrix(base, kGaFloat32, 4 * 3, 4, 3, 3, 1);         // out = 4, in = 3
  ga_matrix dy = Matrix(base + 4096, kGaBFloat16, 5 * 4, 5, 4, 4, 1);  // n = 5
  ga_matrix x = Matrix(base + 8192, kGaBFloat16, 5 * 3, 5, 3, 3, 1);
  ga_accumulate_options o = Sum(1.0);
  ga_status Call() { return ga_cuda_wgrad_accumulate(&acc, &dy, &x, &o, nullptr); }
};

std::string LastArgument() {
  const char* a = ga_last_error_argument();
  return a ? a : "";
}

TEST(CudaWgrad, ArgumentErrorsNameTheArgument) {
  if (!ga_has_cuda()) GTEST_SKIP() << "no CUDA build: every call is kGaUnsupported";
  {
    FakeCase c;
    c.x.rows = 6;
    c.x.tensor.numel = 18;
    EXPECT_EQ(c.Call(), kGaInvalidArgument);
    EXPECT_EQ(LastArgument(), "x");
  }
  {
    FakeCase c;
    c.acc.rows = 5;
    c.acc.tensor.numel = 15;
    EXPECT_EQ(c.Call(), kGaInvalidArgument);
    EXPECT_EQ(LastArgument(), "acc");
  }
  {
    FakeCase c;
    c.x.tensor.dtype = kGaFloat16;
    EXPECT_EQ(c.Call(), kGaTypeError);
    EXPECT_EQ(LastArgument(), "x");
  }
  {
    FakeCase c;
    c.acc.tensor.dtype = kGaBFloat16;
    EXPECT_EQ(c.Call(), kGaTypeError);
    EXPECT_EQ(LastArgument(), "acc");
  }
  {
    FakeCase c;  // the strides reach past numel
    c.dy.row_stride = 5;
    EXPECT_EQ(c.Call(), kGaInvalidArgument);
    EXPECT_EQ(LastArgument(), "dy");
  }
  {
    FakeCase c;  // acc must be dense row-major
    c.acc.row_stride = 1;
    c.acc.col_stride = 4;
    EXPECT_EQ(c.Call(), kGaInvalidArgument);
    EXPECT_EQ(LastArgument(), "acc");
  }
  {
    FakeCase c;  // acc overlaps x
    c.x.tensor.data = FakeCase::base;
    EXPECT_EQ(c.Call(), kGaInvalidArgument);
  }
  {
    FakeCase c;
    c.o.weight = -1.0;
    EXPECT_EQ(c.Call(), kGaInvalidArgument);
    EXPECT_EQ(LastArgument(), "weight");
  }
  {
    FakeCase c;
    SetRaw(c.o.mode, 77);
    EXPECT_EQ(c.Call(), kGaInvalidArgument);
    EXPECT_EQ(LastArgument(), "mode");
  }
  {
    FakeCase c;
    c.acc.tensor.device_type = kGaCPU;
    EXPECT_EQ(c.Call(), kGaTypeError);
  }
  EXPECT_EQ(ga_cuda_wgrad_accumulate(nullptr, nullptr, nullptr, nullptr, nullptr),
            kGaInvalidArgument);
}

TEST(CudaWgrad, StridesWithoutAUnitStrideAreUnsupported) {
  if (!ga_has_cuda()) GTEST_SKIP() << "no CUDA build";
  FakeCase c;
  c.x.row_stride = 6;  // every other column: no unit stride
  c.x.col_stride = 2;
  c.x.tensor.numel = 30;
  EXPECT_EQ(c.Call(), kGaUnsupported);
  EXPECT_EQ(LastArgument(), "x");
  FakeCase d;
  d.dy.row_stride = 0;  // a broadcast row
  EXPECT_EQ(d.Call(), kGaUnsupported);
  EXPECT_EQ(LastArgument(), "dy");
}

// Runs first in its own process under ctest (each test is one process there); in a single
// ga_core_tests run it only holds while no earlier test loaded cuBLASLt, so it skips then.
TEST(CudaWgrad, NotLoadedIsUnsupported) {
#if defined(GA_TEST_CUDA)
  // With a device and cuBLASLt loaded by an earlier test, the call would launch a real GEMM on
  // the fake case's host addresses and poison the context for every later test.
  int devices = 0;
  const bool device = cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0;
  cudaGetLastError();
  if (device) GTEST_SKIP() << "a CUDA device is present: the fake case could reach it";
#endif
  FakeCase c;
  const ga_status s = c.Call();
  if (s == kGaOk || (s == kGaRuntimeError && ga_has_cuda()))
    GTEST_SKIP() << "cuBLASLt was loaded by an earlier test of this process";
  EXPECT_EQ(s, kGaUnsupported);
  const std::string why = ga_last_error();
  if (ga_has_cuda())
    EXPECT_TRUE(why.find("cuBLASLt is not loaded") != std::string::npos ||
                why.find("no cuBLASLt headers") != std::string::npos)
        << why;
}

TEST(CudaWgrad, LoadingSomethingElseIsUnsupported) {
  if (!ga_has_cuda()) {
    EXPECT_EQ(ga_cublaslt_load(nullptr), kGaUnsupported);
    return;
  }
  const ga_status s = ga_cublaslt_load("libm.so.6");
  if (s == kGaOk) GTEST_SKIP() << "cuBLASLt was loaded by an earlier test of this process";
  EXPECT_EQ(s, kGaUnsupported);
  const std::string why = ga_last_error();
  EXPECT_TRUE(why.find("has no cublasLt") != std::string::npos ||
              why.find("no cuBLASLt headers") != std::string::npos)
      << why;
  EXPECT_EQ(ga_cublaslt_load("/nonexistent/libcublasLt.so"), kGaUnsupported);
}

#if defined(GA_TEST_CUDA)

// Loading needs no GPU: with GA_CUBLASLT_PATH set (gpu_check.sh sets it; on a machine without
// one, the library unpacked from PyPI's nvidia-cublas wheel) the load succeeds, is idempotent,
// and a call then gets past "not loaded" to the device check.
TEST(CudaWgrad, LoadsByPathOnce) {
  const char* path = std::getenv("GA_CUBLASLT_PATH");
  if (path == nullptr || *path == '\0') GTEST_SKIP() << "GA_CUBLASLT_PATH is not set";
  ASSERT_EQ(ga_cublaslt_load(path), kGaOk) << ga_last_error();
  EXPECT_EQ(ga_cublaslt_load(nullptr), kGaOk);
  EXPECT_EQ(ga_cublaslt_load("/nonexistent/libcublasLt.so"), kGaOk);  // already loaded
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    cudaGetLastError();
    FakeCase c;  // fake addresses: only where no device could ever run the GEMM
    EXPECT_EQ(c.Call(), kGaRuntimeError);
    EXPECT_EQ(std::string(ga_last_error()).find("not loaded"), std::string::npos);
  }
}

/// Loads cuBLASLt once for the GPU cases; the reason it could not, or "".
std::string LoadForGpu() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    cudaGetLastError();
    return "no CUDA device";
  }
  const char* path = std::getenv("GA_CUBLASLT_PATH");
  if (ga_cublaslt_load(path && *path ? path : nullptr) != kGaOk) {
    const std::string why = std::string("cuBLASLt: ") + ga_last_error();
    // A GPU check (tools/gpu_check.sh sets GA_REQUIRE_CUBLASLT) must not pass by skipping.
    if ((path && *path) || std::getenv("GA_REQUIRE_CUBLASLT") != nullptr) ADD_FAILURE() << why;
    return why;
  }
  return "";
}

/// One GEMM case: dy (n×out) and x (n×in) stored row-major or transposed (column-major, with
/// padding in the leading dimension), acc out×in.
struct GemmCase {
  ga_dtype dtype;
  int64_t n, out, in;
  bool dy_t, x_t;  // stored as a transposed view
  int mode;        // 0 sum, 1 overwrite, 2 running mean
  double weight, weight_before;
};

std::string Name(const GemmCase& c) {
  std::string s = std::string(DtypeName(c.dtype)) + " n=" + std::to_string(c.n) +
                  " out=" + std::to_string(c.out) + " in=" + std::to_string(c.in) +
                  (c.dy_t ? " dyT" : "") + (c.x_t ? " xT" : "");
  return s + (c.mode == 0 ? " sum" : c.mode == 1 ? " overwrite" : " mean");
}

void Encode(ga_dtype dtype, const std::vector<double>& v, std::vector<uint16_t>& h,
            std::vector<float>& f) {
  for (double x : v) {
    if (dtype == kGaFloat32)
      f.push_back(static_cast<float>(x));
    else
      h.push_back(dtype == kGaBFloat16 ? EncodeBf16(x) : EncodeFp16(x));
  }
}

void RunCase(const GemmCase& c) {
  SCOPED_TRACE(Name(c));
  std::mt19937_64 rng(1234 + c.n * 7 + c.out * 13 + c.in);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  const int64_t pad = 3;
  // Storage: row-major with ld = cols + pad, or column-major with ld = rows + pad.
  auto make = [&](int64_t rows, int64_t cols, bool t, std::vector<double>& logical,
                  std::vector<double>& stored, int64_t& rs, int64_t& cs) {
    const int64_t ld = (t ? rows : cols) + pad;
    rs = t ? 1 : ld;
    cs = t ? ld : 1;
    stored.assign(static_cast<size_t>((t ? cols : rows) * ld), 0.0);
    logical.assign(static_cast<size_t>(rows * cols), 0.0);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t col = 0; col < cols; ++col) {
        const double v = RoundTo(c.dtype, u(rng));
        logical[r * cols + col] = v;
        stored[r * rs + col * cs] = v;
      }
  };
  std::vector<double> dy, dys, x, xs;
  int64_t dyrs, dycs, xrs, xcs;
  make(c.n, c.out, c.dy_t, dy, dys, dyrs, dycs);
  make(c.n, c.in, c.x_t, x, xs, xrs, xcs);
  std::vector<float> acc0(static_cast<size_t>(c.out * c.in));
  for (float& v : acc0) v = static_cast<float>(u(rng));
  if (c.mode == 1) acc0[0] = std::nanf("");  // overwrite must not read the old values

  ga_accumulate_options o = Sum(c.weight);
  if (c.mode == 1) o.overwrite = 1;
  if (c.mode == 2) {
    o.mode = kGaAccumulateRunningMean;
    o.weight_before = c.weight_before;
  }
  double a = 1.0, b = c.weight;
  if (c.mode == 1) a = 0.0;
  if (c.mode == 2) {
    a = c.weight_before / (c.weight_before + c.weight);
    b = c.weight / (c.weight_before + c.weight);
  }
  const double af = static_cast<float>(a), bf = static_cast<float>(b);  // fp32 scalars

  const size_t es = c.dtype == kGaFloat32 ? 4 : 2;
  std::vector<uint16_t> dyh, xh;
  std::vector<float> dyf, xf;
  Encode(c.dtype, dys, dyh, dyf);
  Encode(c.dtype, xs, xh, xf);
  void *d_acc, *d_dy, *d_x;
  ASSERT_EQ(cudaMalloc(&d_acc, acc0.size() * 4 + 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_dy, dys.size() * es + 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_x, xs.size() * es + 4), cudaSuccess);
  cudaMemcpy(d_acc, acc0.data(), acc0.size() * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(d_dy, es == 4 ? static_cast<const void*>(dyf.data()) : dyh.data(), dys.size() * es,
             cudaMemcpyHostToDevice);
  cudaMemcpy(d_x, es == 4 ? static_cast<const void*>(xf.data()) : xh.data(), xs.size() * es,
             cudaMemcpyHostToDevice);
  ga_matrix acc = Matrix(d_acc, kGaFloat32, c.out * c.in, c.out, c.in, c.in, 1);
  ga_matrix mdy = Matrix(d_dy, c.dtype, static_cast<int64_t>(dys.size()), c.n, c.out, dyrs, dycs);
  ga_matrix mx = Matrix(d_x, c.dtype, static_cast<int64_t>(xs.size()), c.n, c.in, xrs, xcs);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  ASSERT_EQ(ga_cuda_wgrad_accumulate(&acc, &mdy, &mx, &o, stream), kGaOk) << ga_last_error();
  std::vector<float> got(acc0.size());
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  cudaMemcpy(got.data(), d_acc, got.size() * 4, cudaMemcpyDeviceToHost);
  for (int64_t i = 0; i < c.out; ++i)
    for (int64_t j = 0; j < c.in; ++j) {
      double s = 0.0, mag = 0.0;
      for (int64_t r = 0; r < c.n; ++r) {
        const double p = dy[r * c.out + i] * x[r * c.in + j];
        s += p;
        mag += std::fabs(p);
      }
      const double old = c.mode == 1 ? 0.0 : acc0[i * c.in + j];
      const double want = af * old + bf * s;
      const double bound = 1e-5 * (std::fabs(af * old) + bf * mag) + 1e-30;
      ASSERT_NEAR(got[i * c.in + j], want, bound) << "at (" << i << ", " << j << ")";
    }
  cudaStreamDestroy(stream);
  cudaFree(d_acc);
  cudaFree(d_dy);
  cudaFree(d_x);
}

class CudaWgradGemm : public ::testing::Test {
 protected:
  void SetUp() override {
    static const std::string why = LoadForGpu();
    if (!why.empty()) GTEST_SKIP() << why;
  }
};

TEST_F(CudaWgradGemm, EveryDtypeAndStrideCase) {
  for (ga_dtype d : {kGaFloat32, kGaBFloat16, kGaFloat16})
    for (bool dy_t : {false, true})
      for (bool x_t : {false, true}) RunCase({d, 37, 24, 40, dy_t, x_t, 0, 1.0, 0.0});
}

TEST_F(CudaWgradGemm, ModesAndWeights) {
  for (ga_dtype d : {kGaFloat32, kGaBFloat16, kGaFloat16}) {
    RunCase({d, 64, 32, 48, false, false, 0, 0.37, 0.0});  // sum, weight ≠ 1
    RunCase({d, 64, 32, 48, true, false, 1, 0.25, 0.0});   // overwrite (NaN in acc unread)
    RunCase({d, 64, 32, 48, false, true, 2, 3.0, 5.0});    // running mean
  }
}

TEST_F(CudaWgradGemm, OddAndLargerShapes) {
  RunCase({kGaBFloat16, 300, 129, 257, false, false, 0, 1.0, 0.0});
  RunCase({kGaFloat16, 1, 7, 5, true, true, 0, 2.0, 0.0});
  RunCase({kGaFloat32, 255, 1, 64, false, false, 2, 1.0, 1.0});
}

TEST_F(CudaWgradGemm, ZeroRows) {
  for (int mode : {0, 1, 2}) RunCase({kGaBFloat16, 0, 8, 6, false, false, mode, 0.5, 1.5});
}

#endif  // GA_TEST_CUDA

}  // namespace
