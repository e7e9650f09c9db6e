// The CUDA op pipelines (csrc/cuda/ops.h) run on the host: HostBackend executes every launch the
// pipelines make block by block and thread by thread, with the device's reduction orders, on host
// memory whose descriptors say "CUDA". Results are compared with the CPU core (itself checked
// against fp64 references in the other suites) and with fp64 references directly.
//
// What this cannot see: the __global__ wrappers, shared memory and warp shuffles, and the CUDA
// runtime calls of launch.cuh and backend.cu. The GPU tests (tests/test_cuda.py) cover those on a
// GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <vector>

#include "../cuda/ops.h"
#include "test_util.h"

namespace {

using namespace ga_test;
namespace gc = ga::cuda;

/// Runs the pipelines' launches on the host. `grid` caps the blocks of chunked launches, so the
/// grid-stride loops run with several chunks per block.
class HostBackend {
 public:
  explicit HostBackend(int grid = 3) : grid_(grid) {}

  int max_blocks() const { return grid_; }
  int launches() const { return launches_; }

  char* workspace(size_t bytes) {
    // Garbage, not zeros: the device workspace is reused memory.
    void* p = std::aligned_alloc(256, (bytes + 255) / 256 * 256 + 256);
    std::memset(p, 0x7f, (bytes + 255) / 256 * 256 + 256);
    buffers_.emplace_back(static_cast<char*>(p));
    return static_cast<char*>(p);
  }

  void zero_bytes(void* p, size_t bytes) { std::memset(p, 0, bytes); }

  template <bool Reduce, int L, typename Op>
  void chunks(const gc::Meta<L>& m, const Op& op, int64_t num_chunks, double* partials,
              float* flag) {
    ++launches_;
    const int64_t blocks = std::min<int64_t>(num_chunks, grid_);
    std::vector<gc::ThreadState> st(gc::kThreads);
    std::vector<double> v(gc::kThreads);
    for (int64_t b = 0; b < blocks; ++b) {
      for (gc::ThreadState& s : st) s = gc::ThreadState{};
      for (int64_t c = b; c < num_chunks; c += blocks) {
        for (int tid = 0; tid < gc::kThreads; ++tid)
          v[tid] = gc::chunk_thread(m, op, c, tid, gc::kThreads, st[tid]);
        if (Reduce) {
          const int t = gc::tensor_of(m, c);
          partials[m.out_base[t] + (c - m.start[t])] = gc::host_block_tree(v.data());
        }
      }
      for (const gc::ThreadState& s : st)
        if (flag != nullptr && s.bad) *flag = 1.0f;
    }
  }

  template <typename T0, typename T1, int L>
  void unit_sums(const gc::Meta<L>& m, int64_t num_tasks, double* out0, double* out1) {
    ++launches_;
    double s0[gc::kWarp], s1[gc::kWarp];
    int out[gc::kWarp];
    for (int64_t task = 0; task < num_tasks; ++task) {
      for (int lane = 0; lane < gc::kWarp; ++lane)
        gc::unit_task_lane<L, T0, T1>(m, task, lane, s0[lane], s1[lane], out[lane]);
      const int t = gc::tensor_of(m, task);
      if ((m.trailing >> t) & 1u) {
        for (int lane = 0; lane < gc::kWarp; ++lane) {
          if (out[lane] < 0) continue;
          out0[out[lane]] = s0[lane];
          if (L > 1) out1[out[lane]] = s1[lane];
        }
      } else {
        const int u = out[0];
        out0[u] = gc::host_warp_tree(s0);
        if (L > 1) out1[u] = gc::host_warp_tree(s1);
      }
    }
  }

  template <typename F>
  void for_each(int64_t n, const F& f) {
    ++launches_;
    for (int64_t i = 0; i < n; ++i) f(i);
  }

  template <typename Post>
  void sum_partials(const double* p, int64_t n, const Post& post) {
    ++launches_;
    std::vector<double> v(gc::kThreads, 0.0);
    for (int tid = 0; tid < gc::kThreads; ++tid)
      for (int64_t j = tid; j < n; j += gc::kThreads) v[tid] += p[j];
    post(gc::host_block_tree(v.data()));
  }

 private:
  struct Free {
    void operator()(char* p) const { std::free(p); }
  };
  int grid_;
  int launches_ = 0;
  std::vector<std::unique_ptr<char, Free>> buffers_;
};

/// A "device" copy of a list: same dtypes, sizes and alignment offset, same values, descriptors
/// marked CUDA (device 0).
TensorList DeviceCopy(const TensorList& src, int64_t offset) {
  std::vector<ga_dtype> dtypes;
  std::vector<int64_t> sizes;
  for (size_t i = 0; i < src.size(); ++i) {
    dtypes.push_back(src[i].dtype());
    sizes.push_back(src[i].numel());
  }
  TensorList out(dtypes, sizes, offset);
  for (size_t i = 0; i < src.size(); ++i) {
    out[i].SetValues(src[i].Values());
    out.desc(i).device_type = kGaCUDA;
  }
  return out;
}

TestTensor DeviceScalar(ga_dtype dtype, double v) {
  TestTensor t(dtype, 1, 0);
  t.Set(0, v);
  return t;
}

// Element-wise closeness: |got − want| ≤ compute·(|want| + floor) + the storage rounding. The
// floor covers values that cancel (a clip coefficient summed in another order moves an Adam
// moment by one fp32 rounding of the gradient, not of the moment).
void ExpectListsNear(const TensorList& got, const TensorList& want, double compute,
                     double floor = 0.0) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    std::vector<double> w = want[i].Values(), mag(w.size());
    for (size_t j = 0; j < w.size(); ++j) mag[j] = std::fabs(w[j]) + floor;
    EXPECT_TRUE(Near(got[i].Values(), w, mag, compute, got[i].dtype())) << "tensor " << i;
  }
  EXPECT_TRUE(got.GuardsIntact());
}

// Sizes around every boundary of the kernels: vector width 8, chunk 16384, empty tensors.
const std::vector<int64_t> kSizes = {0, 1, 7, 8, 9, 255, 2048, 16383, 16384, 16385, 40000, 3};

