// CPU kernels compiled for the generic target (flags set in CMakeLists.txt).
#define GA_KERNEL_TABLE kernels_generic
#define GA_KERNEL_ISA "generic"
#include "kernels_impl.inc"
