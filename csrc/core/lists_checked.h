// For the Python binding's registered tensor sets (csrc/python/module.cc): the fused apply
// without the checks of the tensor lists themselves (lengths, dtypes, devices, overlaps), for
// lists whose descriptors a call with the same rules already checked. The options, the AGC
// units and the float32 range of the options are checked as in ga_apply. Not part of the C API.
#ifndef GRADIENT_ACCUMULATOR_CORE_LISTS_CHECKED_H_
#define GRADIENT_ACCUMULATOR_CORE_LISTS_CHECKED_H_

#include "gradient_accumulator/apply.h"

namespace ga {

ga_status apply_lists_checked(const ga_apply_tensors* tensors, const ga_apply_options* options,
                              ga_apply_result* result);

}  // namespace ga

#endif  // GRADIENT_ACCUMULATOR_CORE_LISTS_CHECKED_H_
