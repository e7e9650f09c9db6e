// Private helpers of the core: error reporting, argument checks, the CPU kernel table.
#ifndef GRADIENT_ACCUMULATOR_CORE_INTERNAL_H_
#define GRADIENT_ACCUMULATOR_CORE_INTERNAL_H_

#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <new>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "gradient_accumulator/gradient_accumulator.h"

// MSVC (not clang-cl) has neither GCC's builtins nor, under its default /openmp (OpenMP 2.0), the
// `omp simd` directive, which it rejects as an error (C3001). GA_MSVC_COMPAT selects the portable
// code instead; defining it by hand compiles that code with any compiler (the packaging tests
// build the core so with g++).
#if defined(_MSC_VER) && !defined(__clang__) && !defined(GA_MSVC_COMPAT)
#define GA_MSVC_COMPAT 1
#endif

// `#pragma omp simd <clauses>` where the compiler has it; nothing (the auto-vectorizer) there.
#if defined(GA_MSVC_COMPAT)
#define GA_OMP_SIMD(...)
#else
#define GA_PRAGMA_(text) _Pragma(#text)
#define GA_OMP_SIMD(...) GA_PRAGMA_(omp simd __VA_ARGS__)
#endif

namespace ga {
namespace detail {

/// Thrown inside the core, turned into a status at the C boundary by `guarded`.
struct CoreError {
  ga_status status;
  std::string argument;
  std::string message;
};

void set_last_error(ga_status status, const std::string& argument, const std::string& message);
void clear_last_error();

[[noreturn]] inline void fail(ga_status status, const std::string& argument,
                              const std::string& message) {
  throw CoreError{status, argument, message};
}

/// Run `body` and translate whatever it throws into a status; nothing escapes into C.
template <typename F>
ga_status guarded(F&& body) noexcept {
  try {
    clear_last_error();
    body();
    return kGaOk;
  } catch (const CoreError& e) {
    set_last_error(e.status, e.argument, e.message);
    return e.status;
  } catch (const std::bad_alloc&) {
    set_last_error(kGaRuntimeError, "", "out of host memory");
    return kGaRuntimeError;
  } catch (const std::exception& e) {
    set_last_error(kGaRuntimeError, "", e.what());
    return kGaRuntimeError;
  } catch (...) {
    set_last_error(kGaRuntimeError, "", "unknown error in the gradient-accumulator core");
    return kGaRuntimeError;
  }
}

const char* dtype_name(ga_dtype dtype);

/// The integer stored in an enum field or argument, read as its underlying type. A C caller may
/// store any int there, but loading a C++ enum whose value lies outside its enumerators' range
/// is undefined, so every enum that comes from a caller is read this way and validated first.
template <typename E>
inline int64_t raw_enum(const E& value) {
  static_assert(std::is_enum_v<E>, "raw_enum reads enums");
  std::underlying_type_t<E> v;
  std::memcpy(&v, &value, sizeof v);
  return static_cast<int64_t>(v);
}

/// a·b and a + b for sizes and counts (both ≥ 0): fails naming `name` instead of wrapping.
inline bool mul_overflows(int64_t a, int64_t b, int64_t* r) {
#if defined(GA_MSVC_COMPAT)
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  constexpr int64_t kMin = std::numeric_limits<int64_t>::min();
  if (a != 0 && b != 0) {
    if (a > 0 ? (b > 0 ? a > kMax / b : b < kMin / a) : (b > 0 ? a < kMin / b : a < kMax / b))
      return true;
  }
  *r = a * b;
  return false;
#else
  return __builtin_mul_overflow(a, b, r);
#endif
}
inline bool add_overflows(int64_t a, int64_t b, int64_t* r) {
#if defined(GA_MSVC_COMPAT)
  if (b > 0 ? a > std::numeric_limits<int64_t>::max() - b
            : a < std::numeric_limits<int64_t>::min() - b)
    return true;
  *r = a + b;
  return false;
#else
  return __builtin_add_overflow(a, b, r);
#endif
}

inline int64_t checked_mul(int64_t a, int64_t b, const std::string& name) {
  int64_t r;
  if (mul_overflows(a, b, &r))
    fail(kGaInvalidArgument, name,
         name + ": " + std::to_string(a) + " * " + std::to_string(b) + " overflows int64");
  return r;
}
inline int64_t checked_add(int64_t a, int64_t b, const std::string& name) {
  int64_t r;
  if (add_overflows(a, b, &r))
    fail(kGaInvalidArgument, name,
         name + ": " + std::to_string(a) + " + " + std::to_string(b) + " overflows int64");
  return r;
}

/// Whether a double survives the conversion to float32 as a usable factor: zero, or a finite
/// normal float32 (a smaller one would flush towards 0, a larger one become ±inf).
inline bool fits_float32(double v) {
  const double a = v < 0 ? -v : v;
  return a == 0.0 || (a >= static_cast<double>(std::numeric_limits<float>::min()) &&
                      a <= static_cast<double>(std::numeric_limits<float>::max()));
}
/// "%.6g" of v, for messages.
std::string format_double(double v);
/// Fails naming `name` unless `v` fits_float32: for scalars the float32 kernels multiply with.
void check_fits_float32(double v, const std::string& name, const char* why);

/// "list[i]": built for every tensor a call checks, so no ostream (locale look-ups per call).
inline std::string item(const std::string& list, int64_t i) {
  return list + "[" + std::to_string(i) + "]";
}

/// Checks a descriptor: known dtype, non-negative numel, data present, device allowed.
void check_tensor(const ga_tensor& t, const std::string& name);
void check_list(const ga_tensor_list& list, const std::string& name);
void check_same_sizes(const ga_tensor_list& a, const std::string& a_name, const ga_tensor_list& b,
                      const std::string& b_name);
void check_dtype_in(const ga_tensor& t, const std::string& name,
                    std::initializer_list<ga_dtype> allowed);
void check_list_dtype_in(const ga_tensor_list& l, const std::string& name,
                         std::initializer_list<ga_dtype> allowed);
/// All tensors of the core's CPU kernels must be on the CPU (CUDA ones go to the CUDA build).
void check_cpu(const ga_tensor& t, const std::string& name);
void check_all_cpu(std::initializer_list<std::pair<const ga_tensor_list*, const char*>> lists);
/// For the CUDA entry points: every tensor on a CUDA device, the same one (*device, -1 = any yet).
void check_cuda(const ga_tensor& t, const std::string& name, int32_t* device);
void check_all_cuda(std::initializer_list<std::pair<const ga_tensor_list*, const char*>> lists,
                    int32_t* device);

/// A named byte range, for overlap checks.
struct Range {
  uintptr_t begin, end;
  const char* base;    // the tensor's name, or its list's (a string literal)
  int64_t index = -1;  // its index in the list (the name is built only for an error)
  std::string name() const { return index < 0 ? std::string(base) : item(base, index); }
};
/// `name` must outlive the ranges (the callers pass string literals): nothing is copied per
/// tensor.
void add_ranges(std::vector<Range>& out, const ga_tensor_list& list, const char* name);
void add_range(std::vector<Range>& out, const ga_tensor& t, const char* name);
/// Fails with kGaInvalidArgument naming both tensors if any two written ranges overlap, or a
/// written range overlaps a read range (read ranges may overlap each other).
void check_disjoint(const std::vector<Range>& written, const std::vector<Range>& read);

// ---- validation of each op family, shared by the CPU and CUDA entry points: everything is
// checked before anything is written; `device` selects the device and dtype rules ----

/// The accumulate formula's coefficients: acc ← alpha·acc + beta·g for these options (checked;
/// `fp32`: the accumulators are float32, so both must fit it).
void accumulate_coefficients(const ga_accumulate_options& options, bool fp32, double* alpha,
                             double* beta);
/// ga_wgrad_accumulate's checks (CPU and CUDA): shapes chain, dtypes, devices, the accumulator
/// dense and disjoint from the inputs; the accumulate formula's coefficients out.
void validate_wgrad(const ga_matrix* acc, const ga_matrix* dy, const ga_matrix* x,
                    const ga_accumulate_options* options, ga_device_type device, double* alpha,
                    double* beta);
void validate_accumulate(const ga_tensor_list& accumulators, const ga_tensor_list& grads,
                         const ga_accumulate_options* options, ga_device_type device, double* alpha,
                         double* beta);
/// `lists_checked`: skip the checks of the lists themselves (lengths, dtypes, devices,
/// overlaps), which a call with the same registered lists and list rules passed before; the
/// options, the AGC units and the float32 range of the options are checked still.
void validate_apply(const ga_apply_tensors& t, const ga_apply_options& o, const char* acc_name,
                    const char* param_name, ga_device_type device, bool lists_checked = false);
ga_status run_apply_lists_checked(const ga_apply_tensors* tp, const ga_apply_options* op,
                                  ga_apply_result* result, const char* acc_name,
                                  const char* param_name, bool lists_checked);
void validate_unitwise_norm(const ga_tensor& tensor, const ga_units& units, const ga_tensor& norms,
                            ga_device_type device);
void validate_bn_merge(const double* count_a, const ga_tensor& mean_a, const ga_tensor& m2_a,
                       double count_b, const ga_tensor& mean_b, const ga_tensor& m2_b,
                       ga_device_type device);
void validate_bn_update(const ga_tensor& running_mean, const ga_tensor& running_var,
                        const ga_tensor& mean, const ga_tensor& m2, double count, double new_weight,
                        int unbiased, ga_device_type device);

/// AGC as an apply: no optimizer, gradient scale 1, the clipped gradient written in place.
inline void agc_as_apply(const ga_tensor_list& params, const ga_tensor_list& grads,
                         const ga_units* units, double clip_factor, double eps, ga_apply_tensors* t,
                         ga_apply_options* o) {
  *t = ga_apply_tensors{};
  t->params = params;
  t->accumulators = grads;
  *o = ga_apply_options{};
  o->grad_scale = 1.0;
  o->clip = kGaClipAgc;
  o->clip_factor = clip_factor;
  o->agc_eps = eps;
  o->units = units;
  o->optimizer = kGaOptimizerNone;
}

// ---- CPU kernels, compiled once per instruction set and chosen at run time ----

/// One contiguous piece of work: elements [begin, end) of tensor `tensor`.
struct Chunk {
  int64_t tensor;
  int64_t begin;
  int64_t end;
};

/// Elements below which a chunked kernel runs on the calling thread: waking a thread team
/// costs more than a few microseconds of work, and far more on a busy machine.
constexpr int64_t kParallelMinElems = 1 << 15;

/// Whether the chunks hold enough work to be worth a parallel region.
inline bool worth_threads(const Chunk* chunks, int64_t num_chunks) {
  int64_t elems = 0;
  for (int64_t c = 0; c < num_chunks && elems < kParallelMinElems; ++c)
    elems += chunks[c].end - chunks[c].begin;
  return elems >= kParallelMinElems;
}

constexpr int64_t kChunk = 16384;
/// Split every tensor of a list into chunks of at most kChunk elements (fixed: results that
/// are reduced over chunks do not depend on the thread count).
void make_chunks(const ga_tensor_list& list, std::vector<Chunk>& chunks);

struct AccumulateArgs {
  const ga_tensor* acc;
  const ga_tensor* grads;
  float alpha;  // acc ← alpha·acc + beta·g (alpha ignored on overwrite)
  float beta;
  bool overwrite;
  bool want_sumsq;
  const Chunk* chunks;
  int64_t num_chunks;
  uint8_t* chunk_nonfinite;  // per chunk
  double* chunk_sumsq;       // per chunk (when want_sumsq)
  double alpha64 = 1.0;      // alpha and beta unrounded, for fp64 accumulators
  double beta64 = 0.0;
};

struct SumsqArgs {
  const ga_tensor* tensors;
  const Chunk* chunks;
  int64_t num_chunks;
  double* chunk_sumsq;  // per chunk
};

/// Per-unit Σx² of one tensor into `out` (num_units doubles, zeroed by the kernel).
struct UnitSumsqArgs {
  ga_tensor tensor;
  ga_units units;
  double* out;
};

struct ApplyArgs {
  const ga_apply_tensors* t;
  const ga_apply_options* o;
  float grad_scale;            // grad_scale · global clip coefficient
  const float* unit_scale;     // AGC: grad_scale · coefficient of every unit of every tensor
  const int64_t* unit_offset;  // AGC: index of tensor i's first unit in unit_scale
  const Chunk* chunks;
  int64_t num_chunks;
  double grad_scale64 = 1.0;             // the same unrounded, for float64 accumulators
  const double* unit_scale64 = nullptr;  // the same unrounded (AGC)
  uint8_t* chunk_nonfinite = nullptr;    // set: dry run, write nothing, flag per chunk whether
                                         // any value the update would store is not finite
};

struct BnMomentsArgs {
  ga_tensor x;
  int64_t outer, channels, inner;
  double* mean;  // channels doubles
  double* m2;
};

struct Kernels {
  const char* isa;
  void (*accumulate)(const AccumulateArgs&);
  void (*sumsq)(const SumsqArgs&);
  void (*unit_sumsq)(const UnitSumsqArgs&);
  void (*apply)(const ApplyArgs&);
  void (*bn_moments)(const BnMomentsArgs&);
  void (*zero)(const ga_tensor& t);
};

const Kernels& cpu_kernels();

}  // namespace detail
}  // namespace ga

#endif  // GRADIENT_ACCUMULATOR_CORE_INTERNAL_H_