std::vector<ga_dtype> Cycle(std::initializer_list<ga_dtype> ds, size_t n) {
  std::vector<ga_dtype> out;
  for (size_t i = 0; i < n; ++i) out.push_back(*(ds.begin() + i % ds.size()));
  return out;
}

class CudaEmulatedOffset : public ::testing::TestWithParam<int64_t> {};

TEST_P(CudaEmulatedOffset, AccumulateMatchesCpuAndFp64) {
  const int64_t off = GetParam();
  auto rng = Rng(1);
  const auto gd = Cycle({kGaFloat32, kGaBFloat16, kGaFloat16}, kSizes.size());
  TensorList acc_cpu(kGaFloat32, kSizes, off), g1(gd, kSizes, off), g2(gd, kSizes, off);
  g1.FillUniform(rng, -2, 2);
  g2.FillUniform(rng, -2, 2);
  TensorList acc_dev = DeviceCopy(acc_cpu, off), g1_dev = DeviceCopy(g1, off),
             g2_dev = DeviceCopy(g2, off);
  HostBackend b;
  TestTensor flag = DeviceScalar(kGaFloat32, 0.0), sumsq(kGaFloat64, 1, 0);
  ga_accumulate_options first{kGaAccumulateSum, 0.75, 0.0, 1};
  ga_accumulate_options next{kGaAccumulateSum, 1.5, 0.0, 0};
  ASSERT_EQ(ga_accumulate(acc_cpu.list(), g1.list(), &first, 0, nullptr), kGaOk);
  ASSERT_EQ(gc::accumulate(b, acc_dev.list(), g1_dev.list(), &first,
                           static_cast<float*>(flag.data()), nullptr),
            kGaOk);
  ga_accumulate_result r{};
  ASSERT_EQ(ga_accumulate(acc_cpu.list(), g2.list(), &next, 1, &r), kGaOk);
  ASSERT_EQ(gc::accumulate(b, acc_dev.list(), g2_dev.list(), &next,
                           static_cast<float*>(flag.data()), static_cast<double*>(sumsq.data())),
            kGaOk);
  ExpectListsNear(acc_dev, acc_cpu, 1e-7);
  // fp64 reference of 0.75·g1 + 1.5·g2 and of its sum of squares.
  double ref_sumsq = 0.0;
  for (size_t i = 0; i < kSizes.size(); ++i) {
    std::vector<double> want(kSizes[i]), mag(kSizes[i]);
    for (int64_t j = 0; j < kSizes[i]; ++j) {
      want[j] = 0.75 * g1[i].Get(j) + 1.5 * g2[i].Get(j);
      mag[j] = std::fabs(0.75 * g1[i].Get(j)) + std::fabs(1.5 * g2[i].Get(j));
    }
    // Two fp32 roundings (0.75·g1, then the fused add) relative to the terms' magnitude.
    EXPECT_TRUE(Near(acc_dev[i].Values(), want, mag, 2e-7, kGaFloat32)) << "tensor " << i;
    for (double v : acc_dev[i].Values()) ref_sumsq += v * v;
  }
  EXPECT_TRUE(NearScalar(sumsq.Get(0), ref_sumsq, 1e-12));
  EXPECT_TRUE(NearScalar(sumsq.Get(0), r.sumsq, 1e-12));
  EXPECT_EQ(flag.Get(0), 0.0);
}

TEST_P(CudaEmulatedOffset, RunningMeanMatchesCpu) {
  const int64_t off = GetParam();
  auto rng = Rng(2);
  TensorList acc_cpu(kGaFloat32, kSizes, off), g(kGaBFloat16, kSizes, off);
  acc_cpu.FillUniform(rng, -1, 1);
  g.FillUniform(rng, -3, 3);
  TensorList acc_dev = DeviceCopy(acc_cpu, off), g_dev = DeviceCopy(g, off);
  HostBackend b;
  ga_accumulate_options o{kGaAccumulateRunningMean, 2.0, 6.0, 0};
  ASSERT_EQ(ga_accumulate(acc_cpu.list(), g.list(), &o, 0, nullptr), kGaOk);
  ASSERT_EQ(gc::accumulate(b, acc_dev.list(), g_dev.list(), &o, nullptr, nullptr), kGaOk);
  ExpectListsNear(acc_dev, acc_cpu, 1e-7);
}

INSTANTIATE_TEST_SUITE_P(AlignedAndNot, CudaEmulatedOffset, ::testing::Values(0, 1, 3));

// ---- 16-byte vectors from the first aligned element: a scalar head, vectors, a scalar tail ----

TEST(CudaEmulated, VecHeadIsTheFirstElementWhereEveryListIsAligned) {
  alignas(64) static char buf[256];
  const int f32 = 4, h16 = 2;
  auto head = [](std::initializer_list<const void*> p, std::initializer_list<int> size) {
    return gc::vec_head(p.begin(), size.begin(), static_cast<int>(p.size()));
  };
  EXPECT_EQ(head({buf}, {f32}), 0);
  EXPECT_EQ(head({buf + 4}, {f32}), 3);       // fp32 one element in: 3 more to 16 bytes
  EXPECT_EQ(head({buf + 64 + 2}, {h16}), 7);  // bf16 one element in: 7 more
  EXPECT_EQ(head({buf + 4, buf + 64 + 2}, {f32, h16}), 7);   // both one element in
  EXPECT_EQ(head({buf + 12, buf + 64 + 6}, {f32, h16}), 5);  // both three elements in
  EXPECT_EQ(head({buf + 4, buf + 64}, {f32, h16}), -1);      // misalignments that disagree
  EXPECT_EQ(head({buf + 8, buf + 64 + 4}, {f32, h16}), 6);
  EXPECT_EQ(head({nullptr, buf + 64 + 4}, {f32, h16}), 6);  // a list the launch does not use
  EXPECT_EQ(head({buf + 2}, {f32}), -1);  // not even element-aligned: scalar accesses only
}

