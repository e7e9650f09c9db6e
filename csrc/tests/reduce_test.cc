// Tests of the reduce op family: pack/unpack of tensor lists into flat buckets with scaling and
// dtype conversion (checked against fp64 and exact round-to-nearest-even), round trips, bad input.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
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

int64_t Total(const TensorList& l) {
  int64_t n = 0;
  for (size_t i = 0; i < l.size(); ++i) n += l[i].numel();
  return n;
}

// Compute bound of one scaled copy: fp64 arithmetic when either side is fp64 (then one rounding
// to fp32 before a narrower store), fp32 arithmetic otherwise.
double CopyBound(ga_dtype src, ga_dtype dst) {
  return (src == kGaFloat64 && dst == kGaFloat64) ? kFp64Compute : kFp32Compute;
}

TEST(Pack, ScaledIntoEveryFlatDtype) {
  auto rng = Rng(61);
  // A list mixing every source dtype, over the odd sizes.
  std::vector<ga_dtype> src_dtypes;
  for (size_t i = 0; i < OddSizes().size(); ++i) src_dtypes.push_back(kAllDtypes[i % 4]);
  TensorList src(src_dtypes, OddSizes());
  src.FillUniform(rng, -3.0, 3.0);
  const auto src_before = src.Bytes();
  for (ga_dtype fd : kAllDtypes) {
    for (double scale : {1.0 / 3.0, 0.5, -2.0}) {
      SCOPED_TRACE(testing::Message() << DtypeName(fd) << " scale " << scale);
      const int64_t total = Total(src);
      TestTensor flat(fd, total + 5);  // room to spare: the tail must stay untouched
      for (int64_t j = total; j < total + 5; ++j) flat.Set(j, 42.0);
      ASSERT_EQ(ga_pack(src.list(), flat.desc(), scale), kGaOk) << ga_last_error();
      const auto fv = flat.Values();
      int64_t off = 0;
      for (size_t i = 0; i < src.size(); ++i) {
        const auto sv = src[i].Values();
        std::vector<double> want(sv.size());
        for (size_t j = 0; j < sv.size(); ++j) want[j] = scale * sv[j];
        const std::vector<double> got(fv.begin() + off, fv.begin() + off + sv.size());
        EXPECT_TRUE(Near(got, want, CopyBound(src[i].dtype(), fd), fd)) << "tensor " << i;
        off += static_cast<int64_t>(sv.size());
      }
      for (int64_t j = total; j < total + 5; ++j) EXPECT_EQ(fv[j], 42.0);
      EXPECT_TRUE(flat.GuardsIntact());
      EXPECT_EQ(src.Bytes(), src_before);
    }
  }
}

TEST(Unpack, ScaledFromEveryFlatDtype) {
  auto rng = Rng(62);
  for (ga_dtype fd : kAllDtypes) {
    for (ga_dtype dd : kAllDtypes) {
      SCOPED_TRACE(testing::Message() << DtypeName(fd) << " -> " << DtypeName(dd));
      TensorList dst(dd, OddSizes());
      TestTensor flat(fd, Total(dst) + 3);
      flat.FillUniform(rng, -3.0, 3.0);
      const auto flat_before = flat.Bytes();
      const double scale = 0.125 * 3.0 / 7.0;
      ASSERT_EQ(ga_unpack(flat.desc(), dst.list(), scale), kGaOk) << ga_last_error();
      const auto fv = flat.Values();
      int64_t off = 0;
      for (size_t i = 0; i < dst.size(); ++i) {
        std::vector<double> want(dst[i].numel());
        for (int64_t j = 0; j < dst[i].numel(); ++j) want[j] = scale * fv[off + j];
        EXPECT_TRUE(Near(dst[i].Values(), want, CopyBound(fd, dd), dd)) << "tensor " << i;
        off += dst[i].numel();
      }
      EXPECT_TRUE(dst.GuardsIntact());
      EXPECT_EQ(flat.Bytes(), flat_before);
    }
  }
}

TEST(PackUnpack, RoundTripIsExactWithPowerOfTwoScales) {
  // Pack into a wider (or equal) format with scale 2^k and unpack with 2^-k: bit-exact.
  auto rng = Rng(63);
  struct Pair {
    ga_dtype src, flat;
  };
  for (const Pair& p :
       {Pair{kGaFloat32, kGaFloat32}, Pair{kGaBFloat16, kGaFloat32}, Pair{kGaFloat16, kGaFloat32},
        Pair{kGaBFloat16, kGaBFloat16}, Pair{kGaFloat16, kGaFloat16}, Pair{kGaFloat32, kGaFloat64},
        Pair{kGaFloat64, kGaFloat64}}) {
    SCOPED_TRACE(testing::Message() << DtypeName(p.src) << " via " << DtypeName(p.flat));
    TensorList src(p.src, OddSizes()), back(p.src, OddSizes());
    src.FillUniform(rng, -100.0, 100.0);
    TestTensor flat(p.flat, Total(src));
    ASSERT_EQ(ga_pack(src.list(), flat.desc(), 4.0), kGaOk);
    ASSERT_EQ(ga_unpack(flat.desc(), back.list(), 0.25), kGaOk);
    for (size_t i = 0; i < src.size(); ++i)
      EXPECT_EQ(back[i].DataBytes(), src[i].DataBytes()) << "tensor " << i;
  }
}

