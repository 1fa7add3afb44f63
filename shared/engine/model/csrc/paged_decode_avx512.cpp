// The paged decode kernel compiled for AVX-512 (x86-64, GCC); used only where the CPU reports it.
#include "paged_decode_params.h"

#ifdef PD_MULTI_TARGET
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,f16c,bmi2")
#define PD_LANES 16
#define PD_VECTOR_REGISTERS 32  // 32 zmm
namespace pdserve::avx512 {
#include "paged_decode_kernel.h"
}
#pragma GCC pop_options
#endif
