/* Thin C++ wrapper over the C API: exceptions instead of status codes. */
#ifndef GRADIENT_ACCUMULATOR_CPP_H_
#define GRADIENT_ACCUMULATOR_CPP_H_

#include <stdexcept>
#include <string>

#include "gradient_accumulator/gradient_accumulator.h"

namespace ga {

/** \brief An error reported by the core, with the offending argument's name. */
class Error : public std::runtime_error {
 public:
  Error(ga_status status, std::string argument, const std::string& message)
      : std::runtime_error(message), status_(status), argument_(std::move(argument)) {}
  ga_status status() const noexcept { return status_; }
  const std::string& argument() const noexcept { return argument_; }

 private:
  ga_status status_;
  std::string argument_;
};

/** \brief Throw ga::Error for any status other than kGaOk. */
inline void check(ga_status status) {
  if (status != kGaOk) throw Error(status, ga_last_error_argument(), ga_last_error());
}

/** \brief A ga_tensor_list over a contiguous array of descriptors. */
template <typename Container>
inline ga_tensor_list as_list(const Container& tensors) {
  return ga_tensor_list{tensors.data(), static_cast<int64_t>(tensors.size())};
}

}  // namespace ga

#endif  // GRADIENT_ACCUMULATOR_CPP_H_
