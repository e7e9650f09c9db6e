// Shared helpers of the core's tests: guarded test tensors, bf16/fp16 encoding, fp64 references,
// failure checks and the per-dtype tolerance table.
#ifndef GRADIENT_ACCUMULATOR_TESTS_TEST_UTIL_H_
#define GRADIENT_ACCUMULATOR_TESTS_TEST_UTIL_H_

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "gradient_accumulator/gradient_accumulator.h"

extern "C" {
// Defined in c_abi.c: calls made from C, where any int converts to an enum type, so the tests can
// pass out-of-range values to by-value enum parameters as a C caller may.
size_t ga_test_dtype_size_raw(int dtype);
}

namespace ga_test {

/// Store the int `v` in an enum field as a C caller may: through its bytes, never by forming
/// an out-of-range value of the C++ enum type (undefined behaviour).
template <typename E>
void SetRaw(E& field, int v) {
  static_assert(std::is_enum_v<E> && sizeof(E) == sizeof(int), "an int-sized enum field");
  std::memcpy(&field, &v, sizeof v);
}

/// ga_dtype_size of any int, called from C.
inline size_t RawDtypeSize(int v) { return ga_test_dtype_size_raw(v); }

// ---------------------------------------------------------------------------------------------
// Tolerance table.
//
// A result is checked element by element as
//     |got − want| ≤ compute · mag + StoreRel(stored) · max(|want|, |got|) + StoreAbs(stored)
// where `want` is the fp64 reference computed by the test from the exact (decoded) inputs,
// `mag` is the same expression evaluated with every term replaced by its absolute value (a
// running error bound: cancellation cannot hide behind a small result), `compute` is the bound
// per unit of magnitude of the arithmetic the core does, and StoreRel/StoreAbs cover the final
// rounding into the output's format.
//
// Inputs given as bf16 or fp16 convert exactly to fp32 and fp64, so inputs of any dtype are held
// to the same compute bound; only the format the result is *stored* in changes the bound.
// ---------------------------------------------------------------------------------------------

// Results computed in fp32 arithmetic (accumulate, apply). Unit roundoff u32 = 2^-24 ≈ 6.0e-8 per
// operation; the longest chain in the core (Adam: scale, weight decay, two moment updates, sqrt,
// bias corrections, divide, subtract, with fp32-rounded constants such as 1 − β1) is about 12
// operations, i.e. ≤ 7.2e-7 per unit of `mag`. 1e-6 (≈ 17 u32) keeps headroom yet fails any wrong
// formula: a dropped or wrong term changes a result by ≥ 1e-3 relative with the hyper-parameters
// used in these tests.
constexpr double kFp32Compute = 1e-6;

// Results the core accumulates in fp64 (sum of squares, unit norms, batch-norm moments and
// merges, fp64 accumulators). Chunked sums of n terms with SIMD partial sums carry a worst-case
// relative error of (n/lanes)·u64 ≈ 4096 · 1.1e-16 = 4.5e-13 for the core's 16384-element chunks;
// longer sequential sums (batch-norm channels) grow like sqrt(n)·u64 ≲ 1e-13 on random data.
// The references use compensated summation, so their own error is negligible.
constexpr double kFp64Compute = 1e-12;

// Relative half-ulp of each format: a value x rounded to p significant bits moves by at most
// 2^-p · |x| (fp32 p = 24, bf16 p = 8, fp16 p = 11, fp64 p = 53).
inline double StoreRel(ga_dtype dtype) {
  switch (dtype) {
    case kGaFloat32:
      return std::ldexp(1.0, -24);
    case kGaBFloat16:
      return std::ldexp(1.0, -8);
    case kGaFloat16:
      return std::ldexp(1.0, -11);
    case kGaFloat64:
      return std::ldexp(1.0, -53);
  }
  return 0.0;
}

// Absolute half-ulp floor of the subnormal range: half the smallest subnormal of each format
// (fp16 2^-25; bf16 and fp32 share fp32's exponent range, 2^-150; fp64 is zero in practice).
inline double StoreAbs(ga_dtype dtype) {
  switch (dtype) {
    case kGaFloat32:
      return std::ldexp(1.0, -150);
    case kGaBFloat16:
      return std::ldexp(1.0, -150);
    case kGaFloat16:
      return std::ldexp(1.0, -25);
    case kGaFloat64:
      return 0.0;
  }
  return 0.0;
}

inline const char* DtypeName(ga_dtype dtype) {
  switch (dtype) {
    case kGaFloat32:
      return "float32";
    case kGaBFloat16:
      return "bfloat16";
    case kGaFloat16:
      return "float16";
    case kGaFloat64:
      return "float64";
  }
  return "unknown";
}

// Element counts every multi-tensor test runs over: empty, tiny, odd, around the core's
// 16384-element chunk, and a large prime.
inline const std::vector<int64_t>& OddSizes() {
  static const std::vector<int64_t> sizes{0, 1, 7, 31, 16383, 16384, 16385, 100003};
  return sizes;
}

// ---------------------------------------------------------------------------------------------
// bf16 / fp16 encoding, written from the definition of the formats (round to nearest, ties to
// even, in fp64 arithmetic) — independent of the core's bit tricks.
// ---------------------------------------------------------------------------------------------

// Rounds a finite a ≥ 0 to `p` significant bits with smallest normal exponent `emin`.
inline double RoundSignificand(double a, int p, int emin) {
  if (a == 0.0) return 0.0;
  const int e = std::max(std::ilogb(a), emin);
  const double q = std::ldexp(1.0, e - (p - 1));
  return std::nearbyint(a / q) * q;  // a / q is exact; nearbyint rounds ties to even
}

inline uint16_t EncodeBf16(double x) {
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  if (std::isnan(x)) return sign | 0x7fc0;
  const double a = std::fabs(x);
  const double max_finite = std::ldexp(255.0, 120);  // (2 − 2^-7) · 2^127
  if (std::isinf(a)) return sign | 0x7f80;
  const double r = RoundSignificand(a, 8, -126);
  if (r > max_finite) return sign | 0x7f80;
  const float f = static_cast<float>(r);  // exact: bf16 values are fp32 values
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return sign | static_cast<uint16_t>(u >> 16);
}

inline double DecodeBf16(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t EncodeFp16(double x) {
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  if (std::isnan(x)) return sign | 0x7e00;
  const double a = std::fabs(x);
  if (std::isinf(a)) return sign | 0x7c00;
  const double r = RoundSignificand(a, 11, -14);
  if (r > 65504.0) return sign | 0x7c00;
  if (r < std::ldexp(1.0, -14)) return sign | static_cast<uint16_t>(std::ldexp(r, 24));
  const int e = std::ilogb(r);
  const uint16_t m = static_cast<uint16_t>(std::ldexp(r, 10 - e) - 1024.0);
  return sign | static_cast<uint16_t>(((e + 15) << 10) | m);
}

inline double DecodeFp16(uint16_t bits) {
  const int e = (bits >> 10) & 0x1f;
  const int m = bits & 0x3ff;
  double v;
  if (e == 0) {
    v = std::ldexp(static_cast<double>(m), -24);
  } else if (e == 31) {
    v = m ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  } else {
    v = std::ldexp(static_cast<double>(1024 + m), e - 25);
  }
  return (bits & 0x8000) ? -v : v;
}

// The value `x` becomes when stored in `dtype`.
inline double RoundTo(ga_dtype dtype, double x) {
  switch (dtype) {
    case kGaFloat32:
      return static_cast<float>(x);
    case kGaBFloat16:
      return DecodeBf16(EncodeBf16(x));
    case kGaFloat16:
      return DecodeFp16(EncodeFp16(x));
    case kGaFloat64:
      return x;
  }
  return x;
}

// ---------------------------------------------------------------------------------------------
// fp64 references.
// ---------------------------------------------------------------------------------------------

// Neumaier's compensated sum: error independent of the number of terms to first order.
class ExactSum {
 public:
  void Add(double x) {
    const double t = sum_ + x;
    comp_ += std::fabs(sum_) >= std::fabs(x) ? (sum_ - t) + x : (x - t) + sum_;
    sum_ = t;
  }
  double Value() const { return sum_ + comp_; }

 private:
  double sum_ = 0.0;
  double comp_ = 0.0;
};

inline double SumSquares(const std::vector<double>& x) {
  ExactSum s;
  for (double v : x) s.Add(v * v);
  return s.Value();
}

// ---------------------------------------------------------------------------------------------
// Test tensors: a 64-byte-aligned allocation holding `offset` guard elements, the data, and
// kGuardBytes of guard after it. offset = 1 (the default) makes the data pointer unaligned to
// any vector width; the guards catch writes outside the tensor.
// ---------------------------------------------------------------------------------------------

constexpr size_t kGuardBytes = 64;
constexpr uint8_t kGuardByte = 0xA5;

class TestTensor {
 public:
  TestTensor(ga_dtype dtype, int64_t numel, int64_t offset = 1)
      : dtype_(dtype), numel_(numel), offset_(offset) {
    const size_t esize = ga_dtype_size(dtype);
    lead_ = static_cast<size_t>(offset) * esize;
    bytes_ = (lead_ + static_cast<size_t>(numel) * esize + kGuardBytes + 63) / 64 * 64;
    mem_.reset(static_cast<uint8_t*>(std::aligned_alloc(64, bytes_)));
    std::memset(mem_.get(), kGuardByte, bytes_);
    std::memset(mem_.get() + lead_, 0, static_cast<size_t>(numel) * esize);
  }

  ga_tensor desc() const { return ga_tensor{data(), numel_, dtype_, kGaCPU, 0}; }
  void* data() const { return mem_.get() + lead_; }
  int64_t numel() const { return numel_; }
  ga_dtype dtype() const { return dtype_; }
  // Address of element i (also valid one past the end), for building aliasing descriptors.
  void* at(int64_t i) const {
    return static_cast<uint8_t*>(data()) + static_cast<size_t>(i) * ga_dtype_size(dtype_);
  }

  double Get(int64_t i) const {
    switch (dtype_) {
      case kGaFloat32:
        return static_cast<const float*>(data())[i];
      case kGaFloat64:
        return static_cast<const double*>(data())[i];
      case kGaBFloat16:
        return DecodeBf16(static_cast<const uint16_t*>(data())[i]);
      case kGaFloat16:
        return DecodeFp16(static_cast<const uint16_t*>(data())[i]);
    }
    return 0.0;
  }
  // Stores v rounded to nearest even in the tensor's format.
  void Set(int64_t i, double v) {
    switch (dtype_) {
      case kGaFloat32:
        static_cast<float*>(data())[i] = static_cast<float>(v);
        break;
      case kGaFloat64:
        static_cast<double*>(data())[i] = v;
        break;
      case kGaBFloat16:
        static_cast<uint16_t*>(data())[i] = EncodeBf16(v);
        break;
      case kGaFloat16:
        static_cast<uint16_t*>(data())[i] = EncodeFp16(v);
        break;
    }
  }
  std::vector<double> Values() const {
    std::vector<double> v(static_cast<size_t>(numel_));
    for (int64_t i = 0; i < numel_; ++i) v[i] = Get(i);
    return v;
  }
  void SetValues(const std::vector<double>& v) {
    for (int64_t i = 0; i < numel_; ++i) Set(i, v[i]);
  }
  void FillUniform(std::mt19937_64& rng, double lo, double hi) {
    std::uniform_real_distribution<double> dist(lo, hi);
    for (int64_t i = 0; i < numel_; ++i) Set(i, dist(rng));
  }
  // The whole allocation, guards included.
  std::vector<uint8_t> Bytes() const {
    return std::vector<uint8_t>(mem_.get(), mem_.get() + bytes_);
  }
  // The data bytes only.
  std::vector<uint8_t> DataBytes() const {
    const uint8_t* p = mem_.get() + lead_;
    return std::vector<uint8_t>(p, p + static_cast<size_t>(numel_) * ga_dtype_size(dtype_));
  }
  bool GuardsIntact() const {
    const size_t end = lead_ + static_cast<size_t>(numel_) * ga_dtype_size(dtype_);
    for (size_t i = 0; i < bytes_; ++i)
      if ((i < lead_ || i >= end) && mem_.get()[i] != kGuardByte) return false;
    return true;
  }

 private:
  struct Free {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  ga_dtype dtype_;
  int64_t numel_;
  int64_t offset_;
  size_t lead_ = 0;
  size_t bytes_ = 0;
  std::unique_ptr<uint8_t, Free> mem_;
};

// Owned tensors plus the descriptor array a ga_tensor_list points at. Descriptors are built once
// and may be edited through desc(i) to make bad input.
class TensorList {
 public:
  TensorList() = default;
  TensorList(ga_dtype dtype, const std::vector<int64_t>& sizes, int64_t offset = 1) {
    for (int64_t n : sizes) tensors_.emplace_back(dtype, n, offset);
    Rebuild();
  }
  TensorList(const std::vector<ga_dtype>& dtypes, const std::vector<int64_t>& sizes,
             int64_t offset = 1) {
    for (size_t i = 0; i < sizes.size(); ++i) tensors_.emplace_back(dtypes[i], sizes[i], offset);
    Rebuild();
  }

  TestTensor& operator[](size_t i) { return tensors_[i]; }
  const TestTensor& operator[](size_t i) const { return tensors_[i]; }
  size_t size() const { return tensors_.size(); }
  ga_tensor& desc(size_t i) { return descs_[i]; }
  ga_tensor_list list() const {
    return ga_tensor_list{descs_.empty() ? nullptr : descs_.data(),
                          static_cast<int64_t>(descs_.size())};
  }
  void Rebuild() {
    descs_.clear();
    for (const TestTensor& t : tensors_) descs_.push_back(t.desc());
  }
  void FillUniform(std::mt19937_64& rng, double lo, double hi) {
    for (TestTensor& t : tensors_) t.FillUniform(rng, lo, hi);
  }
  std::vector<std::vector<double>> Values() const {
    std::vector<std::vector<double>> v;
    for (const TestTensor& t : tensors_) v.push_back(t.Values());
    return v;
  }
  std::vector<uint8_t> Bytes() const {
    std::vector<uint8_t> b;
    for (const TestTensor& t : tensors_) {
      const std::vector<uint8_t> x = t.Bytes();
      b.insert(b.end(), x.begin(), x.end());
    }
    return b;
  }
  bool GuardsIntact() const {
    for (const TestTensor& t : tensors_)
      if (!t.GuardsIntact()) return false;
    return true;
  }

 private:
  std::vector<TestTensor> tensors_;
  std::vector<ga_tensor> descs_;
};

inline std::vector<uint8_t> BytesOf(const TestTensor& t) { return t.Bytes(); }
inline std::vector<uint8_t> BytesOf(const TensorList& l) { return l.Bytes(); }

// Byte image of every buffer given, for "nothing was written" checks.
template <typename... Ts>
std::vector<uint8_t> Snapshot(const Ts&... xs) {
  std::vector<uint8_t> all;
  for (const std::vector<uint8_t>& b : {BytesOf(xs)...}) all.insert(all.end(), b.begin(), b.end());
  return all;
}

inline std::mt19937_64 Rng(uint64_t seed) { return std::mt19937_64(seed); }

// ---------------------------------------------------------------------------------------------
// Assertions.
// ---------------------------------------------------------------------------------------------

// |got − want| ≤ compute·mag + StoreRel(stored)·max(|want|, |got|) + StoreAbs(stored) for every
// element (see the tolerance table). NaN must meet NaN and ±Inf the same infinity.
inline ::testing::AssertionResult Near(const std::vector<double>& got,
                                       const std::vector<double>& want,
                                       const std::vector<double>& mag, double compute,
                                       ga_dtype stored) {
  if (got.size() != want.size() || mag.size() != want.size())
    return ::testing::AssertionFailure() << "size mismatch: got " << got.size() << ", want "
                                         << want.size() << ", mag " << mag.size();
  int shown = 0;
  int64_t bad = 0;
  std::ostringstream msg;
  msg.precision(17);
  for (size_t i = 0; i < got.size(); ++i) {
    bool ok;
    double bound = 0.0;
    if (std::isnan(want[i])) {
      ok = std::isnan(got[i]);
    } else if (std::isinf(want[i])) {
      ok = got[i] == want[i];
    } else {
      bound = compute * mag[i] +
              StoreRel(stored) * std::max(std::fabs(want[i]), std::fabs(got[i])) + StoreAbs(stored);
      ok = std::fabs(got[i] - want[i]) <= bound;
    }
    if (!ok) {
      ++bad;
      if (shown++ < 5)
        msg << "\n  [" << i << "] got " << got[i] << ", want " << want[i] << ", |diff| "
            << std::fabs(got[i] - want[i]) << " > bound " << bound;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " of " << got.size() << " elements off ("
                                       << DtypeName(stored) << " storage)" << msg.str();
}

// Magnitude defaults to |want| (no cancellation in the computation).
inline ::testing::AssertionResult Near(const std::vector<double>& got,
                                       const std::vector<double>& want, double compute,
                                       ga_dtype stored) {
  std::vector<double> mag(want.size());
  for (size_t i = 0; i < want.size(); ++i) mag[i] = std::fabs(want[i]);
  return Near(got, want, mag, compute, stored);
}

inline ::testing::AssertionResult NearScalar(double got, double want, double rel) {
  if (std::fabs(got - want) <= rel * std::fabs(want)) return ::testing::AssertionSuccess();
  std::ostringstream m;
  m.precision(17);
  m << "got " << got << ", want " << want << ", relative error "
    << std::fabs(got - want) / std::fabs(want) << " > " << rel;
  return ::testing::AssertionFailure() << m.str();
}

// The call failed with `want` and ga_last_error_argument() is one of `arguments` (two names when
// either side of an aliasing pair may be reported); the message is not empty.
inline ::testing::AssertionResult FailsWith(ga_status got, ga_status want,
                                            std::initializer_list<std::string> arguments) {
  const std::string arg = ga_last_error_argument();
  const std::string msg = ga_last_error();
  if (got != want)
    return ::testing::AssertionFailure() << "status " << got << ", want " << want << " (argument '"
                                         << arg << "', message '" << msg << "')";
  if (msg.empty()) return ::testing::AssertionFailure() << "empty error message";
  for (const std::string& a : arguments)
    if (a == arg) return ::testing::AssertionSuccess();
  std::ostringstream names;
  for (const std::string& a : arguments) names << " '" << a << "'";
  return ::testing::AssertionFailure()
         << "argument '" << arg << "', want one of" << names.str() << " (message '" << msg << "')";
}

// A matrix view for the fused weight-gradient tests: rows × cols with element strides rs, cs
// over numel elements of data on device.
inline ga_matrix MatrixOn(ga_device_type device, void* data, ga_dtype dtype, int64_t numel,
                          int64_t rows, int64_t cols, int64_t rs, int64_t cs) {
  ga_matrix m{};
  m.tensor.data = data;
  m.tensor.dtype = dtype;
  m.tensor.numel = numel;
  m.tensor.device_type = device;
  m.tensor.device_id = 0;
  m.rows = rows;
  m.cols = cols;
  m.row_stride = rs;
  m.col_stride = cs;
  return m;
}

inline ga_status UnsupportedOrTypeError() { return ga_has_cuda() ? kGaTypeError : kGaUnsupported; }

}  // namespace ga_test

#endif  // GRADIENT_ACCUMULATOR_TESTS_TEST_UTIL_H_
