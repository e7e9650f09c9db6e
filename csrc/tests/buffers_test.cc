// Tests of the buffers op family: arena planning and ga_zero.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "gradient_accumulator/gradient_accumulator.h"
#include "test_util.h"

namespace ga_test {
namespace {

struct Plan {
  std::vector<int64_t> offsets, bucket_of, bucket_start;
  int64_t num_buckets = -7, total = -7;
};

ga_status RunPlan(const std::vector<int64_t>& numels, const ga_arena_plan_options* o, Plan* p) {
  const size_t n = numels.size();
  p->offsets.assign(n, -7);
  p->bucket_of.assign(n, -7);
  p->bucket_start.assign(n + 1, -7);
  return ga_arena_plan(numels.data(), static_cast<int64_t>(n), o, p->offsets.data(),
                       p->bucket_of.data(), p->bucket_start.data(), &p->num_buckets, &p->total);
}

TEST(ArenaPlan, HandComputedReverseLayout) {
  // Backward order visits tensors 4, 3, 2, 1, 0; every start is a multiple of 16 elements and a
  // bucket closes once it holds ≥ 32 elements.
  const std::vector<int64_t> numels{5, 16, 0, 33, 1};
  ga_arena_plan_options o{16, 32, 1};
  Plan p;
  ASSERT_EQ(RunPlan(numels, &o, &p), kGaOk) << ga_last_error();
  EXPECT_EQ(p.offsets, (std::vector<int64_t>{80, 64, 64, 16, 0}));
  EXPECT_EQ(p.bucket_of, (std::vector<int64_t>{1, 1, 1, 0, 0}));
  EXPECT_EQ(p.num_buckets, 2);
  EXPECT_EQ(std::vector<int64_t>(p.bucket_start.begin(), p.bucket_start.begin() + 3),
            (std::vector<int64_t>{0, 64, 96}));
  EXPECT_EQ(p.total, 96);
}

TEST(ArenaPlan, HandComputedForwardLayout) {
  const std::vector<int64_t> numels{5, 16, 0, 33, 1};
  ga_arena_plan_options o{4, 20, 0};
  Plan p;
  ASSERT_EQ(RunPlan(numels, &o, &p), kGaOk) << ga_last_error();
  // Padded sizes 8, 16, 0, 36, 4. Bucket 0: tensors 0, 1 (24 ≥ 20); bucket 1: 2, 3; bucket 2: 4.
  EXPECT_EQ(p.offsets, (std::vector<int64_t>{0, 8, 24, 24, 60}));
  EXPECT_EQ(p.bucket_of, (std::vector<int64_t>{0, 0, 1, 1, 2}));
  EXPECT_EQ(p.num_buckets, 3);
  EXPECT_EQ(p.bucket_start, (std::vector<int64_t>{0, 24, 60, 64, -7, -7}));
  EXPECT_EQ(p.total, 64);
}

// Properties of any plan: aligned, disjoint, in (reverse) order, buckets at tensor boundaries,
// every bucket but the last closed only once it reached bucket_numel, total = Σ padded sizes.
void CheckPlanProperties(const std::vector<int64_t>& numels, const ga_arena_plan_options& o) {
  Plan p;
  ASSERT_EQ(RunPlan(numels, &o, &p), kGaOk) << ga_last_error();
  const int64_t n = static_cast<int64_t>(numels.size());
  const int64_t a = o.alignment;
  std::vector<int64_t> order;
  for (int64_t k = 0; k < n; ++k) order.push_back(o.reverse ? n - 1 - k : k);
  int64_t pos = 0;
  for (int64_t k = 0; k < n; ++k) {
    const int64_t i = order[k];
    EXPECT_EQ(p.offsets[i] % a, 0) << "tensor " << i;
    EXPECT_EQ(p.offsets[i], pos) << "tensor " << i << " is not right after its predecessor";
    pos += (numels[i] + a - 1) / a * a;
    const int64_t b = p.bucket_of[i];
    ASSERT_GE(b, 0);
    ASSERT_LT(b, p.num_buckets);
    EXPECT_GE(p.offsets[i], p.bucket_start[b]);
    EXPECT_LE(p.offsets[i] + numels[i], p.bucket_start[b + 1])
        << "tensor " << i << " crosses a bucket boundary";
    if (k > 0) {
      const int64_t prev_b = p.bucket_of[order[k - 1]];
      EXPECT_TRUE(b == prev_b || b == prev_b + 1);
      if (b == prev_b + 1) EXPECT_EQ(p.bucket_start[b], p.offsets[i]);
    }
  }
  EXPECT_EQ(p.total, pos);
  EXPECT_EQ(p.total % a, 0);
  if (n == 0)
    EXPECT_EQ(p.num_buckets, 0);
  else
    EXPECT_GE(p.num_buckets, 1);
  EXPECT_EQ(p.bucket_start[0], 0);
  EXPECT_EQ(p.bucket_start[p.num_buckets], p.total);
  for (int64_t b = 0; b < p.num_buckets; ++b) {
    const int64_t size = p.bucket_start[b + 1] - p.bucket_start[b];
    if (b + 1 < p.num_buckets) {
      EXPECT_GE(size, o.bucket_numel) << "bucket " << b << " closed early";
      // It closed at the first tensor that brought it to bucket_numel.
      int64_t last_start = -1;
      for (int64_t i = 0; i < n; ++i)
        if (p.bucket_of[i] == b && numels[i] > 0) last_start = std::max(last_start, p.offsets[i]);
      if (last_start >= 0) {
        EXPECT_LT(last_start - p.bucket_start[b], o.bucket_numel)
            << "bucket " << b << " closed late";
      }
    }
  }
}

TEST(ArenaPlan, PropertiesOverOddSizes) {
  for (int reverse : {0, 1}) {
    for (int64_t align : {1, 2, 16, 64}) {
      for (int64_t bucket : {1, 17, 16384, 50000, 1000000}) {
        SCOPED_TRACE(testing::Message()
                     << "reverse " << reverse << " align " << align << " bucket " << bucket);
        CheckPlanProperties(OddSizes(), ga_arena_plan_options{align, bucket, reverse});
        CheckPlanProperties({100003, 0, 0, 3}, ga_arena_plan_options{align, bucket, reverse});
      }
    }
  }
}

TEST(ArenaPlan, OneBucketWhenLarge) {
  ga_arena_plan_options o{16, int64_t{1} << 40, 1};
  Plan p;
  ASSERT_EQ(RunPlan(OddSizes(), &o, &p), kGaOk);
  EXPECT_EQ(p.num_buckets, 1);
  for (int64_t b : p.bucket_of) EXPECT_EQ(b, 0);
  // Padded: 0 + 16 + 16 + 32 + 16384 + 16384 + 16400 + 100016.
  EXPECT_EQ(p.total, 0 + 16 + 16 + 32 + 16384 + 16384 + 16400 + 100016);
  // Reverse: the last tensor starts the arena.
  EXPECT_EQ(p.offsets.back(), 0);
  EXPECT_EQ(p.offsets[0], p.total);  // the empty first tensor sits at the end
}

TEST(ArenaPlan, EmptyList) {
  ga_arena_plan_options o{16, 100, 1};
  int64_t bucket_start[1] = {-7}, num_buckets = -7, total = -7;
  ASSERT_EQ(ga_arena_plan(nullptr, 0, &o, nullptr, nullptr, bucket_start, &num_buckets, &total),
            kGaOk);
  EXPECT_EQ(num_buckets, 0);
  EXPECT_EQ(total, 0);
  EXPECT_EQ(bucket_start[0], 0);
}

TEST(ArenaPlan, BadInputWritesNothing) {
  const std::vector<int64_t> good{5, 16, 3};
  struct Case {
    std::vector<int64_t> numels;
    ga_arena_plan_options o;
    bool null_options;
    const char* argument;
  };
  const std::vector<Case> cases{
      {good, {16, 32, 1}, true, "options"},           {good, {0, 32, 1}, false, "alignment"},
      {good, {3, 32, 1}, false, "alignment"},         {good, {-16, 32, 1}, false, "alignment"},
      {good, {16, 0, 1}, false, "bucket_numel"},      {good, {16, -5, 1}, false, "bucket_numel"},
      {{5, 16, -1}, {16, 32, 1}, false, "numels[2]"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.argument);
    Plan p;
    EXPECT_TRUE(FailsWith(RunPlan(c.numels, c.null_options ? nullptr : &c.o, &p),
                          kGaInvalidArgument, {c.argument}));
    for (int64_t v : p.offsets) EXPECT_EQ(v, -7);
    for (int64_t v : p.bucket_of) EXPECT_EQ(v, -7);
    for (int64_t v : p.bucket_start) EXPECT_EQ(v, -7);
    EXPECT_EQ(p.num_buckets, -7);
    EXPECT_EQ(p.total, -7);
  }
  // Negative count and missing output arrays.
  ga_arena_plan_options o{16, 32, 1};
  int64_t offsets[3], bucket_of[3], bucket_start[4] = {-7, -7, -7, -7}, nb = -7, total = -7;
  EXPECT_TRUE(
      FailsWith(ga_arena_plan(good.data(), -1, &o, offsets, bucket_of, bucket_start, &nb, &total),
                kGaInvalidArgument, {"numels"}));
  EXPECT_TRUE(
      FailsWith(ga_arena_plan(nullptr, 3, &o, offsets, bucket_of, bucket_start, &nb, &total),
                kGaInvalidArgument, {"numels"}));
  EXPECT_TRUE(
      FailsWith(ga_arena_plan(good.data(), 3, &o, offsets, nullptr, bucket_start, &nb, &total),
                kGaInvalidArgument, {"numels", "bucket_of"}));
  EXPECT_TRUE(FailsWith(ga_arena_plan(good.data(), 3, &o, offsets, bucket_of, nullptr, &nb, &total),
                        kGaInvalidArgument, {"bucket_start"}));
  EXPECT_TRUE(
      FailsWith(ga_arena_plan(good.data(), 3, &o, offsets, bucket_of, bucket_start, &nb, nullptr),
                kGaInvalidArgument, {"bucket_start", "total_numel"}));
  EXPECT_EQ(bucket_start[0], -7);
  EXPECT_EQ(nb, -7);
  EXPECT_EQ(total, -7);
}

TEST(Zero, EveryDtypeOddSizesUnaligned) {
  auto rng = Rng(1);
  for (ga_dtype d : {kGaFloat32, kGaBFloat16, kGaFloat16, kGaFloat64}) {
    SCOPED_TRACE(DtypeName(d));
    TensorList l(d, OddSizes());
    l.FillUniform(rng, 0.5, 2.0);  // no element is zero before the call
    ASSERT_NE(l[7].Get(100002), 0.0);
    ASSERT_EQ(ga_zero(l.list()), kGaOk) << ga_last_error();
    for (size_t i = 0; i < l.size(); ++i) {
      for (uint8_t b : l[i].DataBytes()) ASSERT_EQ(b, 0) << "tensor " << i;
    }
    EXPECT_TRUE(l.GuardsIntact());
  }
}

TEST(Zero, EmptyListAndEmptyTensors) {
  EXPECT_EQ(ga_zero(ga_tensor_list{nullptr, 0}), kGaOk);
  ga_tensor empty{nullptr, 0, kGaFloat32, kGaCPU, 0};
  EXPECT_EQ(ga_zero(ga_tensor_list{&empty, 1}), kGaOk);
}

TEST(Zero, BadInputWritesNothing) {
  auto rng = Rng(2);
  TensorList l({kGaFloat32, kGaBFloat16, kGaFloat64}, {10, 20, 30});
  l.FillUniform(rng, 1.0, 2.0);
  const std::vector<uint8_t> before = Snapshot(l);
  auto expect_fail = [&](ga_tensor_list list, ga_status status,
                         std::initializer_list<std::string> args) {
    EXPECT_TRUE(FailsWith(ga_zero(list), status, args));
    EXPECT_EQ(Snapshot(l), before);
    l.Rebuild();
  };
  l.desc(1).numel = -1;
  expect_fail(l.list(), kGaInvalidArgument, {"tensors[1]"});
  SetRaw(l.desc(2).dtype, 9);
  expect_fail(l.list(), kGaTypeError, {"tensors[2]"});
  l.desc(2).data = nullptr;
  expect_fail(l.list(), kGaInvalidArgument, {"tensors[2]"});
  l.desc(0).data = static_cast<uint8_t*>(l[0].data()) + 1;  // misaligned fp32
  expect_fail(l.list(), kGaInvalidArgument, {"tensors[0]"});
  // tensors[2] overlaps tensors[0] (the same memory viewed twice).
  l.desc(2) = ga_tensor{l[0].at(3), 5, kGaFloat32, kGaCPU, 0};
  expect_fail(l.list(), kGaInvalidArgument, {"tensors[0]", "tensors[2]"});
  expect_fail(ga_tensor_list{nullptr, 2}, kGaInvalidArgument, {"tensors"});
  expect_fail(ga_tensor_list{l.list().tensors, -1}, kGaInvalidArgument, {"tensors"});
  if (!ga_has_cuda()) {
    l.desc(1).device_type = kGaCUDA;
    expect_fail(l.list(), kGaUnsupported, {"tensors[1]"});
  }
  SetRaw(l.desc(1).device_type, 5);
  expect_fail(l.list(), kGaTypeError, {"tensors[1]"});
}

}  // namespace
}  // namespace ga_test
