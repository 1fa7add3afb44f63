// The paged decode kernel compiled for AVX2 + FMA (x86-64, GCC); used only where the CPU reports them.
#include "paged_decode_params.h"

#ifdef PD_MULTI_TARGET
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi2")
#define PD_LANES 8
#define PD_VECTOR_REGISTERS 16  // 16 ymm
namespace pdserve::avx2 {
#include "paged_decode_kernel.h"
}
#pragma GCC pop_options
#endif