TEST(PackUnpack, RoundTripWithScaleWithinTolerance) {
  // A mean over 3 replicas: pack scaled by 1/3 into fp32, unpack times 3 into bf16.
  auto rng = Rng(64);
  TensorList src(kGaFloat32, OddSizes()), back(kGaBFloat16, OddSizes());
  src.FillUniform(rng, -1.0, 1.0);
  TestTensor flat(kGaFloat32, Total(src));
  ASSERT_EQ(ga_pack(src.list(), flat.desc(), 1.0 / 3.0), kGaOk);
  ASSERT_EQ(ga_unpack(flat.desc(), back.list(), 3.0), kGaOk);
  for (size_t i = 0; i < src.size(); ++i)
    EXPECT_TRUE(Near(back[i].Values(), src[i].Values(), 2 * kFp32Compute, kGaBFloat16));
}

// Conversion of one fp32 value into bf16/fp16 through ga_pack with scale 1: the core must round
// to nearest, ties to even, exactly like the test's encoder.
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

TEST(Pack, ConversionIsRoundToNearestEven) {
  const std::vector<float> probes = ConversionProbes();
  const int64_t n = static_cast<int64_t>(probes.size());
  TestTensor src(kGaFloat32, n);
  std::memcpy(src.data(), probes.data(), probes.size() * 4);
  for (ga_dtype fd : {kGaBFloat16, kGaFloat16}) {
    SCOPED_TRACE(DtypeName(fd));
    TestTensor flat(fd, n);
    const ga_tensor s = src.desc();
    ASSERT_EQ(ga_pack({&s, 1}, flat.desc(), 1.0), kGaOk);
    const uint16_t* got = static_cast<const uint16_t*>(flat.data());
    int64_t bad = 0;
    for (int64_t i = 0; i < n; ++i) {
      const double x = probes[i];
      const uint16_t want = fd == kGaBFloat16 ? EncodeBf16(x) : EncodeFp16(x);
      const bool is_nan = std::isnan(x);
      const bool ok = is_nan
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

TEST(Unpack, EveryHalfPrecisionValueDecodesExactly) {
  // All 65536 bit patterns of bf16 and fp16 unpacked to fp64 must equal the format's definition.
  for (ga_dtype fd : {kGaBFloat16, kGaFloat16}) {
    SCOPED_TRACE(DtypeName(fd));
    TestTensor flat(fd, 65536);
    uint16_t* bits = static_cast<uint16_t*>(flat.data());
    for (uint32_t i = 0; i < 65536; ++i) bits[i] = static_cast<uint16_t>(i);
    TestTensor out(kGaFloat64, 65536);
    const ga_tensor o = out.desc();
    ASSERT_EQ(ga_unpack(flat.desc(), {&o, 1}, 1.0), kGaOk);
    int64_t bad = 0;
    for (uint32_t i = 0; i < 65536; ++i) {
      const double want = fd == kGaBFloat16 ? DecodeBf16(static_cast<uint16_t>(i))
                                            : DecodeFp16(static_cast<uint16_t>(i));
      const double got = out.Get(i);
      const bool ok = std::isnan(want) ? std::isnan(got)
                                       : (got == want && std::signbit(got) == std::signbit(want));
      if (!ok && bad++ < 5)
        ADD_FAILURE() << "bits 0x" << std::hex << i << std::dec << ": got " << got << ", want "
                      << want;
    }
    EXPECT_EQ(bad, 0);
  }
}

TEST(PackUnpack, EmptyListsAndEmptyFlat) {
  const ga_tensor empty_flat{nullptr, 0, kGaFloat32, kGaCPU, 0};
  EXPECT_EQ(ga_pack({nullptr, 0}, empty_flat, 1.0), kGaOk) << ga_last_error();
  EXPECT_EQ(ga_unpack(empty_flat, {nullptr, 0}, 1.0), kGaOk) << ga_last_error();
  const ga_tensor e{nullptr, 0, kGaBFloat16, kGaCPU, 0};
  const ga_tensor two[2] = {e, e};
  EXPECT_EQ(ga_pack({two, 2}, empty_flat, 2.0), kGaOk);
  TestTensor flat(kGaFloat32, 4);
  for (int i = 0; i < 4; ++i) flat.Set(i, 9.0);
  EXPECT_EQ(ga_unpack(flat.desc(), {two, 2}, 2.0), kGaOk);
  EXPECT_EQ(flat.Values(), (std::vector<double>{9, 9, 9, 9}));
}

TEST(PackUnpack, NonfiniteValuesPassThrough) {
  std::vector<float> x{1.0f, std::nanf(""), -std::numeric_limits<float>::infinity(), 2.0f};
  const ga_tensor s{x.data(), 4, kGaFloat32, kGaCPU, 0};
  for (ga_dtype fd : kAllDtypes) {
    TestTensor flat(fd, 4);
    ASSERT_EQ(ga_pack({&s, 1}, flat.desc(), 0.5), kGaOk);
    EXPECT_EQ(flat.Get(0), 0.5);
    EXPECT_TRUE(std::isnan(flat.Get(1)));
    EXPECT_EQ(flat.Get(2), -kInf);
    EXPECT_EQ(flat.Get(3), 1.0);
  }
}

// ---- bad input ----

class ReduceBadInput : public ::testing::Test {
 protected:
  ReduceBadInput()
      : list_({kGaFloat32, kGaBFloat16, kGaFloat64}, {5, 16385, 7}), flat_(kGaFloat32, 16397) {
    auto rng = Rng(66);
    list_.FillUniform(rng, -1.0, 1.0);
    flat_.FillUniform(rng, -1.0, 1.0);
    before_ = Snapshot(list_, flat_);
  }
  void ExpectFail(bool pack, ga_status st, std::initializer_list<std::string> args,
                  double scale = 1.0, const ga_tensor* flat = nullptr) {
    const ga_tensor f = flat ? *flat : flat_.desc();
    const ga_status got =
        pack ? ga_pack(list_.list(), f, scale) : ga_unpack(f, list_.list(), scale);
    EXPECT_TRUE(FailsWith(got, st, args)) << (pack ? "pack" : "unpack");
    EXPECT_EQ(Snapshot(list_, flat_), before_);
    list_.Rebuild();
  }
  TensorList list_;
  TestTensor flat_;
  std::vector<uint8_t> before_;
};

TEST_F(ReduceBadInput, FlatTooSmallAndScale) {
  for (bool pack : {true, false}) {
    ga_tensor small = flat_.desc();
    small.numel = 16396;
    ExpectFail(pack, kGaInvalidArgument, {"flat"}, 1.0, &small);
    for (double scale : {kNaN, kInf, -kInf}) ExpectFail(pack, kGaInvalidArgument, {"scale"}, scale);
  }
}

TEST_F(ReduceBadInput, Descriptors) {
  for (bool pack : {true, false}) {
    const char* name = pack ? "src" : "dst";
    list_.desc(1).numel = -3;
    ExpectFail(pack, kGaInvalidArgument, {std::string(name) + "[1]"});
    SetRaw(list_.desc(2).dtype, 7);
    ExpectFail(pack, kGaTypeError, {std::string(name) + "[2]"});
    list_.desc(0).data = nullptr;
    ExpectFail(pack, kGaInvalidArgument, {std::string(name) + "[0]"});
    ga_tensor bad_flat = flat_.desc();
    SetRaw(bad_flat.dtype, -1);
    ExpectFail(pack, kGaTypeError, {"flat"}, 1.0, &bad_flat);
    bad_flat = flat_.desc();
    bad_flat.data = static_cast<uint8_t*>(flat_.data()) + 1;
    ExpectFail(pack, kGaInvalidArgument, {"flat"}, 1.0, &bad_flat);
    if (!ga_has_cuda()) {
      bad_flat = flat_.desc();
      bad_flat.device_type = kGaCUDA;
      ExpectFail(pack, kGaUnsupported, {"flat"}, 1.0, &bad_flat);
    }
    const ga_status st = pack ? ga_pack({nullptr, 2}, flat_.desc(), 1.0)
                              : ga_unpack(flat_.desc(), {nullptr, 2}, 1.0);
    EXPECT_TRUE(FailsWith(st, kGaInvalidArgument, {name}));
    EXPECT_EQ(Snapshot(list_, flat_), before_);
  }
}

TEST_F(ReduceBadInput, Aliasing) {
  for (bool pack : {true, false}) {
    const std::string name = pack ? "src" : "dst";
    // The flat buffer overlapping one of the tensors.
    TestTensor big(kGaBFloat16, 16397 + 8);
    list_.desc(1).data = big.at(0);
    const ga_tensor flat_in_big{big.at(4), 16397, kGaBFloat16, kGaCPU, 0};
    const auto big_before = big.Bytes();
    ExpectFail(pack, kGaInvalidArgument, {"flat", name + "[1]"}, 1.0, &flat_in_big);
    EXPECT_EQ(big.Bytes(), big_before);
    // Two destination tensors sharing memory (harmless as sources, an error as destinations).
    list_.desc(2).data = list_[0].at(0);
    list_.desc(2).dtype = kGaFloat32;
    list_.desc(2).numel = 5;
    if (pack) {
      TestTensor flat(kGaFloat32, 16397);
      EXPECT_EQ(ga_pack(list_.list(), flat.desc(), 1.0), kGaOk) << ga_last_error();
      EXPECT_EQ(Snapshot(list_, flat_), before_);
      list_.Rebuild();
    } else {
      ExpectFail(pack, kGaInvalidArgument, {"dst[0]", "dst[2]"});
    }
  }
}

}  // namespace
}  // namespace ga_test