TEST(CudaEmulated, AccumulateWithDisagreeingAlignmentsMatchesCpu) {
  // Accumulators one fp32 element into their allocation, gradients at 0, 1 and 3 bf16/fp16/fp32
  // elements: no common aligned start (scalar path) or one at 7, 5, 3 (head + vectors + tail).
  for (int64_t goff : {0, 1, 2, 3}) {
    SCOPED_TRACE(goff);
    auto rng = Rng(20 + goff);
    const auto gd = Cycle({kGaBFloat16, kGaFloat32, kGaFloat16}, kSizes.size());
    TensorList acc_cpu(kGaFloat32, kSizes, 1), g(gd, kSizes, goff);
    acc_cpu.FillUniform(rng, -1, 1);
    g.FillUniform(rng, -2, 2);
    TensorList acc_dev = DeviceCopy(acc_cpu, 1), g_dev = DeviceCopy(g, goff);
    HostBackend b;
    TestTensor sumsq(kGaFloat64, 1, 0);
    ga_accumulate_options o{kGaAccumulateSum, 1.25, 0.0, 0};
    ga_accumulate_result r{};
    ASSERT_EQ(ga_accumulate(acc_cpu.list(), g.list(), &o, 1, &r), kGaOk);
    ASSERT_EQ(gc::accumulate(b, acc_dev.list(), g_dev.list(), &o, nullptr,
                             static_cast<double*>(sumsq.data())),
              kGaOk);
    ExpectListsNear(acc_dev, acc_cpu, 1e-7);
    EXPECT_TRUE(NearScalar(sumsq.Get(0), r.sumsq, 1e-12));
  }
}

TEST(CudaEmulated, AccumulateFlagsNonFiniteAndKeepsTheFlagSet) {
  TensorList acc(kGaFloat32, {100, 40000}, 0), g(kGaFloat16, {100, 40000}, 0);
  acc = DeviceCopy(acc, 0);
  g = DeviceCopy(g, 0);
  HostBackend b;
  TestTensor flag = DeviceScalar(kGaFloat32, 0.0);
  ga_accumulate_options o{kGaAccumulateSum, 1.0, 0.0, 1};
  ASSERT_EQ(gc::accumulate(b, acc.list(), g.list(), &o, static_cast<float*>(flag.data()), nullptr),
            kGaOk);
  EXPECT_EQ(flag.Get(0), 0.0);
  g[1].Set(39999, std::numeric_limits<double>::infinity());
  ASSERT_EQ(gc::accumulate(b, acc.list(), g.list(), &o, static_cast<float*>(flag.data()), nullptr),
            kGaOk);
  EXPECT_EQ(flag.Get(0), 1.0);
  g[1].Set(39999, 0.0);
  ASSERT_EQ(gc::accumulate(b, acc.list(), g.list(), &o, static_cast<float*>(flag.data()), nullptr),
            kGaOk);
  EXPECT_EQ(flag.Get(0), 1.0) << "a later finite micro-batch must not clear the cycle's flag";
}

TEST(CudaEmulated, ManyTensorsSplitIntoLaunchesAndSumsAreDeterministic) {
  // 130 tensors of mixed dtypes: several launches of at most kMaxTensors each.
  std::vector<int64_t> sizes;
  for (int i = 0; i < 130; ++i) sizes.push_back(1 + (i * 977) % 5000);
  const auto dt = Cycle({kGaFloat32, kGaBFloat16, kGaFloat16, kGaFloat32}, sizes.size());
  auto rng = Rng(3);
  TensorList x(dt, sizes, 0);
  x.FillUniform(rng, -4, 4);
  TensorList xd = DeviceCopy(x, 0);
  double want = 0.0;
  for (size_t i = 0; i < x.size(); ++i)
    for (double v : x[i].Values()) want += v * v;
  std::vector<double> got;
  for (int grid : {1, 2, 5, 64}) {
    HostBackend b(grid);
    TestTensor s(kGaFloat64, 1, 0);
    ASSERT_EQ(gc::sum_of_squares(b, xd.list(), static_cast<double*>(s.data())), kGaOk);
    EXPECT_GE(b.launches(), 4);  // ≥ 3 chunk launches (130 / 48) + the final sum
    got.push_back(s.Get(0));
  }
  EXPECT_TRUE(NearScalar(got[0], want, 1e-12));
  for (double g : got) EXPECT_EQ(g, got[0]) << "the sum must not depend on the grid size";
}

TEST(CudaEmulated, SumOfSquaresOfNothingIsZero) {
  TensorList x(kGaFloat32, {0, 0}, 0);
  x = DeviceCopy(x, 0);
  HostBackend b;
  TestTensor s = DeviceScalar(kGaFloat64, 123.0);
  ASSERT_EQ(gc::sum_of_squares(b, x.list(), static_cast<double*>(s.data())), kGaOk);
  EXPECT_EQ(s.Get(0), 0.0);
}

struct UnitCase {
  int64_t units, fan_in;
  ga_unit_layout layout;
  ga_dtype dtype;
  int64_t offset;
};

class CudaEmulatedUnits : public ::testing::TestWithParam<UnitCase> {};

TEST_P(CudaEmulatedUnits, UnitwiseNormMatchesCpu) {
  const UnitCase c = GetParam();
  auto rng = Rng(4);
  TestTensor x(c.dtype, c.units * c.fan_in, c.offset);
  x.FillUniform(rng, -2, 2);
  TensorList xl({c.dtype}, {c.units * c.fan_in}, c.offset);
  xl[0].SetValues(x.Values());
  TensorList xd = DeviceCopy(xl, c.offset);
  TestTensor n_cpu(kGaFloat64, c.units, 0), n_dev(kGaFloat64, c.units, 0);
  ga_tensor nd = n_dev.desc();
  nd.device_type = kGaCUDA;
  const ga_units u{c.units, c.layout};
  ASSERT_EQ(ga_unitwise_norm(x.desc(), u, n_cpu.desc()), kGaOk);
  HostBackend b;
  ASSERT_EQ(gc::unitwise_norm(b, xd.desc(0), u, nd), kGaOk);
  EXPECT_TRUE(Near(n_dev.Values(), n_cpu.Values(), 1e-13, kGaFloat64));
}

