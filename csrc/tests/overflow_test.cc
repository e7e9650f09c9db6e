// Size computations that would wrap: every one is refused with the argument named and nothing
// written, instead of passing a bounds check with a wrapped value.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "gradient_accumulator/gradient_accumulator.h"
#include "test_util.h"

namespace ga_test {
namespace {

constexpr int64_t kMax = std::numeric_limits<int64_t>::max();

TEST(Overflow, ArenaPlanTotalIsChecked) {
  struct Case {
    std::vector<int64_t> numels;
    int reverse;
    const char* argument;
  };
  const std::vector<Case> cases{
      {{kMax - 3, 16}, 0, "numels[0]"},                        // rounding up to the alignment wraps
      {{kMax - 3, 16}, 1, "numels[0]"},                        // the same, laid out last-first
      {{int64_t{1} << 62, int64_t{1} << 62}, 0, "numels[1]"},  // the running total wraps
      {{16, kMax - 40, 64}, 1, "numels[2]"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.argument);
    const size_t n = c.numels.size();
    std::vector<int64_t> offsets(n, -7), bucket_of(n, -7), bucket_start(n + 1, -7);
    int64_t nb = -7, total = -7;
    const ga_arena_plan_options o{16, 32, c.reverse};
    EXPECT_TRUE(
        FailsWith(ga_arena_plan(c.numels.data(), static_cast<int64_t>(n), &o, offsets.data(),
                                bucket_of.data(), bucket_start.data(), &nb, &total),
                  kGaInvalidArgument, {c.argument}));
    for (int64_t v : offsets) EXPECT_EQ(v, -7);
    for (int64_t v : bucket_of) EXPECT_EQ(v, -7);
    for (int64_t v : bucket_start) EXPECT_EQ(v, -7);
    EXPECT_EQ(nb, -7);
    EXPECT_EQ(total, -7);
  }
}

// A descriptor whose byte size or end address wraps is refused as that tensor (before, it passed
// and the call went on to complain about something else, or to run off its memory).
TEST(Overflow, DescriptorByteRangeIsChecked) {
  TensorList acc(kGaFloat32, {8}), grads(kGaFloat32, {8});
  ga_accumulate_options o{kGaAccumulateSum, -1.0, 0.0, 0};  // a bad weight: checked later
  acc.desc(0).numel = (int64_t{1} << 62) + 1;               // 4·numel wraps to 4 bytes
  grads.desc(0).numel = acc.desc(0).numel;
  EXPECT_TRUE(FailsWith(ga_accumulate(acc.list(), grads.list(), &o, 0, nullptr), kGaInvalidArgument,
                        {"accumulators[0]"}));
  EXPECT_NE(std::string(ga_last_error()).find("overflows"), std::string::npos);
  acc.Rebuild();
  grads.Rebuild();
  // The last 16 bytes of the address space hold 4 floats, not 8.
  acc.desc(0).data = reinterpret_cast<void*>(~uintptr_t{0} - 15);
  EXPECT_TRUE(FailsWith(ga_accumulate(acc.list(), grads.list(), &o, 0, nullptr), kGaInvalidArgument,
                        {"accumulators[0]"}));
}

TEST(Overflow, BnMomentsShapeProductIsChecked) {
  // outer·channels·inner = 2^62·4 wraps to 0, the element count of x.
  TestTensor x(kGaFloat32, 0), mean(kGaFloat16, 4), m2(kGaFloat16, 4);
  EXPECT_TRUE(FailsWith(ga_bn_moments(x.desc(), int64_t{1} << 62, 4, 1, mean.desc(), m2.desc()),
                        kGaInvalidArgument, {"channels", "inner"}));
  EXPECT_TRUE(FailsWith(ga_bn_moments(x.desc(), 3, int64_t{1} << 62, 8, mean.desc(), m2.desc()),
                        kGaInvalidArgument, {"channels", "inner"}));
}

}  // namespace
}  // namespace ga_test
