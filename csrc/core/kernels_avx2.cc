// CPU kernels compiled for the avx2 target (flags set in CMakeLists.txt).
#define GA_KERNEL_TABLE kernels_avx2
#define GA_KERNEL_ISA "avx2"
#define GA_HAVE_HW_FMA 1
#include "kernels_impl.inc"
