// The accumulator arena's layout planning, and zeroing.
#include <string>

#include "internal.h"

using namespace ga::detail;

extern "C" ga_status ga_arena_plan(const int64_t* numels, int64_t n,
                                   const ga_arena_plan_options* options, int64_t* offsets,
                                   int64_t* bucket_of, int64_t* bucket_start, int64_t* num_buckets,
                                   int64_t* total_numel) {
  return guarded([&] {
    if (options == nullptr) fail(kGaInvalidArgument, "options", "options is null");
    if (n < 0) fail(kGaInvalidArgument, "numels", "the number of tensors must be >= 0");
    if (n > 0 && (numels == nullptr || offsets == nullptr || bucket_of == nullptr))
      fail(kGaInvalidArgument, "numels", "null array");
    if (bucket_start == nullptr || num_buckets == nullptr || total_numel == nullptr)
      fail(kGaInvalidArgument, "bucket_start", "null output");
    const int64_t align = options->alignment;
    if (align < 1 || (align & (align - 1)) != 0)
      fail(kGaInvalidArgument, "alignment", "alignment must be a power of two >= 1");
    if (options->bucket_numel < 1)
      fail(kGaInvalidArgument, "bucket_numel", "bucket_numel must be >= 1");
    for (int64_t i = 0; i < n; ++i)
      if (numels[i] < 0) fail(kGaInvalidArgument, item("numels", i), "element counts must be >= 0");
    // The arena's size, every count rounded up to the alignment, must fit in int64: checked
    // here, before any output is written, so that the layout pass below cannot wrap.
    int64_t size = 0;
    for (int64_t i = 0; i < n; ++i) {
      const std::string name = item("numels", i);
      size = checked_add(size, checked_add(numels[i], align - 1, name) / align * align, name);
    }
    int64_t pos = 0, bucket = 0, in_bucket = 0;
    bucket_start[0] = 0;
    for (int64_t k = 0; k < n; ++k) {
      const int64_t i = options->reverse ? n - 1 - k : k;
      if (in_bucket >= options->bucket_numel) {  // close the full bucket before this tensor
        ++bucket;
        bucket_start[bucket] = pos;
        in_bucket = 0;
      }
      offsets[i] = pos;
      bucket_of[i] = bucket;
      const int64_t padded = (numels[i] + align - 1) / align * align;  // checked above
      pos += padded;
      in_bucket += padded;
    }
    *num_buckets = n > 0 ? bucket + 1 : 0;
    bucket_start[*num_buckets] = pos;
    *total_numel = pos;
  });
}

extern "C" ga_status ga_zero(ga_tensor_list tensors) {
  return guarded([&] {
    check_list(tensors, "tensors");
    check_all_cpu({{&tensors, "tensors"}});
    std::vector<Range> w;
    add_ranges(w, tensors, "tensors");
    check_disjoint(w, {});
    for (int64_t i = 0; i < tensors.size; ++i) cpu_kernels().zero(tensors.tensors[i]);
  });
}