INSTANTIATE_TEST_SUITE_P(Layouts, CudaEmulatedUnits,
                         ::testing::Values(UnitCase{64, 72, kGaUnitsLeading, kGaFloat32, 0},
                                           UnitCase{64, 72, kGaUnitsLeading, kGaFloat32, 1},
                                           UnitCase{33, 7, kGaUnitsLeading, kGaBFloat16, 0},
                                           UnitCase{5, 3000, kGaUnitsLeading, kGaFloat16, 0},
                                           UnitCase{1, 20000, kGaUnitsLeading, kGaFloat32, 0},
                                           UnitCase{70, 9, kGaUnitsTrailing, kGaFloat32, 0},
                                           UnitCase{33, 16, kGaUnitsTrailing, kGaBFloat16, 1},
                                           UnitCase{1, 100, kGaUnitsTrailing, kGaFloat32, 0}));

// ---- apply: every optimizer, dtype, clip mode and skip rule against the CPU core ----

struct ApplyCase {
  const char* name;
  ga_optimizer opt;
  ga_dtype param;
  ga_dtype state;
  ga_clip_mode clip;
  bool momentum_initialized;
};

class CudaEmulatedApply : public ::testing::TestWithParam<ApplyCase> {};

TEST_P(CudaEmulatedApply, MatchesCpu) {
  const ApplyCase c = GetParam();
  for (int64_t off : {0, 1}) {
    SCOPED_TRACE(off);
    auto rng = Rng(5);
    const std::vector<int64_t> sizes = {72 * 64, 9, 16385, 0, 3 * 1000, 40000};
    TensorList p(c.param, sizes, off), a(kGaFloat32, sizes, off), s1(c.state, sizes, off),
        s2(c.state, sizes, off);
    p.FillUniform(rng, -1, 1);
    a.FillUniform(rng, -3, 3);
    s1.FillUniform(rng, -0.1, 0.1);
    s2.FillUniform(rng, 0, 0.01);
    TensorList pd = DeviceCopy(p, off), ad = DeviceCopy(a, off), s1d = DeviceCopy(s1, off),
               s2d = DeviceCopy(s2, off);
    std::vector<ga_units> units = {{64, kGaUnitsLeading},  {1, kGaUnitsLeading},
                                   {29, kGaUnitsTrailing}, {1, kGaUnitsLeading},
                                   {3, kGaUnitsLeading},   {40000, kGaUnitsTrailing}};
    // Make the trailing tensor of 16385 divisible: 16385 = 5 · 29 · 113.
    units[2].num_units = 29;
    ga_apply_options o{};
    o.grad_scale = 0.25;
    o.clip = c.clip;
    o.max_norm = 5.0;
    o.clip_factor = 0.05;
    o.agc_eps = 1e-3;
    o.units = units.data();
    o.reset = 1;
    o.optimizer = c.opt;
    o.lr = 0.1;
    o.weight_decay = 0.01;
    o.momentum = 0.9;
    o.dampening = 0.1;
    o.momentum_initialized = c.momentum_initialized;
    o.beta1 = 0.9;
    o.beta2 = 0.999;
    o.adam_eps = 1e-8;
    o.step = 3;
    const bool uses_s1 = c.opt != kGaOptimizerNone;
    const bool uses_s2 = c.opt == kGaOptimizerAdam || c.opt == kGaOptimizerAdamW;
    const ga_tensor_list none{nullptr, 0};
    TensorList out(kGaBFloat16, sizes, off);
    TensorList outd = DeviceCopy(out, off);
    ga_apply_tensors tc{p.list(), a.list(), uses_s1 ? s1.list() : none, uses_s2 ? s2.list() : none,
                        c.opt == kGaOptimizerNone ? out.list() : none};
    ga_apply_tensors td{pd.list(), ad.list(), uses_s1 ? s1d.list() : none,
                        uses_s2 ? s2d.list() : none,
                        c.opt == kGaOptimizerNone ? outd.list() : none};
    ga_apply_result r{};
    ASSERT_EQ(ga_apply(&tc, &o, &r), kGaOk) << ga_last_error();
    HostBackend b;
    TestTensor stats(kGaFloat32, 3, 0);
    ASSERT_EQ(gc::apply(b, &td, &o, nullptr, static_cast<ga_cuda_apply_stats*>(stats.data()),
                        "accumulators", "params"),
              kGaOk)
        << ga_last_error();
    // Gradients here are O(0.1-1): a one-rounding difference in the clip coefficient (summed
    // in another order than the CPU's) moves a result by ~1e-8 absolute.
    ExpectListsNear(pd, p, 2e-6, 1e-2);
    ExpectListsNear(ad, a, 0);
    if (uses_s1) ExpectListsNear(s1d, s1, 2e-6, 1e-2);
    if (uses_s2) ExpectListsNear(s2d, s2, 2e-6, 1e-2);
    if (c.opt == kGaOptimizerNone) ExpectListsNear(outd, out, 2e-6, 1e-2);
    EXPECT_EQ(stats.Get(2), 0.0);
    if (c.clip == kGaClipGlobalNorm) {
      EXPECT_TRUE(NearScalar(stats.Get(0), r.grad_norm, 1e-6));
      EXPECT_TRUE(NearScalar(stats.Get(1), r.clip_coef, 1e-6));
      EXPECT_LT(r.clip_coef, 1.0) << "the case must actually clip";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Optimizers, CudaEmulatedApply,
    ::testing::Values(
        ApplyCase{"SgdMomentum", kGaOptimizerSGD, kGaFloat32, kGaFloat32, kGaClipNone, true},
        ApplyCase{"SgdFirstStep", kGaOptimizerSGD, kGaFloat32, kGaFloat32, kGaClipGlobalNorm,
                  false},
        ApplyCase{"SgdBf16", kGaOptimizerSGD, kGaBFloat16, kGaBFloat16, kGaClipAgc, true},
        ApplyCase{"Adam", kGaOptimizerAdam, kGaFloat32, kGaFloat32, kGaClipGlobalNorm, true},
        ApplyCase{"AdamWBf16Fp32State", kGaOptimizerAdamW, kGaBFloat16, kGaFloat32, kGaClipNone,
                  true},
        ApplyCase{"AdamWFp16Agc", kGaOptimizerAdamW, kGaFloat16, kGaFloat16, kGaClipAgc, true},
        ApplyCase{"AdamWFp32Agc", kGaOptimizerAdamW, kGaFloat32, kGaFloat32, kGaClipAgc, true},
        ApplyCase{"NoneAgc", kGaOptimizerNone, kGaFloat32, kGaFloat32, kGaClipAgc, true},
        ApplyCase{"NoneClip", kGaOptimizerNone, kGaFloat32, kGaFloat32, kGaClipGlobalNorm, true}),
    [](const ::testing::TestParamInfo<ApplyCase>& i) { return std::string(i.param.name); });

TEST(CudaEmulated, ApplyAgcOverManyLaunchesAndDtypesMatchesCpu) {
  // 110 tensors, three parameter dtypes, leading and trailing units: several launches per dtype
  // group, each with its own unit offsets into the call's unit arrays.
  auto rng = Rng(14);
  std::vector<int64_t> sizes;
  std::vector<ga_units> units;
  std::vector<ga_dtype> pdt;
  for (int i = 0; i < 110; ++i) {
    const int64_t nu = 1 + (i * 7) % 40, fan = 1 + (i * 13) % 300;
    sizes.push_back(nu * fan);
    units.push_back({nu, i % 3 == 0 ? kGaUnitsTrailing : kGaUnitsLeading});
    pdt.push_back(i % 5 == 0 ? kGaBFloat16 : (i % 5 == 1 ? kGaFloat16 : kGaFloat32));
  }
  TensorList p(pdt, sizes, 0), a(kGaFloat32, sizes, 0), m(kGaFloat32, sizes, 0),
      v(kGaFloat32, sizes, 0);
  p.FillUniform(rng, -1, 1);
  a.FillUniform(rng, -5, 5);
  TensorList pd = DeviceCopy(p, 0), ad = DeviceCopy(a, 0), md = DeviceCopy(m, 0),
             vd = DeviceCopy(v, 0);
  ga_apply_options o{};
  o.grad_scale = 0.5;
  o.clip = kGaClipAgc;
  o.clip_factor = 0.02;
  o.agc_eps = 1e-3;
  o.units = units.data();
  o.optimizer = kGaOptimizerAdamW;
  o.lr = 1e-2;
  o.weight_decay = 0.1;
  o.beta1 = 0.9;
  o.beta2 = 0.999;
  o.adam_eps = 1e-8;
  o.step = 1;
  o.reset = 1;
  ga_apply_tensors tc{p.list(), a.list(), m.list(), v.list(), {nullptr, 0}};
  ga_apply_tensors td{pd.list(), ad.list(), md.list(), vd.list(), {nullptr, 0}};
  ASSERT_EQ(ga_apply(&tc, &o, nullptr), kGaOk) << ga_last_error();
  HostBackend b(4);
  ASSERT_EQ(gc::apply(b, &td, &o, nullptr, nullptr, "accumulators", "params"), kGaOk)
      << ga_last_error();
  ExpectListsNear(pd, p, 2e-6, 1e-2);
  ExpectListsNear(md, m, 2e-6, 1e-2);
  ExpectListsNear(vd, v, 2e-6, 1e-2);
}

TEST(CudaEmulated, ApplyFp64AdamWReference) {
  // One AdamW step from known state, checked against fp64 arithmetic directly.
  auto rng = Rng(6);
  TensorList p(kGaFloat32, {1000}, 0), a(kGaFloat32, {1000}, 0), m(kGaFloat32, {1000}, 0),
      v(kGaFloat32, {1000}, 0);
  p.FillUniform(rng, -1, 1);
  a.FillUniform(rng, -2, 2);
  m.FillUniform(rng, -0.1, 0.1);
  v.FillUniform(rng, 0, 0.01);
  const auto p0 = p[0].Values(), a0 = a[0].Values(), m0 = m[0].Values(), v0 = v[0].Values();
  TensorList pd = DeviceCopy(p, 0), ad = DeviceCopy(a, 0), md = DeviceCopy(m, 0),
             vd = DeviceCopy(v, 0);
  ga_apply_options o{};
  o.grad_scale = 0.5;
  o.optimizer = kGaOptimizerAdamW;
  o.lr = 1e-2;
  o.weight_decay = 0.1;
  o.beta1 = 0.9;
  o.beta2 = 0.99;
  o.adam_eps = 1e-8;
  o.step = 2;
  ga_apply_tensors t{pd.list(), ad.list(), md.list(), vd.list(), {nullptr, 0}};
  HostBackend b;
  ASSERT_EQ(gc::apply(b, &t, &o, nullptr, nullptr, "accumulators", "params"), kGaOk);
  std::vector<double> want(1000);
  for (int i = 0; i < 1000; ++i) {
    const double g = a0[i] * 0.5;
    const double mm = 0.9 * m0[i] + 0.1 * g, vv = 0.99 * v0[i] + 0.01 * g * g;
    const double mhat = mm / (1 - 0.81), vhat = vv / (1 - 0.99 * 0.99);
    want[i] = p0[i] * (1 - 1e-3) - 1e-2 * mhat / (std::sqrt(vhat) + 1e-8);
  }
  EXPECT_TRUE(Near(pd[0].Values(), want, 1e-5, kGaFloat32));
  EXPECT_EQ(ad[0].Values(), a0);  // reset = 0: the accumulator is left as it was
}

TEST(CudaEmulated, ApplySkipsOnDeviceFlagsAndStillResets) {
  auto rng = Rng(7);
  for (int which = 0; which < 2; ++which) {
    SCOPED_TRACE(which == 0 ? "caller's flag" : "non-finite gradient");
    TensorList p(kGaFloat32, {500, 20000}, 0), a(kGaFloat32, {500, 20000}, 0);
    p.FillUniform(rng, -1, 1);
    a.FillUniform(rng, -1, 1);
    if (which == 1) a[1].Set(12345, std::nan(""));
    TensorList pd = DeviceCopy(p, 0), ad = DeviceCopy(a, 0);
    const auto before = pd.Values();
    TestTensor flag = DeviceScalar(kGaFloat32, which == 0 ? 1.0 : 0.0);
    TestTensor stats(kGaFloat32, 3, 0);
    ga_apply_options o{};
    o.grad_scale = 1.0;
    o.optimizer = kGaOptimizerSGD;
    o.lr = 0.1;
    o.reset = 1;
    o.skip_nonfinite = which == 1;
    ga_apply_tensors t{pd.list(), ad.list(), {nullptr, 0}, {nullptr, 0}, {nullptr, 0}};
    HostBackend b;
    ASSERT_EQ(gc::apply(b, &t, &o, static_cast<const float*>(flag.data()),
                        static_cast<ga_cuda_apply_stats*>(stats.data()), "accumulators", "params"),
              kGaOk);
    EXPECT_EQ(pd.Values(), before);
    for (size_t i = 0; i < ad.size(); ++i)
      for (double x : ad[i].Values()) ASSERT_EQ(x, 0.0);
    EXPECT_EQ(stats.Get(2), 1.0);
    if (which == 1) EXPECT_TRUE(std::isnan(stats.Get(0)));
  }
}

TEST(CudaEmulated, AdamStepCountersOnTheDeviceAdvanceOnlyWhenApplied) {
  // Four boundaries: applied, skipped by the caller's flag, skipped by a non-finite gradient,
  // applied. The device counters must match the host path given steps 4 and 5 bit for bit, and
  // a skipped boundary must leave params, state and counters exactly as they were, with the
  // accumulators reset (the skip policy: the cycle starts over). The empty tensor's counter
  // advances with the others.
  for (ga_optimizer opt : {kGaOptimizerAdam, kGaOptimizerAdamW}) {
    SCOPED_TRACE(opt == kGaOptimizerAdam ? "Adam" : "AdamW");
    auto rng = Rng(21);
    const std::vector<int64_t> sizes = {3, 4099, 0, 256};
    TensorList p(Cycle({kGaFloat32, kGaBFloat16}, sizes.size()), sizes, 1),
        s1(kGaFloat32, sizes, 1), s2(kGaFloat32, sizes, 1);
    p.FillUniform(rng, -1, 1);
    s1.FillUniform(rng, -0.1, 0.1);
    s2.FillUniform(rng, 0.0, 0.01);
    TensorList ph = DeviceCopy(p, 1), s1h = DeviceCopy(s1, 1), s2h = DeviceCopy(s2, 1);
    TensorList pd = DeviceCopy(p, 1), s1d = DeviceCopy(s1, 1), s2d = DeviceCopy(s2, 1);
    // Steps made so far; HostBackend's device memory is host memory.
    std::vector<float> counters(sizes.size(), 3.0f);
    std::vector<float*> counter_ptrs;
    for (float& c : counters) counter_ptrs.push_back(&c);
    int64_t host_step = 3;
    ga_apply_options o{};
    o.grad_scale = 0.25;
    o.clip = kGaClipGlobalNorm;
    o.max_norm = 0.5;
    o.skip_nonfinite = 1;
    o.reset = 1;
    o.optimizer = opt;
    o.lr = 1e-2;
    o.weight_decay = 0.1;
    o.beta1 = 0.9;
    o.beta2 = 0.999;
    o.adam_eps = 1e-8;
    for (int call = 0; call < 4; ++call) {
      SCOPED_TRACE(call);
      const bool skipped = call == 1 || call == 2;
      TensorList a(kGaFloat32, sizes, 1);
      a.FillUniform(rng, -2, 2);
      if (call == 2) a[3].Set(17, std::nan(""));
      TensorList ah = DeviceCopy(a, 1), ad = DeviceCopy(a, 1);
      TestTensor flag = DeviceScalar(kGaFloat32, call == 1 ? 1.0 : 0.0);
      const auto p_before = pd.Values(), s1_before = s1d.Values(), s2_before = s2d.Values();
      HostBackend b;
      if (!skipped) ++host_step;
      o.step = host_step;
      o.step_counters = nullptr;
      ga_apply_tensors th{ph.list(), ah.list(), s1h.list(), s2h.list(), {nullptr, 0}};
      ASSERT_EQ(gc::apply(b, &th, &o, static_cast<const float*>(flag.data()), nullptr,
                          "accumulators", "params"),
                kGaOk)
          << ga_last_error();
      o.step = 0;  // not read with counters
      o.step_counters = counter_ptrs.data();
      ga_apply_tensors td{pd.list(), ad.list(), s1d.list(), s2d.list(), {nullptr, 0}};
      TestTensor stats(kGaFloat32, 3, 0);
      ASSERT_EQ(
          gc::apply(b, &td, &o, static_cast<const float*>(flag.data()),
                    static_cast<ga_cuda_apply_stats*>(stats.data()), "accumulators", "params"),
          kGaOk)
          << ga_last_error();
      for (float c : counters) EXPECT_EQ(c, static_cast<float>(host_step));
      EXPECT_EQ(stats.Get(2), skipped ? 1.0 : 0.0);
      ExpectListsNear(pd, ph, 0);
      ExpectListsNear(s1d, s1h, 0);
      ExpectListsNear(s2d, s2h, 0);
      for (size_t i = 0; i < ad.size(); ++i)
        for (double x : ad[i].Values()) ASSERT_EQ(x, 0.0);
      if (skipped) {
        EXPECT_EQ(pd.Values(), p_before);
        EXPECT_EQ(s1d.Values(), s1_before);
        EXPECT_EQ(s2d.Values(), s2_before);
      } else {
        EXPECT_NE(pd.Values(), p_before) << "an applied boundary must move the weights";
      }
    }
    EXPECT_EQ(counters[0], 5.0f);
  }
}

TEST(CudaEmulated, AdamStepCountersOfDifferentStepsMatchTheHostCore) {
  // Tensors that joined at different times (steps 0, 7, 2, 7, 1) in one call, more tensors than
  // one launch holds: each is updated with its own bias corrections, as the CPU core with the
  // same counters (which applies them in runs of one step), and each counter advances by one.
  auto rng = Rng(22);
  std::vector<int64_t> sizes;
  for (int i = 0; i < 2 * gc::kMaxTensors + 3; ++i) sizes.push_back(1 + (i * 37) % 300);
  TensorList p(kGaFloat32, sizes, 0), s1(kGaFloat32, sizes, 0), s2(kGaFloat32, sizes, 0),
      a(kGaFloat32, sizes, 0);
  p.FillUniform(rng, -1, 1);
  s1.FillUniform(rng, -0.1, 0.1);
  s2.FillUniform(rng, 0.0, 0.01);
  a.FillUniform(rng, -2, 2);
  const float pattern[5] = {0, 7, 2, 7, 1};
  std::vector<float> host_counters, dev_counters;
  for (size_t i = 0; i < sizes.size(); ++i) host_counters.push_back(pattern[i % 5]);
  dev_counters = host_counters;
  std::vector<float*> hp, dp;
  for (size_t i = 0; i < sizes.size(); ++i) {
    hp.push_back(&host_counters[i]);
    dp.push_back(&dev_counters[i]);
  }
  TensorList pd = DeviceCopy(p, 1), s1d = DeviceCopy(s1, 1), s2d = DeviceCopy(s2, 1),
             ad = DeviceCopy(a, 1);
  ga_apply_options o{};
  o.grad_scale = 0.5;
  o.optimizer = kGaOptimizerAdamW;
  o.lr = 1e-2;
  o.weight_decay = 0.01;
  o.beta1 = 0.9;
  o.beta2 = 0.99;
  o.adam_eps = 1e-8;
  o.reset = 1;
  o.step_counters = hp.data();
  ga_apply_tensors th{p.list(), a.list(), s1.list(), s2.list(), {nullptr, 0}};
  ASSERT_EQ(ga_apply(&th, &o, nullptr), kGaOk) << ga_last_error();
  o.step_counters = dp.data();
  HostBackend b;
  ga_apply_tensors td{pd.list(), ad.list(), s1d.list(), s2d.list(), {nullptr, 0}};
  ASSERT_EQ(gc::apply(b, &td, &o, nullptr, nullptr, "accumulators", "params"), kGaOk)
      << ga_last_error();
  for (size_t i = 0; i < sizes.size(); ++i) {
    EXPECT_EQ(dev_counters[i], pattern[i % 5] + 1.0f) << i;
    EXPECT_EQ(host_counters[i], pattern[i % 5] + 1.0f) << i;
  }
  // The CPU kernels round in another order (vector FMAs): within 2e-6 as the other CPU/CUDA
  // comparisons; a wrong step (bias corrections of step 1 against step 8 differ by 5x) is far
  // outside that.
  ExpectListsNear(pd, p, 2e-6, 1e-2);
  ExpectListsNear(s1d, s1, 2e-6, 1e-2);
  ExpectListsNear(s2d, s2, 2e-6, 1e-2);
}

TEST(CudaEmulated, ApplyUsesTheCallersDeviceClipCoefficient) {
  auto rng = Rng(8);
  TensorList p(kGaFloat32, {3000}, 0), a(kGaFloat32, {3000}, 0);
  p.FillUniform(rng, -1, 1);
  a.FillUniform(rng, -1, 1);
  TensorList pd = DeviceCopy(p, 0), ad = DeviceCopy(a, 0);
  TestTensor coef = DeviceScalar(kGaFloat32, 0.125);
  ga_apply_options o{};
  o.grad_scale = 2.0;
  o.clip = kGaClipGlobalNorm;
  o.clip_coef = static_cast<const float*>(coef.data());
  o.optimizer = kGaOptimizerSGD;
  o.lr = 1.0;
  ga_apply_tensors t{pd.list(), ad.list(), {nullptr, 0}, {nullptr, 0}, {nullptr, 0}};
  HostBackend b;
  ASSERT_EQ(gc::apply(b, &t, &o, nullptr, nullptr, "accumulators", "params"), kGaOk);
  std::vector<double> want(3000);
  for (int i = 0; i < 3000; ++i) want[i] = p[0].Get(i) - 0.25 * a[0].Get(i);
  EXPECT_TRUE(Near(pd[0].Values(), want, 1e-6, kGaFloat32));
}

TEST(CudaEmulated, AdaptiveClipMatchesCpu) {
  auto rng = Rng(9);
  const std::vector<int64_t> sizes = {128 * 96, 96, 5 * 7};
  TensorList p(kGaBFloat16, sizes, 1), g(kGaFloat32, sizes, 1);
  p.FillUniform(rng, -1, 1);
  g.FillUniform(rng, -5, 5);
  TensorList pd = DeviceCopy(p, 1), gd = DeviceCopy(g, 1);
  const std::vector<ga_units> u = {
      {128, kGaUnitsLeading}, {1, kGaUnitsLeading}, {7, kGaUnitsTrailing}};
  ASSERT_EQ(ga_adaptive_clip(p.list(), g.list(), u.data(), 0.01, 1e-3), kGaOk);
  HostBackend b;
  ASSERT_EQ(gc::adaptive_clip(b, pd.list(), gd.list(), u.data(), 0.01, 1e-3), kGaOk);
  ExpectListsNear(gd, g, 1e-6);
}

TEST(CudaEmulated, ZeroClearsEveryDtypeAndNothingElse) {
  auto rng = Rng(11);
  const std::vector<int64_t> sizes = {3, 16385, 0, 77};
  TensorList x(Cycle({kGaFloat32, kGaBFloat16, kGaFloat16}, sizes.size()), sizes, 1);
  x.FillUniform(rng, 1, 2);
  TensorList xd = DeviceCopy(x, 1);
  HostBackend b;
  ASSERT_EQ(gc::zero(b, xd.list()), kGaOk);
  for (size_t i = 0; i < xd.size(); ++i)
    for (double v : xd[i].Values()) ASSERT_EQ(v, 0.0);
  EXPECT_TRUE(xd.GuardsIntact());
}

TEST(CudaEmulated, BatchNormMergeAndRunningMatchCpu) {
  auto rng = Rng(12);
  TensorList st({kGaFloat64, kGaFloat64, kGaFloat32, kGaFloat32}, {37, 37, 37, 37}, 0);
  st.FillUniform(rng, 0.1, 2);
  TensorList sd = DeviceCopy(st, 0);
  double ca = 24, cad = 24;
  ASSERT_EQ(ga_bn_merge(&ca, st.desc(0), st.desc(1), 8, st.desc(2), st.desc(3)), kGaOk);
  HostBackend b;
  ASSERT_EQ(gc::bn_merge(b, &cad, sd.desc(0), sd.desc(1), 8, sd.desc(2), sd.desc(3)), kGaOk);
  EXPECT_EQ(cad, ca);
  ExpectListsNear(sd, st, 1e-15);
  TensorList run({kGaFloat32, kGaFloat32}, {37, 37}, 0);
  run.FillUniform(rng, 0, 1);
  TensorList rd = DeviceCopy(run, 0);
  ASSERT_EQ(ga_bn_update_running(run.desc(0), run.desc(1), st.desc(0), st.desc(1), ca, 0.1, 1),
            kGaOk);
  ASSERT_EQ(gc::bn_update_running(b, rd.desc(0), rd.desc(1), sd.desc(0), sd.desc(1), cad, 0.1, 1),
            kGaOk);
  ExpectListsNear(rd, run, 1e-7);
}

// ---- the device's 16-byte words: element 0 of a pair is the low half (little-endian) ----

TEST(CudaEmulated, VectorWordsPackElementsInMemoryOrder) {
  auto rng = Rng(13);
  std::uniform_real_distribution<float> dist(-100, 100);
  for (int i = 0; i < 1000; ++i) {
    const float a = dist(rng), b = dist(rng);
    const gc::bf16 pair_b[2] = {gc::from_f<gc::bf16>(a), gc::from_f<gc::bf16>(b)};
    const gc::f16 pair_h[2] = {gc::from_f<gc::f16>(a), gc::from_f<gc::f16>(b)};
    uint32_t wb, wh;
    std::memcpy(&wb, pair_b, 4);
    std::memcpy(&wh, pair_h, 4);
    ASSERT_EQ(gc::pack_halves<gc::bf16>(a, b), wb);
    ASSERT_EQ(gc::pack_halves<gc::f16>(a, b), wh);
    ASSERT_EQ(gc::lo_half(wb, gc::bf16{}), gc::to_f(pair_b[0]));
    ASSERT_EQ(gc::hi_half(wb, gc::bf16{}), gc::to_f(pair_b[1]));
    ASSERT_EQ(gc::lo_half(wh, gc::f16{}), gc::to_f(pair_h[0]));
    ASSERT_EQ(gc::hi_half(wh, gc::f16{}), gc::to_f(pair_h[1]));
  }
}

// ---- bad input: the CUDA pipelines share the CPU checks and write nothing on error ----

TEST(CudaEmulated, RejectsCpuTensorsOtherDevicesAndDtypesWithoutWriting) {
  TensorList acc(kGaFloat32, {10, 20}, 0), g(kGaBFloat16, {10, 20}, 0);
  TensorList ad = DeviceCopy(acc, 0), gd = DeviceCopy(g, 0);
  HostBackend b;
  ga_accumulate_options o{kGaAccumulateSum, 1.0, 0.0, 0};
  gd.desc(1).device_type = kGaCPU;
  const auto snap = Snapshot(ad, gd);
  EXPECT_TRUE(FailsWith(gc::accumulate(b, ad.list(), gd.list(), &o, nullptr, nullptr), kGaTypeError,
                        {"grads[1]"}));
  gd.desc(1).device_type = kGaCUDA;
  gd.desc(1).device_id = 1;
  EXPECT_TRUE(FailsWith(gc::accumulate(b, ad.list(), gd.list(), &o, nullptr, nullptr), kGaTypeError,
                        {"grads[1]"}));
  gd.desc(1).device_id = 0;
  TensorList a64 = DeviceCopy(TensorList(kGaFloat64, {10, 20}, 0), 0);
  EXPECT_TRUE(FailsWith(gc::accumulate(b, a64.list(), gd.list(), &o, nullptr, nullptr),
                        kGaTypeError, {"accumulators[0]"}));
  o.weight = -1;
  EXPECT_TRUE(FailsWith(gc::accumulate(b, ad.list(), gd.list(), &o, nullptr, nullptr),
                        kGaInvalidArgument, {"weight"}));
  EXPECT_EQ(Snapshot(ad, gd), snap);
  EXPECT_EQ(b.launches(), 0);
  // The CPU entry points still refuse CUDA descriptors.
  o.weight = 1;
  EXPECT_TRUE(FailsWith(ga_accumulate(ad.list(), gd.list(), &o, 0, nullptr),
                        UnsupportedOrTypeError(), {"accumulators[0]"}));
}

TEST(CudaEmulated, ApplyRejectsBadInputWithoutLaunching) {
  TensorList p(kGaFloat32, {10}, 0), a(kGaFloat32, {10}, 0), m(kGaFloat32, {10}, 0);
  TensorList pd = DeviceCopy(p, 0), ad = DeviceCopy(a, 0), md = DeviceCopy(m, 0);
  ga_apply_options o{};
  o.grad_scale = 1.0;
  o.optimizer = kGaOptimizerAdam;
  o.beta1 = 1.5;
  o.beta2 = 0.9;
  o.step = 1;
  ga_apply_tensors t{pd.list(), ad.list(), md.list(), md.list(), {nullptr, 0}};
  HostBackend b;
  const auto snap = Snapshot(pd, ad, md);
  EXPECT_TRUE(FailsWith(gc::apply(b, &t, &o, nullptr, nullptr, "accumulators", "params"),
                        kGaInvalidArgument, {"beta1"}));
  o.beta1 = 0.9;
  EXPECT_TRUE(FailsWith(gc::apply(b, &t, &o, nullptr, nullptr, "accumulators", "params"),
                        kGaInvalidArgument, {"state1[0]", "state2[0]"}));  // state1 is state2
  EXPECT_EQ(Snapshot(pd, ad, md), snap);
  EXPECT_EQ(b.launches(), 0);
}

}  // namespace
