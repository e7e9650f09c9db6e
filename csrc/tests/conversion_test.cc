// Tests of the fp32 ↔ bf16/fp16 conversions (csrc/core/formulas.h) as the CPU kernels use them:
// every fp32 → 16-bit store rounds to nearest, ties to even, exactly like the test's encoder
// (through the fused apply's grads_out), and every one of the 65536 bf16 and fp16 bit patterns
// decodes exactly (through accumulate's overwrite into fp32 accumulators).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "gradient_accumulator/gradient_accumulator.h"
#include "test_util.h"

namespace ga_test {
namespace {

// fp32 values whose conversion is checked: boundaries of both formats, subnormals, exact ties
// between neighbouring 16-bit values (odd and even lower neighbours), random bit patterns.
std::vector<float> ConversionProbes() {
  std::vector<float> v{0.0f,
                       -0.0f,
                       1.0f,
                       -1.0f,
                       65504.0f,
                       65519.0f,
                       65520.0f,
                       -65520.0f,
                       1e6f,
                       std::numeric_limits<float>::max(),
                       std::numeric_limits<float>::min(),
                       std::numeric_limits<float>::denorm_min(),
                       5.96e-8f,
                       2.98e-8f,
                       2.99e-8f,
                       6.1035156e-05f,
                       6.09e-05f,
                       3.0e-41f};
  // Exact ties between neighbouring bf16 and fp16 values (odd and even lower neighbours).
  for (uint32_t base : {0x3f800000u, 0x3f810000u, 0x40490000u, 0xc0490000u})  // bf16 ties
    for (uint32_t low : {0x8000u, 0x7fffu, 0x8001u}) {
      const uint32_t u = base | low;
      float f;
      std::memcpy(&f, &u, 4);
      v.push_back(f);
    }
  for (double h : {1.0, 1.0009765625, 2048.0, 3.14159, 1e-5, 6e-8}) {  // fp16 ties
    const double ulp = std::ldexp(1.0, std::max(std::ilogb(h), -14) - 10);
    v.push_back(static_cast<float>(h + ulp / 2));
    v.push_back(static_cast<float>(h - ulp / 2));
  }
  auto rng = Rng(65);
  std::uniform_int_distribution<uint32_t> bits;
  for (int i = 0; i < 200000; ++i) {
    const uint32_t u = bits(rng);
    float f;
    std::memcpy(&f, &u, 4);
    v.push_back(f);
  }
  v.push_back(std::numeric_limits<float>::infinity());
  v.push_back(-std::numeric_limits<float>::infinity());
  v.push_back(std::numeric_limits<float>::quiet_NaN());
  return v;
}

TEST(Conversion, Fp32ToHalfRoundsToNearestEven) {
  const std::vector<float> probes = ConversionProbes();
  const int64_t n = static_cast<int64_t>(probes.size());
  TestTensor acc(kGaFloat32, n);
  std::memcpy(acc.data(), probes.data(), probes.size() * 4);
  for (ga_dtype fd : {kGaBFloat16, kGaFloat16}) {
    SCOPED_TRACE(DtypeName(fd));
    TestTensor out(fd, n);
    const ga_tensor a = acc.desc(), o = out.desc();
    ga_apply_tensors t{};
    t.accumulators = {&a, 1};
    t.grads_out = {&o, 1};
    ga_apply_options opt{};
    opt.optimizer = kGaOptimizerNone;
    opt.clip = kGaClipNone;
    opt.grad_scale = 1.0;  // x · 1 is exact in fp32: only the store rounds
    ASSERT_EQ(ga_apply(&t, &opt, nullptr), kGaOk) << ga_last_error();
    const uint16_t* got = static_cast<const uint16_t*>(out.data());
    int64_t bad = 0;
    for (int64_t i = 0; i < n; ++i) {
      const double x = probes[i];
      const uint16_t want = fd == kGaBFloat16 ? EncodeBf16(x) : EncodeFp16(x);
      const bool ok = std::isnan(x)
                          ? std::isnan(fd == kGaBFloat16 ? DecodeBf16(got[i]) : DecodeFp16(got[i]))
                          : got[i] == want;
      if (!ok && bad++ < 5) {
        uint32_t u;
        std::memcpy(&u, &probes[i], 4);
        ADD_FAILURE() << "value " << x << " (bits 0x" << std::hex << u << "): got 0x" << got[i]
                      << ", want 0x" << want << std::dec;
      }
    }
    EXPECT_EQ(bad, 0);
  }
}

TEST(Conversion, EveryHalfPrecisionValueDecodesExactly) {
  for (ga_dtype fd : {kGaBFloat16, kGaFloat16}) {
    SCOPED_TRACE(DtypeName(fd));
    TestTensor grads(fd, 65536);
    uint16_t* bits = static_cast<uint16_t*>(grads.data());
    for (uint32_t i = 0; i < 65536; ++i) bits[i] = static_cast<uint16_t>(i);
    TestTensor acc(kGaFloat32, 65536);
    const ga_tensor a = acc.desc(), g = grads.desc();
    ga_accumulate_options o{};
    o.mode = kGaAccumulateSum;
    o.weight = 1.0;
    o.overwrite = 1;  // acc ← 1 · g: the decoded value, exactly (fp32 holds every 16-bit value)
    ga_accumulate_result r{};
    ASSERT_EQ(ga_accumulate({&a, 1}, {&g, 1}, &o, 0, &r), kGaOk) << ga_last_error();
    EXPECT_EQ(r.nonfinite, 1);  // the Inf and NaN patterns are among them
    int64_t bad = 0;
    for (uint32_t i = 0; i < 65536; ++i) {
      const double want = fd == kGaBFloat16 ? DecodeBf16(static_cast<uint16_t>(i))
                                            : DecodeFp16(static_cast<uint16_t>(i));
      const double got = acc.Get(i);
      const bool ok = std::isnan(want) ? std::isnan(got)
                                       : (got == want && std::signbit(got) == std::signbit(want));
      if (!ok && bad++ < 5)
        ADD_FAILURE() << "bits 0x" << std::hex << i << std::dec << ": got " << got << ", want "
                      << want;
    }
    EXPECT_EQ(bad, 0);
  }
}

}  // namespace
}  // namespace ga_test
