// Error state, argument checks and CPU kernel dispatch shared by every op family.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>

#include "internal.h"

#if defined(_OPENMP)
#include <omp.h>
#endif

#ifndef GA_VERSION_STRING
#define GA_VERSION_STRING "0.0.0"
#endif

namespace ga {
namespace detail {

namespace {
thread_local std::string g_message;
thread_local std::string g_argument;
}  // namespace

void set_last_error(ga_status, const std::string& argument, const std::string& message) {
  g_argument = argument;
  g_message = message;
}

void clear_last_error() {
  g_argument.clear();
  g_message.clear();
}

const char* dtype_name(ga_dtype dtype) {
  switch (raw_enum(dtype)) {
    case kGaFloat32:
      return "float32";
    case kGaFloat16:
      return "float16";
    case kGaBFloat16:
      return "bfloat16";
    case kGaFloat64:
      return "float64";
    default:
      return "unknown";
  }
}

std::string format_double(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

void check_fits_float32(double v, const std::string& name, const char* why) {
  if (!fits_float32(v))
    fail(kGaInvalidArgument, name,
         name + " = " + format_double(v) +
             " is not representable as a normal float32 (0 or "
             "1.18e-38 <= |x| <= 3.4e38), the precision it is used in " +
             why);
}

void check_tensor(const ga_tensor& t, const std::string& name) {
  const int64_t dtype = raw_enum(t.dtype), device = raw_enum(t.device_type);
  if (dtype < kGaFloat32 || dtype > kGaFloat64)
    fail(kGaTypeError, name, name + " has an unknown dtype (" + std::to_string(dtype) + ")");
  if (t.numel < 0) fail(kGaInvalidArgument, name, name + " has a negative element count");
  if (t.numel > 0 && t.data == nullptr) fail(kGaInvalidArgument, name, name + " has no data");
  if (device != kGaCPU && device != kGaCUDA)
    fail(kGaTypeError, name, name + " is on an unknown device (" + std::to_string(device) + ")");
  const int64_t size = static_cast<int64_t>(ga_dtype_size(t.dtype));
  if (t.numel > 0 && reinterpret_cast<uintptr_t>(t.data) % size != 0)
    fail(kGaInvalidArgument, name, name + " is not aligned to its element size");
  // Its byte range must be addressable: no wrap in numel·size or in data + bytes.
  const int64_t bytes = checked_mul(t.numel, size, name);
  if (reinterpret_cast<uintptr_t>(t.data) > UINTPTR_MAX - static_cast<uintptr_t>(bytes))
    fail(kGaInvalidArgument, name, name + " extends past the end of the address space");
}

void check_list(const ga_tensor_list& list, const std::string& name) {
  if (list.size < 0) fail(kGaInvalidArgument, name, name + " has a negative length");
  if (list.size > 0 && list.tensors == nullptr)
    fail(kGaInvalidArgument, name, name + " is a null list");
  // The names are built only for a tensor that fails: calls on many tensors pay per tensor.
  for (int64_t i = 0; i < list.size; ++i) {
    const ga_tensor& t = list.tensors[i];
    const int64_t dtype = raw_enum(t.dtype), device = raw_enum(t.device_type);
    const bool plain =
        dtype >= kGaFloat32 && dtype <= kGaFloat64 && t.numel >= 0 &&
        (device == kGaCPU || device == kGaCUDA) &&
        (t.numel == 0 || (t.data != nullptr && t.numel < (int64_t{1} << 40) &&
                          reinterpret_cast<uintptr_t>(t.data) % ga_dtype_size(t.dtype) == 0 &&
                          reinterpret_cast<uintptr_t>(t.data) < (uintptr_t{1} << 62)));
    if (!plain) check_tensor(t, item(name, i));
  }
}

void check_same_sizes(const ga_tensor_list& a, const std::string& a_name, const ga_tensor_list& b,
                      const std::string& b_name) {
  if (a.size != b.size) {
    fail(kGaInvalidArgument, b_name,
         b_name + " has " + std::to_string(b.size) + " tensors but " + a_name + " has " +
             std::to_string(a.size));
  }
  for (int64_t i = 0; i < a.size; ++i) {
    if (a.tensors[i].numel != b.tensors[i].numel) {
      fail(kGaInvalidArgument, item(b_name, i),
           item(b_name, i) + " has " + std::to_string(b.tensors[i].numel) + " elements but " +
               item(a_name, i) + " has " + std::to_string(a.tensors[i].numel));
    }
  }
}

void check_dtype_in(const ga_tensor& t, const std::string& name,
                    std::initializer_list<ga_dtype> allowed) {
  if (std::find(allowed.begin(), allowed.end(), t.dtype) != allowed.end()) return;
  std::string list;
  for (ga_dtype d : allowed) list += std::string(list.empty() ? "" : ", ") + dtype_name(d);
  fail(kGaTypeError, name,
       name + " has dtype " + dtype_name(t.dtype) + "; expected one of: " + list);
}

void check_list_dtype_in(const ga_tensor_list& l, const std::string& name,
                         std::initializer_list<ga_dtype> allowed) {
  for (int64_t i = 0; i < l.size; ++i)
    if (std::find(allowed.begin(), allowed.end(), l.tensors[i].dtype) == allowed.end())
      check_dtype_in(l.tensors[i], item(name, i), allowed);
}

void check_cpu(const ga_tensor& t, const std::string& name) {
  if (t.device_type != kGaCPU) {
    fail(ga_has_cuda() ? kGaTypeError : kGaUnsupported, name,
         name + (ga_has_cuda() ? " is on a CUDA device; every tensor of one call must be on "
                                 "the same device"
                               : " is on a CUDA device, but this build of gradient-accumulator "
                                 "has no CUDA kernels (rebuild with -DGA_CUDA=ON)"));
  }
}

void check_all_cpu(std::initializer_list<std::pair<const ga_tensor_list*, const char*>> lists) {
  for (const auto& [list, name] : lists)
    for (int64_t i = 0; i < list->size; ++i)
      if (list->tensors[i].device_type != kGaCPU) check_cpu(list->tensors[i], item(name, i));
}

void check_cuda(const ga_tensor& t, const std::string& name, int32_t* device) {
  if (t.device_type != kGaCUDA)
    fail(kGaTypeError, name,
         name + " is a CPU tensor; every tensor of one call must be on the same CUDA device");
  if (*device < 0) *device = t.device_id;
  if (t.device_id != *device)
    fail(kGaTypeError, name,
         name + " is on cuda:" + std::to_string(t.device_id) +
             " but the call's other tensors "
             "are on cuda:" +
             std::to_string(*device));
}

void check_all_cuda(std::initializer_list<std::pair<const ga_tensor_list*, const char*>> lists,
                    int32_t* device) {
  for (const auto& [list, name] : lists)
    for (int64_t i = 0; i < list->size; ++i) {
      const ga_tensor& t = list->tensors[i];
      if (t.device_type == kGaCUDA && *device >= 0 && t.device_id == *device) continue;
      check_cuda(t, item(name, i), device);
    }
}

void add_range(std::vector<Range>& out, const ga_tensor& t, const char* name) {
  if (t.numel == 0) return;
  const uintptr_t b = reinterpret_cast<uintptr_t>(t.data);
  out.push_back(Range{b, b + static_cast<uintptr_t>(t.numel) * ga_dtype_size(t.dtype), name});
}

void add_ranges(std::vector<Range>& out, const ga_tensor_list& list, const char* name) {
  out.reserve(out.size() + static_cast<size_t>(list.size));
  for (int64_t i = 0; i < list.size; ++i) {
    const ga_tensor& t = list.tensors[i];
    if (t.numel == 0) continue;
    const uintptr_t b = reinterpret_cast<uintptr_t>(t.data);
    out.push_back(Range{b, b + static_cast<uintptr_t>(t.numel) * ga_dtype_size(t.dtype), name, i});
  }
}

void check_disjoint(const std::vector<Range>& written, const std::vector<Range>& read) {
  // The written ranges are sorted by start and checked against each other; each read range is
  // then looked up in them by binary search (reads may overlap each other). A call's written
  // tensors are mostly the same from call to call (the accumulators, the optimizer state): the
  // sorted order of the last list seen is kept and reused while its ranges are unchanged, so a
  // repeated call sorts nothing.
  struct Span {
    uintptr_t begin, end;
    uint32_t index;  // into `written`
  };
  static thread_local std::vector<std::pair<uintptr_t, uintptr_t>> seen;  // the list, in order
  static thread_local std::vector<Span> sorted;
  bool same = seen.size() == written.size();
  for (size_t i = 0; same && i < written.size(); ++i)
    same = seen[i].first == written[i].begin && seen[i].second == written[i].end;
  if (!same) {
    seen.clear();
    sorted.clear();
    sorted.reserve(written.size());
    for (size_t i = 0; i < written.size(); ++i)
      sorted.push_back({written[i].begin, written[i].end, static_cast<uint32_t>(i)});
    auto before = [](const Span& a, const Span& b) { return a.begin < b.begin; };
    if (!std::is_sorted(sorted.begin(), sorted.end(), before))
      std::sort(sorted.begin(), sorted.end(), before);
    for (size_t i = 1; i < sorted.size(); ++i) {
      if (sorted[i - 1].end > sorted[i].begin) {
        const Range& later = written[sorted[i].index];
        const Range& earlier = written[sorted[i - 1].index];
        sorted.clear();
        fail(kGaInvalidArgument, later.name(),
             later.name() + " overlaps " + earlier.name() +
                 " in memory (the buffers must not alias)");
      }
    }
    seen.reserve(written.size());
    for (const Range& r : written) seen.emplace_back(r.begin, r.end);
  }
  // Disjoint and sorted by start, the written ranges are sorted by end too: the first one
  // ending after a read range starts is the only one that can overlap it.
  for (const Range& r : read) {
    auto it = std::upper_bound(sorted.begin(), sorted.end(), r.begin,
                               [](uintptr_t x, const Span& s) { return x < s.end; });
    if (it != sorted.end() && it->begin < r.end) {
      const Range& w = written[it->index];
      fail(kGaInvalidArgument, w.name(),
           w.name() + " overlaps " + r.name() + " in memory (the buffers must not alias)");
    }
  }
}

void make_chunks(const ga_tensor_list& list, std::vector<Chunk>& chunks) {
  chunks.clear();
  for (int64_t i = 0; i < list.size; ++i) {
    const int64_t n = list.tensors[i].numel;
    for (int64_t b = 0; b < n; b += kChunk) chunks.push_back(Chunk{i, b, std::min(n, b + kChunk)});
  }
}

const Kernels& kernels_generic();
#if defined(GA_HAVE_X86_KERNELS)
const Kernels& kernels_avx2();
const Kernels& kernels_avx512();
#endif

const Kernels& cpu_kernels() {
  static const Kernels& chosen = []() -> const Kernels& {
#if defined(GA_HAVE_X86_KERNELS)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl"))
      return kernels_avx512();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kernels_avx2();
#endif
    return kernels_generic();
  }();
  return chosen;
}

}  // namespace detail
}  // namespace ga

extern "C" {

const char* ga_last_error(void) { return ga::detail::g_message.c_str(); }
const char* ga_last_error_argument(void) { return ga::detail::g_argument.c_str(); }

size_t ga_dtype_size(ga_dtype dtype) {
  switch (ga::detail::raw_enum(dtype)) {  // any int may arrive from C: read it as one
    case kGaFloat32:
      return 4;
    case kGaFloat16:
      return 2;
    case kGaBFloat16:
      return 2;
    case kGaFloat64:
      return 8;
    default:
      return 0;
  }
}

const char* ga_version(void) { return GA_VERSION_STRING; }

const char* ga_cpu_isa(void) { return ga::detail::cpu_kernels().isa; }

int ga_cpu_num_threads(void) {
#if defined(_OPENMP)
  return omp_get_max_threads();
#else
  return 1;
#endif
}

#if !defined(GA_WITH_CUDA)
int ga_has_cuda(void) { return 0; }
#endif

}  // extern "C"
