// Pack a tensor list into one flat bucket (for a single collective) and unpack it back.
#include <cmath>
#include <string>
#include <vector>

#include "internal.h"

using namespace ga::detail;

namespace ga {
namespace detail {

void validate_flat(const ga_tensor_list& list, const char* list_name, const ga_tensor& flat,
                   double scale, ga_device_type device) {
  check_list(list, list_name);
  check_tensor(flat, "flat");
  if (!std::isfinite(scale)) fail(kGaInvalidArgument, "scale", "scale must be finite");
  int64_t total = 0;
  for (int64_t i = 0; i < list.size; ++i)
    total = checked_add(total, list.tensors[i].numel, item(list_name, i));
  if (flat.numel < total)
    fail(kGaInvalidArgument, "flat",
         "flat has " + std::to_string(flat.numel) + " elements but the tensors need " +
             std::to_string(total));
  if (device == kGaCUDA) {
    // The CUDA copy multiplies in float32 (the CPU one switches to double for such a scale).
    check_fits_float32(scale, "scale", "by the CUDA copy kernels");
    int32_t id = -1;
    check_all_cuda({{&list, list_name}}, &id);
    check_cuda(flat, "flat", &id);
  } else {
    check_all_cpu({{&list, list_name}});
    check_cpu(flat, "flat");
  }
  const bool to_flat = std::string(list_name) == "src";
  std::vector<Range> w, r;
  add_range(to_flat ? w : r, flat, "flat");
  add_ranges(to_flat ? r : w, list, list_name);
  check_disjoint(w, r);
}

}  // namespace detail
}  // namespace ga

extern "C" ga_status ga_pack(ga_tensor_list src, ga_tensor flat, double scale) {
  return guarded([&] {
    validate_flat(src, "src", flat, scale, kGaCPU);
    int64_t off = 0;
    for (int64_t i = 0; i < src.size; ++i) {
      cpu_kernels().copy_scaled(src.tensors[i], 0, flat, off, src.tensors[i].numel, scale);
      off += src.tensors[i].numel;
    }
  });
}

extern "C" ga_status ga_unpack(ga_tensor flat, ga_tensor_list dst, double scale) {
  return guarded([&] {
    validate_flat(dst, "dst", flat, scale, kGaCPU);
    int64_t off = 0;
    for (int64_t i = 0; i < dst.size; ++i) {
      cpu_kernels().copy_scaled(flat, off, dst.tensors[i], 0, dst.tensors[i].numel, scale);
      off += dst.tensors[i].numel;
    }
  });
}
