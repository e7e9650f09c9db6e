// The accumulator arena: layout planning, aligned allocation, zeroing.
#include <cstdlib>
#include <cstring>
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

extern "C" ga_status ga_arena_alloc(int64_t numel, ga_device_type device_type, int32_t device_id,
                                    void** data) {
  return guarded([&] {
    if (data == nullptr) fail(kGaInvalidArgument, "data", "data is null");
    if (numel < 0) fail(kGaInvalidArgument, "numel", "numel must be >= 0");
    const int64_t device = raw_enum(device_type);  // any int may arrive from C
    if (device == kGaCUDA) {
      // On a GPU the framework owns the accumulators' memory (its caching allocator and
      // streams): allocate them there, e.g. torch.zeros(..., device="cuda").
      fail(kGaUnsupported, "device",
           "the arena is host memory; allocate CUDA accumulators with the framework");
    }
    if (device != kGaCPU) fail(kGaTypeError, "device", "unknown device");
    (void)device_id;
    // numel·4 rounded up to 64 bytes must not wrap (a wrapped size would allocate too little).
    const int64_t exact = checked_mul(numel, static_cast<int64_t>(sizeof(float)), "numel");
    size_t bytes = static_cast<size_t>(checked_add(exact, 63, "numel")) / 64 * 64;
    if (bytes == 0) bytes = 64;
    void* p = std::aligned_alloc(64, bytes);
    if (p == nullptr) fail(kGaRuntimeError, "numel", "out of host memory for the arena");
    std::memset(p, 0, bytes);
    *data = p;
  });
}

extern "C" void ga_arena_free(void* data, ga_device_type device_type, int32_t) {
  if (data != nullptr && device_type == kGaCPU) std::free(data);
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
