// Tests of the shared parts of the core: dtype sizes, error reporting, ISA dispatch.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "gradient_accumulator/cpp.h"
#include "test_util.h"

namespace {

TEST(Common, DtypeSizes) {
  EXPECT_EQ(ga_dtype_size(kGaFloat32), 4u);
  EXPECT_EQ(ga_dtype_size(kGaFloat16), 2u);
  EXPECT_EQ(ga_dtype_size(kGaBFloat16), 2u);
  EXPECT_EQ(ga_dtype_size(kGaFloat64), 8u);
  EXPECT_EQ(ga_test::RawDtypeSize(99), 0u);
}

TEST(Common, IsaIsKnown) {
  const std::string isa = ga_cpu_isa();
  EXPECT_TRUE(isa == "avx512" || isa == "avx2" || isa == "generic") << isa;
  EXPECT_GE(ga_cpu_num_threads(), 1);
}

TEST(Common, ErrorNamesArgumentAndCppWrapperThrows) {
  std::vector<float> a(4), g(5);
  ga_tensor at{a.data(), 4, kGaFloat32, kGaCPU, 0}, gt{g.data(), 5, kGaFloat32, kGaCPU, 0};
  ga_accumulate_options o{kGaAccumulateSum, 1.0, 0.0, 0};
  EXPECT_EQ(ga_accumulate({&at, 1}, {&gt, 1}, &o, 0, nullptr), kGaInvalidArgument);
  EXPECT_STREQ(ga_last_error_argument(), "grads[0]");
  EXPECT_NE(std::strstr(ga_last_error(), "elements"), nullptr);
  try {
    ga::check(ga_accumulate({&at, 1}, {&gt, 1}, &o, 0, nullptr));
    FAIL() << "no exception";
  } catch (const ga::Error& e) {
    EXPECT_EQ(e.status(), kGaInvalidArgument);
    EXPECT_EQ(e.argument(), "grads[0]");
  }
  // A successful call clears the error state.
  gt.numel = 4;
  EXPECT_EQ(ga_accumulate({&at, 1}, {&gt, 1}, &o, 0, nullptr), kGaOk);
  EXPECT_STREQ(ga_last_error(), "");
}

}  // namespace
