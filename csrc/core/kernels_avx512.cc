// CPU kernels compiled for the avx512 target (flags set in CMakeLists.txt).
#define GA_KERNEL_TABLE kernels_avx512
#define GA_KERNEL_ISA "avx512"
#define GA_HAVE_HW_FMA 1
#include "kernels_impl.inc"
